"""Every checkpoint resumes (issue 13): any plan kind into any plan kind and world size, bit-identical on the same plan.

The README example (``configs/gpt_tiny_cpu_auto.yaml``: ``examples/gpt.py``'s GPT, hidden 64, sequence 32, a 2GB
budget) trains on a global batch of 16 whatever the world size, so the same samples make every step and runs on
1, 2 and 4 devices can continue one another. Checkpoints are Lightning's own: ``ModelCheckpoint`` or
``trainer.save_checkpoint`` at the end of an epoch, resumed with ``Trainer.fit(ckpt_path=...)``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from examples.gpt import ArithmeticText, GPTModule
from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.training import (
    QUICK_TRIALS,
    _LossRecorder,
    _merge_over_ranks,
    assert_parameters_moved_alike,
    gather_full_state,
    rounding_noise_gradients,
    run_distributed,
)
from tests.test_parity_data_parallel import FP32_TOL, MIXED_DP_PLAN

pytestmark = pytest.mark.timeout(600)

EXAMPLE_MODEL = dict(n_layer=4, n_head=4, n_embd=64, seq_length=32, learning_rate=0.003)  # gpt_tiny_cpu_auto.yaml
EXAMPLE_BUDGET = "2GB"
GLOBAL_BATCH = 16
DDP_PIPELINE = ParallelPlan.uniform(4, 4, S(), pp=2, schedule="gpipe")  # what `plan: auto` chose for 4 CPU processes
TP_ZERO3 = ParallelPlan.uniform(4, 4, S(tp=2, dp_type="zero3"), vocab=S(tp=2))
PP2_TP2_ZERO2 = ParallelPlan(
    world_size=4,
    layers=(S(tp=2), S(tp=2, dp_type="zero2"), S(dp_type="zero3"), S(recompute=True)),
    pp=2,
    schedule="1f1b",
    micro_batches=2,
)


def _fit(
    plan: Any,
    cache: str,
    *,
    train_samples: int,
    max_steps: int = -1,
    max_epochs: int | None = None,
    ckpt_path: str | None = None,
    save_path: str | None = None,
    checkpoint_every: int | None = None,
    checkpoint_dir: str | None = None,
    trials: Any = QUICK_TRIALS,
) -> dict[str, Any]:
    """The README example on this pool's ranks (DataLoader batch = global batch / devices, as DDP would)."""
    world = dist.get_world_size()
    L.seed_everything(0, verbose=False)
    module = GPTModule(**EXAMPLE_MODEL)
    loader = DataLoader(ArithmeticText(train_samples, 32, seed=0), batch_size=GLOBAL_BATCH // world, shuffle=True)
    strategy = GalvatronStrategy(
        plan=plan, memory_budget=EXAMPLE_BUDGET, profile_cache=cache, save_plan=False, trials=trials
    )
    recorder = _LossRecorder()
    callbacks: list[Any] = [recorder]
    if checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=checkpoint_every, save_top_k=-1))
    trainer = L.Trainer(
        default_root_dir=tempfile.gettempdir(),
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_checkpointing=bool(checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=callbacks,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if save_path is not None:
        trainer.save_checkpoint(save_path)
    losses = torch.tensor(recorder.losses, dtype=torch.float64)
    dist.all_reduce(losses)  # every rank logs the same loss (pipelines replay the last stage's)
    return dict(
        losses=(losses / world).tolist(),
        plan=strategy.plan,
        state=gather_full_state(trainer.lightning_module),
        grads=_merge_over_ranks(recorder.grads),
        dtensors=any(type(p).__name__ == "DTensor" for p in trainer.lightning_module.parameters()),
    )


def test_the_issue_reproduction_resumes_with_identical_losses(pools, tmp_path, profile_cache):
    """A DDP-only pipeline (no DTensor parameter anywhere), ModelCheckpoint every 16 steps, resume from step 32."""
    directory, cache = str(tmp_path / "ck"), str(profile_cache)
    common = dict(train_samples=512, max_steps=40, checkpoint_every=16, checkpoint_dir=directory)
    first = pools(4).run(_fit, DDP_PIPELINE, cache, **common)[0]
    assert not first["dtensors"]
    assert sorted(p.name for p in Path(directory).iterdir()) == ["epoch=0-step=16.ckpt", "epoch=0-step=32.ckpt"]
    resumed = pools(4).run(_fit, DDP_PIPELINE, cache, ckpt_path=f"{directory}/epoch=0-step=32.ckpt", **common)[0]
    assert resumed["losses"] == first["losses"][32:]  # bit-identical
    for name, value in first["state"].items():
        assert torch.equal(resumed["state"][name], value), name


def _resumed_matches(resumed: dict, first: dict, uninterrupted: dict, exact: bool) -> None:
    losses = first["losses"] + resumed["losses"]
    if exact:
        assert losses == uninterrupted["losses"]
        assert all(torch.equal(resumed["state"][k], v) for k, v in uninterrupted["state"].items())
        return
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted["losses"]), atol=1e-5, rtol=0)
    assert_parameters_moved_alike(
        resumed["state"],
        uninterrupted["state"],
        first["initial"],
        FP32_TOL["param_rtol"],
        FP32_TOL["param_mean_rtol"],
        skip=rounding_noise_gradients(uninterrupted["grads"]),  # Adam turns their rounding noise into steps
    )


