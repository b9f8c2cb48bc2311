"""Pipeline parallelism inside Lightning's loop (issue 5): parity, loop features, checkpoints across plans.

Parity is checked as in test_parity_data_parallel: 3 AdamW steps against one process on the same
global batches; losses 1e-5, first-step gradients 1e-3 of their RMS, parameters 1e-4 (fp32).
"""

from __future__ import annotations

import pytest
import torch

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.strategy.checkpoint import consolidate
from tests.helpers.hf_models import hf_gpt2
from tests.helpers.training import (
    assert_close_runs,
    assert_parameters_moved_alike,
    rounding_noise_gradients,
    run_distributed,
    run_single,
    tiny_gpt,
)
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(900)
DEFAULT_STRATEGY = S()


def pipelined(
    world: int, pp: int, schedule: str, micro_batches: int, strategy: S = DEFAULT_STRATEGY, **kwargs
) -> ParallelPlan:
    return ParallelPlan.uniform(world, 4, strategy, pp=pp, schedule=schedule, micro_batches=micro_batches, **kwargs)


PP2_TP2 = pipelined(4, 2, "1f1b", 2, S(tp=2, dp_type="zero3"))
PLANS = {
    "pp2_gpipe": pipelined(2, 2, "gpipe", 2),
    "pp2_1f1b": pipelined(2, 2, "1f1b", 4),
    "pp4_gpipe": pipelined(4, 4, "gpipe", 4),
    "pp4_1f1b": pipelined(4, 4, "1f1b", 4),
    "pp2_interleaved_1f1b_2_virtual_stages": pipelined(2, 2, "interleaved_1f1b", 2, virtual_stages=2),
    # Fewer micro-batches than stages: torch's interleaved schedule runs them (one round), so the rules admit it.
    "pp2_interleaved_1f1b_one_micro_batch": pipelined(2, 2, "interleaved_1f1b", 1, virtual_stages=2),
    "pp2_tp2_zero3": PP2_TP2,
    "pp1_four_micro_batches": pipelined(4, 1, "1f1b", 2, S(tp=2, dp_type="zero2")),
}
WORLD = {name: plan.world_size for name, plan in PLANS.items()}


@pytest.mark.parametrize("name", list(PLANS))
def test_pipeline_parity(pools, name):
    expected = run_single()
    result = pools(WORLD[name]).run(run_distributed, PLANS[name])[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_interleaved_with_micro_batches_not_a_multiple_of_pp(pools):
    """m = 3 at pp = 2: torch's interleaved schedule runs one round of 3, so the rules admit it; it trains as one
    process does."""
    plan = pipelined(2, 2, "interleaved_1f1b", 3, virtual_stages=2)
    expected = run_single(global_batch=6)
    result = pools(2).run(run_distributed, plan, global_batch=6)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_pp2_with_heterogeneous_stages_on_eight_processes(pools):
    plan = ParallelPlan(
        world_size=8,
        layers=(
            S(tp=2, dp_type="zero3"),
            S(tp=4, dp_type="ddp", recompute=True),
            S(tp=1, dp_type="zero2"),
            S(tp=2, sp="megatron", tp_consecutive=False),
        ),
        vocab=S(tp=2),
        pp=2,
        partition=(1, 3),
        schedule="1f1b",
        micro_batches=2,
    )
    expected = run_single()
    result = pools(8).run(run_distributed, plan)[0]
    assert_close_runs(result, expected, **FP32_TOL)


@pytest.mark.parametrize(
    ("feature", "options"),
    [
        ("clipping", dict(gradient_clip_val=0.05)),
        ("gradient_accumulation", dict(accumulate_grad_batches=2, max_steps=2)),
        ("tied_embedding_and_head", dict(model_kwargs=dict(tie_weights=True), gradient_clip_val=0.05)),
    ],
)
def test_loop_features_under_a_pipeline(pools, feature, options):
    expected = run_single(**options)
    if feature == "clipping":
        total_norm = torch.cat([g.flatten() for g in expected.grads.values()]).norm()
        assert total_norm > 10 * 0.05  # clipping is active
    result = pools(4).run(run_distributed, PP2_TP2, **options)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_tied_weights_skip_middle_stages(pools):
    options = dict(model_kwargs=dict(tie_weights=True))
    expected = run_single(**options)
    result = pools(4).run(run_distributed, PLANS["pp4_1f1b"], **options)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_hugging_face_gpt2_pipelined(pools):
    """GPT-2 (tied embedding and head, HF's own forward) across two stages with tensor parallelism."""
    expected = run_single(model=hf_gpt2)
    result = pools(4).run(run_distributed, PP2_TP2.replace(vocab=S(tp=2)), model=hf_gpt2)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_validation_loss_under_a_pipeline(pools):
    expected = run_single(validate=True)
    result = pools(4).run(run_distributed, PP2_TP2, validate=True)[0]
    assert result.val_loss == pytest.approx(expected.val_loss, abs=1e-5)


def _predictions(plan: ParallelPlan | None) -> torch.Tensor:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_galvatron import GalvatronStrategy
    from tests.helpers.training import dataset

    world = 1 if plan is None else plan.world_size
    strategy = "auto" if plan is None else GalvatronStrategy(plan=plan, save_plan=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_progress_bar=False)
    batches = trainer.predict(tiny_gpt(), DataLoader(dataset(8), batch_size=8 // world))
    return torch.cat(batches)


def test_predict_under_a_pipeline(pools):
    """Predictions come from the last stage, joined over micro-batches; each rank keeps DDP's share of them."""
    expected = _predictions(None)
    plan = PP2_TP2.replace(vocab=S(tp=2))  # one data shard: the ranks predict their 8 samples together
    for rank, rank_predictions in enumerate(pools(4).run(_predictions, plan)):
        assert torch.equal(rank_predictions, expected[rank::4])  # DDP's predict sampler: samples rank, rank + 4


DP4 = ParallelPlan.uniform(4, 4, S(dp_type="zero3"))


@pytest.mark.parametrize(
    ("save_plan", "resume_plan"), [(PP2_TP2, DP4), (DP4, PP2_TP2)], ids=["pp2xtp2_to_dp4", "dp4_to_pp2xtp2"]
)
def test_resume_under_another_plan(pools, tmp_path, save_plan, resume_plan):
    epochs = dict(max_steps=-1, num_samples=16)  # 2 steps per epoch
    uninterrupted = run_single(max_epochs=2, **epochs)
    checkpoint = str(tmp_path / "epoch1.ckpt")
    first = pools(4).run(run_distributed, save_plan, max_epochs=1, save_path=checkpoint, **epochs)[0]
    resumed = pools(4).run(run_distributed, resume_plan, max_epochs=2, ckpt_path=checkpoint, **epochs)[0]
    torch.testing.assert_close(
        torch.tensor(first.losses + resumed.losses), torch.tensor(uninterrupted.losses), atol=1e-5, rtol=0
    )
    assert_parameters_moved_alike(
        resumed.state,
        uninterrupted.state,
        uninterrupted.initial,
        FP32_TOL["param_rtol"],
        FP32_TOL["param_mean_rtol"],
        skip=rounding_noise_gradients(uninterrupted.grads),
    )

    # The sharded checkpoint becomes one file for the plain model.
    model_file = consolidate(checkpoint, tmp_path / "model.pt")
    plain = tiny_gpt()
    plain.load_state_dict(torch.load(model_file), strict=True)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, first.state[name], atol=0, rtol=0)
