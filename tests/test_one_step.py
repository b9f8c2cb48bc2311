"""Training, a trial and the dry run take one step (issue 45): :mod:`lightning_galvatron.runtime.step`.

Measured selection times a trial's step and the dry run proves the collective order of its step; both hold only while
their step is the one that trains. On a tiny GPT trained by SGD (Adam's first step is blind to a gradient's scale, so
to clipping) with ``gradient_clip_val`` low enough that clipping bites (by norm; by value in one case, which the
dry run does not clip by), the parameters after one optimizer step are the same whether the step ran

(a) in ``Trainer.fit`` under ``GalvatronStrategy``,
(b) in a trial (:class:`~lightning_galvatron.strategy.trials.TrialRunner`, with the Trainer's ``gradient_clip_val``),
(c) on a simulated rank of the dry run with real tensors (:func:`lightning_galvatron.dryrun.rank._run`; here on the
    pool's real gloo group and with the model's own weights instead of zeros, so that its values mean something).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPTModule
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.training import (
    SEQ,
    TINY_GPT,
    assert_parameters_moved_alike,
    dataset,
    gather_full_state,
    run_distributed,
)

pytestmark = pytest.mark.timeout(300)

CLIP = 0.02
GLOBAL_BATCH = 8
PP2 = ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2, global_batch_size=GLOBAL_BATCH)
TP2 = ParallelPlan.uniform(2, 4, S(tp=2), micro_batches=2, global_batch_size=GLOBAL_BATCH)
CASES = {  # plan, tied embedding and head, gradient_clip_algorithm
    "ddp": (ParallelPlan.uniform(2, 4, S(), global_batch_size=GLOBAL_BATCH), False, "norm"),
    "pipeline_tied_weights": (PP2, True, "norm"),
    "tensor_parallel_micro_batches": (TP2, False, "norm"),
    "tensor_parallel_by_value": (TP2, False, "value"),
}
_made: list[GPTModule] = []  # every module whose optimizers were made: the last one is the trial's copy


class _SgdGPT(GPTModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        _made.append(self)
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _model(tie_weights: bool) -> _SgdGPT:
    torch.manual_seed(1234)
    return _SgdGPT(**{**TINY_GPT, "tie_weights": tie_weights})


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    data = dataset(GLOBAL_BATCH)  # the training run's only batch
    return data.inputs, data.targets


def _trial_step(plan: ParallelPlan, tie_weights: bool, algorithm: str) -> dict[str, torch.Tensor] | None:
    import lightning.pytorch as L

    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.model.outside_layers import trace_outside_layers
    from lightning_galvatron.runtime.mesh import MeshCache
    from lightning_galvatron.selection import TrialSettings
    from lightning_galvatron.strategy.precision import GalvatronFullPrecision
    from lightning_galvatron.strategy.preparation import overridden_step_methods
    from lightning_galvatron.strategy.trials import TrialRunner

    module, batch = _model(tie_weights), _global_batch()
    trainer = L.Trainer(  # what the trial reads of the Trainer: gradient_clip_val and the precision plugin
        accelerator="cpu",
        devices=1,
        plugins=[GalvatronFullPrecision()],
        gradient_clip_val=CLIP,
        gradient_clip_algorithm=algorithm,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    runner = TrialRunner(
        module,
        trainer,
        None,
        batch,
        MeshCache.shared("cpu"),
        trainer.precision_plugin,
        torch.device("cpu"),
        overridden_step_methods(module),
        False,
        lambda: trace_outside_layers(module, find_blocks(module), "training_step", batch),
    )
    _made.clear()
    settings = TrialSettings(warmup_steps=0, timed_steps=1, measure_memory=False)  # one step
    measurement, _ = runner.run(plan, settings, observe=False)
    assert measurement.error is None, measurement.error
    return gather_full_state(_made[-1])


def _dry_run_step(plan: ParallelPlan, tie_weights: bool) -> dict[str, torch.Tensor] | None:
    from lightning_galvatron.dryrun import rank as simulated
    from lightning_galvatron.dryrun.trace import Recording
    from lightning_galvatron.runtime.apply import input_shard

    module = _model(tie_weights)
    inputs, targets = _global_batch()
    rank = dist.get_rank()

    def make_batch(size: int, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_shards, shard = input_shard(plan, rank)  # this rank's shard, as a trial takes it
        start = shard * size if size * num_shards == GLOBAL_BATCH else 0
        return inputs[start : start + size, :seq_length], targets[start : start + size, :seq_length]

    job = simulated.RankJob(
        module,
        plan,
        "32-true",
        SEQ,
        make_batch,
        phases=("train",),
        measure_memory=False,
        keep_stacks=False,
        gradient_clip_val=CLIP,
        real_tensors=True,
    )
    zero_filled = simulated._materialize
    simulated._materialize = lambda module, real=False: None  # keep the model's weights
    try:
        result = simulated.RankResult(rank, rank // plan.devices_per_stage)
        simulated._run(job, rank, Recording(rank, plan.world_size, keep_stacks=False), result)
    finally:
        simulated._materialize = zero_filled
    return gather_full_state(module)


def _one_step_each_way(plan: ParallelPlan, tie_weights: bool, algorithm: str) -> dict[str, Any]:
    trained = run_distributed(
        plan=plan,
        model=lambda: _model(tie_weights),
        global_batch=GLOBAL_BATCH,
        num_samples=GLOBAL_BATCH,
        max_steps=1,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm=algorithm,
    )
    ways = {"trained": trained, "trial": _trial_step(plan, tie_weights, algorithm)}
    if algorithm == "norm":  # the dry run's RankJob clips by norm only
        ways["dry run"] = _dry_run_step(plan, tie_weights)
    return ways


@pytest.mark.parametrize("case", list(CASES))
def test_training_a_trial_and_the_dry_run_take_the_same_clipped_step(pools, case: str) -> None:
    out = pools(2).run(_one_step_each_way, *CASES[case])[0]
    trained = out.pop("trained")
    gradients = torch.cat([g.flatten() for g in trained.grads.values()])
    # Clipping bites: unclipped, the step would be several times longer (by norm) or change direction (by value).
    assert float(gradients.norm()) > 5 * CLIP and float(gradients.abs().max()) > 5 * CLIP
    for way, state in out.items():
        assert state.keys() == trained.state.keys(), way
        try:
            assert_parameters_moved_alike(state, trained.state, trained.initial, rtol=1e-3)
        except AssertionError as error:
            raise AssertionError(f"{way}: {error}") from None