def test_resume_across_plan_kinds_and_world_sizes(pools, tmp_path, profile_cache):
    """Save under one plan, resume under another: the README example's automatic plans at 2 and 4 devices (the
    4-device one a DDP pipeline here), ZeRO-3 with tensor parallelism, a mixed pipeline, pure DDP."""
    cache = str(profile_cache)
    epoch = dict(train_samples=64)  # 4 steps per epoch
    ck = {name: str(tmp_path / f"{name}.ckpt") for name in ("auto4", "tp_zero3", "pp2_tp2", "auto2")}

    def first_epoch(world: int, plan: Any, name: str) -> dict:
        first = pools(world).run(_fit, plan, cache, max_epochs=1, save_path=ck[name], **epoch)[0]
        first["initial"] = _initial_state()
        return first

    auto4 = pools(4).run(_fit, "auto", cache, max_epochs=2, **epoch)[0]  # the uninterrupted runs to continue
    auto2 = pools(2).run(_fit, "auto", cache, max_epochs=2, **epoch)[0]
    auto4_first, auto2_first = first_epoch(4, "auto", "auto4"), first_epoch(2, "auto", "auto2")
    tp_first, pp_first = first_epoch(4, TP_ZERO3, "tp_zero3"), first_epoch(4, PP2_TP2_ZERO2, "pp2_tp2")
    assert auto4_first["plan"] == auto4["plan"]

    cases = [  # (world, resume plan, checkpoint, its first half, the uninterrupted run it continues, bit-identical)
        (4, "auto", "auto4", auto4_first, auto4, True),
        (4, TP_ZERO3, "auto4", auto4_first, auto4, False),
        (4, "auto", "tp_zero3", tp_first, auto4, False),
        (4, ParallelPlan.uniform(4, 4, S()), "pp2_tp2", pp_first, auto4, False),
        (4, PP2_TP2_ZERO2, "auto2", auto2_first, auto2, False),
        (2, "auto", "auto2", auto2_first, auto2, True),
        (2, "auto", "auto4", auto4_first, auto4, False),
        (1, ParallelPlan.uniform(1, 4, S()), "auto4", auto4_first, auto4, False),
    ]
    for world, plan, name, first, uninterrupted, exact in cases:
        resumed = pools(world).run(_fit, plan, cache, max_epochs=2, ckpt_path=ck[name], **epoch)[0]
        _resumed_matches(resumed, first, uninterrupted, exact)


def _initial_state() -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    return {k: v.detach().float().clone() for k, v in GPTModule(**EXAMPLE_MODEL).state_dict().items()}


def test_resume_into_the_automatic_plan_on_one_device(pools, tmp_path, profile_cache):
    cache, checkpoint = str(profile_cache), str(tmp_path / "ddp2.ckpt")
    pools(2).run(_fit, ParallelPlan.uniform(2, 4, S()), cache, train_samples=64, max_epochs=1, save_path=checkpoint)
    pools(1).run(_fit, "auto", cache, train_samples=64, max_epochs=2, ckpt_path=checkpoint)


def test_full_checkpoint_files_resume_into_plans_without_a_pipeline(pools, tmp_path):
    """``save_distributed_checkpoint=False``: one file on rank 0, resumed by parameter name into another plan; a
    pipeline stage cannot place its position-keyed optimizer states, and saving one under a pipeline would keep only
    stage 0, so both are refused with the reason."""
    epochs, checkpoint = dict(max_steps=-1, num_samples=16), str(tmp_path / "full.ckpt")
    ddp = ParallelPlan.uniform(4, 4, S())
    uninterrupted = pools(4).run(run_distributed, ddp, max_epochs=2, **epochs)[0]
    full = dict(save_distributed_checkpoint=False)
    first = pools(4).run(run_distributed, ddp, max_epochs=1, save_path=checkpoint, strategy_kwargs=full, **epochs)[0]
    assert Path(checkpoint).is_file()
    resumed = pools(4).run(run_distributed, MIXED_DP_PLAN, max_epochs=2, ckpt_path=checkpoint, **epochs)[0]
    torch.testing.assert_close(
        torch.tensor(first.losses + resumed.losses), torch.tensor(uninterrupted.losses), atol=1e-5, rtol=0
    )
    with pytest.raises(
        AssertionError,
        match=r"CheckpointError: '.*full\.ckpt' is a full checkpoint file .*; resume it "
        r"with a plan without pipeline stages \(pp=1\)",
    ):
        pools(4).run(run_distributed, DDP_PIPELINE, max_epochs=2, ckpt_path=checkpoint, **epochs)
    with pytest.raises(
        AssertionError,
        match=r"PlanError: save_distributed_checkpoint=False gathers the model on rank 0, "
        r"which holds only pipeline stage 0 of this pp=2 plan",
    ):
        pools(4).run(run_distributed, DDP_PIPELINE, max_epochs=1, strategy_kwargs=full, **epochs)


