"""Trainer features in combination on a third-party model (issue 41): Hugging Face GPT-2 at its defaults (a tied
embedding and head), each feature under a 2-stage 1F1B pipeline with 2 micro-batches, tensor parallelism or
``plan="auto"``, against one process on the same global batches (what DDP trains), or refused in ``setup``.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.hf_models import HFCausalLM, hf_gpt2
from tests.helpers.training import assert_close_runs, dataset, gather_full_state, run_distributed, run_single
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(900)
PP2_1F1B = ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2)
TP2 = ParallelPlan.uniform(2, 4, S(tp=2))


def test_gradient_accumulation_with_tied_weights_under_a_pipeline(pools):
    """The tied embedding/head is summed across the end stages once per optimizer step, not once per batch."""
    options = dict(model=hf_gpt2, accumulate_grad_batches=2, max_steps=2)
    expected = run_single(**options)
    result = pools(2).run(run_distributed, PP2_1F1B, **options)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_clipping_by_value_under_tensor_parallelism(pools):
    options = dict(model=hf_gpt2, gradient_clip_val=0.002, gradient_clip_algorithm="value")
    expected = run_single(**options)
    assert max(float(g.abs().max()) for g in expected.grads.values()) > 10 * 0.002  # clipping is active
    result = pools(2).run(run_distributed, TP2, **options)[0]
    assert_close_runs(result, expected, **FP32_TOL)


# ---------------------------------------------------------------------------------------------- lr_find
def _lr_find(plans: list[ParallelPlan | None]) -> list[tuple[list[float], dict[str, torch.Tensor] | None, Any]]:
    """``Tuner.lr_find`` under each plan (``None``: one process): its losses, the model after it and before."""
    import lightning.pytorch as L
    import torch.distributed as dist
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader, DistributedSampler

    out = []
    for plan in plans:
        module = hf_gpt2()
        initial = {name: value.clone() for name, value in module.state_dict().items()}
        data = dataset(64)
        if plan is None:  # the order Lightning's DistributedSampler gives the distributed runs
            loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, 1, 0, shuffle=True, seed=0))
            strategy, devices = "auto", 1
        else:
            loader = DataLoader(data, batch_size=8 // dist.get_world_size(), shuffle=True)
            strategy, devices = GalvatronStrategy(plan=plan, save_plan=False), dist.get_world_size()
        trainer = L.Trainer(
            default_root_dir=tempfile.gettempdir(),
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        finder = Tuner(trainer).lr_find(module, train_dataloaders=loader, num_training=4, early_stop_threshold=None)
        state = gather_full_state(trainer.lightning_module) if plan is not None else module.state_dict()
        out.append((finder.results["loss"], state, initial))
    return out


def test_lr_find_restores_the_model_under_every_plan_kind(pools):
    """The temporary checkpoint loads although lr_find's scheduler added ``initial_lr`` to the optimizer since."""
    ((expected_losses, _, _),) = _lr_find([None])
    for losses, state, initial in pools(2).run(_lr_find, [PP2_1F1B, TP2])[0]:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), atol=1e-5, rtol=0)
        assert state.keys() == initial.keys()
        for name, value in initial.items():
            torch.testing.assert_close(state[name], value.float(), atol=0, rtol=0, msg=name)


# ---------------------------------------------------------------------------------------------- manual optimization
class ManualGPT2(HFCausalLM):
    """GPT-2 trained with manual optimization: its own zero_grad, backward and step."""

    def __init__(self) -> None:
        super().__init__("gpt2")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def manual_gpt2() -> ManualGPT2:
    torch.manual_seed(1234)
    return ManualGPT2()


def test_manual_optimization_under_a_pipeline_is_refused_in_setup(pools):
    """Refused by name before the pipeline's trace runs the step (which met ``self.optimizers()`` unset)."""
    with pytest.raises(AssertionError, match=r"manual optimization \(automatic_optimization = False\) cannot run"):
        pools(2).run(run_distributed, PP2_1F1B, model=manual_gpt2)


def test_manual_optimization_with_the_automatic_plan(pools, profile_cache):
    """plan="auto" profiles the manual step (stand-in optimizers) and searches plans without pipelines and
    micro-batches; training matches one process."""
    expected = run_single(model=manual_gpt2)
    strategy_kwargs = dict(profile_cache=str(profile_cache), save_plan=False)
    result = pools(2).run(run_distributed, model=manual_gpt2, strategy_kwargs=strategy_kwargs)[0]
    assert result.plan.pp == 1 and result.plan.micro_batches == 1
    assert_close_runs(result, expected, **FP32_TOL)