#: GPT-2's fused q/k/v split by heads is a strided shard, which DCP alone would write over its neighbours' rows.
FUSED_QKV_TP = ParallelPlan(world_size=2, layers=(S(tp=2),) * 4, vocab=S(tp=2))


def test_fused_projections_under_tensor_parallelism_save_and_resume(pools, tmp_path):
    """Hugging Face GPT-2 under tp=2 (strided shards of ``c_attn``): saved after one epoch of one step, resumed under
    the same plan (bit-identical to the uninterrupted run) and under plain DDP (as close as any two plans)."""
    from tests.helpers.model_families import family

    gpt2, checkpoint = family("gpt2"), str(tmp_path / "tp.ckpt")
    common = dict(model=gpt2, num_samples=8, global_batch=8)
    uninterrupted = pools(2).run(run_distributed, FUSED_QKV_TP, max_epochs=2, **common)[0]
    pools(2).run(run_distributed, FUSED_QKV_TP, max_epochs=1, save_path=checkpoint, **common)
    same = pools(2).run(run_distributed, FUSED_QKV_TP, max_epochs=2, ckpt_path=checkpoint, **common)[0]
    ddp = pools(2).run(run_distributed, ParallelPlan.uniform(2, 4, S()), max_epochs=2, ckpt_path=checkpoint, **common)[
        0
    ]
    assert same.losses == uninterrupted.losses[1:]
    for name, value in uninterrupted.state.items():
        assert torch.equal(same.state[name], value), name
    torch.testing.assert_close(torch.tensor(ddp.losses), torch.tensor(uninterrupted.losses[1:]), atol=1e-5, rtol=0)
    assert_parameters_moved_alike(
        ddp.state, uninterrupted.state, uninterrupted.initial, FP32_TOL["param_rtol"], FP32_TOL["param_mean_rtol"]
    )


@pytest.fixture(scope="module")
def four_device_checkpoint(pools, tmp_path_factory, linked_profile_cache) -> dict[str, Any]:
    """The README example saved mid-epoch at step 3 on 4 devices (a global batch of 16); the same run never stopped,
    and resumed on the same 4 devices under the same plan (the reference a resume into another count must match
    when the global batch is the same). The profile cache is shared by the resumes, one profile per world size."""
    cache = str(linked_profile_cache(tmp_path_factory.mktemp("resume") / "cache"))
    checkpoint, common = str(Path(cache) / "four.ckpt"), dict(train_samples=512)
    pools(4).run(_fit, DDP_PIPELINE, cache, max_steps=3, save_path=checkpoint, **common)
    never_stopped = pools(4).run(_fit, DDP_PIPELINE, cache, max_steps=8, **common)[0]
    same_count = pools(4).run(_fit, DDP_PIPELINE, cache, max_steps=8, ckpt_path=checkpoint, **common)[0]
    return dict(cache=cache, checkpoint=checkpoint, never_stopped=never_stopped, same_count=same_count)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_a_four_device_checkpoint_resumed_into_another_count_trains_as_ddp_resumed_the_same_way(
    pools, four_device_checkpoint, world
):
    """Issue 44: ``plan="auto"`` resuming the 4-device checkpoint into 2, 3 or 8 devices (a DataLoader batch of
    16 // devices each, so 16, 15 and 16: DDP's policy) logs, step by step, what plain DDP resumed the same way
    logs, and moves the parameters alike. With a global batch of 16 the step's samples are the 4-device run's, so
    the resume also continues as the 4-device resume does: the device count changes nothing.

    The issue's report (resumed into 3 devices: 2.96, 2.87, 2.79, then a jump at step 6) is the training's, not the
    resume's: DDP resumed into 3 devices jumps at step 6 as well, and so does the 4-device run that never stopped.
    (Lightning restarts a mid-epoch resume's plain DataLoader at the epoch's first batch, with a warning, so a resume
    does not continue the never-stopped run's losses under any plan.)"""
    case, common = four_device_checkpoint, dict(train_samples=512, max_steps=8)
    resume = dict(ckpt_path=case["checkpoint"], **common)
    resumed = pools(world).run(_fit, "auto", case["cache"], trials=False, **resume)[0]
    ddp = pools(world).run(_fit, ParallelPlan.uniform(world, 4, S()), case["cache"], **resume)[0]
    assert resumed["plan"].world_size == world and len(resumed["losses"]) == len(ddp["losses"]) == 5  # steps 3..7
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(ddp["losses"]), atol=1e-5, rtol=0)
    assert_parameters_moved_alike(
        resumed["state"],
        ddp["state"],
        _initial_state(),
        FP32_TOL["param_rtol"],
        FP32_TOL["param_mean_rtol"],
        skip=rounding_noise_gradients(ddp["grads"]),  # Adam turns their rounding noise into steps
    )
    if GLOBAL_BATCH % world == 0:
        same = case["same_count"]["losses"]
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(same), atol=1e-5, rtol=0)
    for losses in (ddp["losses"], case["never_stopped"]["losses"][3:]):  # steps 3..7
        assert losses[3] > losses[2] + 0.5 and losses[3] == max(losses), losses  # step 6 jumps, with or without resume
