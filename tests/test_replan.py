"""Re-planning while training (issue 42): a plan that trains slower than the selection's runner-up measured is
replaced in memory, exactly; the rules are pure functions.

The distributed runs start from a cached selection (the realistic case: the second ``fit``), written by one short
``fit`` and then given the plans and measurements each test needs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from examples.gpt import ArithmeticText, GPTModule
from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.strategy.plan_switch import regrouped
from lightning_galvatron.strategy.replan import (
    PAYBACK_STEPS,
    WARMUP_STEPS,
    WINDOW_STEPS,
    why_not_keep,
    why_not_probe,
)
from tests.helpers.plan_check import assert_plan_applied
from tests.helpers.training import (
    QUICK_TRIALS,
    SEQ,
    TINY_GPT,
    _LossRecorder,
    _mean_over_ranks,
    dataset,
    gather_full_state,
)

pytestmark = pytest.mark.timeout(600)

GLOBAL_BATCH = 8
DDP = ParallelPlan.uniform(2, 4, S(), global_batch_size=GLOBAL_BATCH)
ZERO3 = ParallelPlan.uniform(2, 4, S(dp_type="zero3"), vocab=S(dp_type="zero3"), global_batch_size=GLOBAL_BATCH)
TP2 = ParallelPlan.uniform(2, 4, S(tp=2), vocab=S(tp=2), global_batch_size=GLOBAL_BATCH)  # one data shard
PIPELINE = ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2, global_batch_size=GLOBAL_BATCH)
SLOW_S = 0.1  # what _SlowWhereSharded's step sleeps where its weights are sharded


class _SlowWhereSharded(GPTModule):
    """The tiny GPT whose step is slower where its weights are DTensors (ZeRO-3, tensor parallelism): such a plan trains
    slower than a trial of it said, whenever it is measured again."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if any(isinstance(p, DTensor) for p in self.parameters()):
            time.sleep(SLOW_S)
        return super().training_step(batch, batch_idx)


def _model() -> GPTModule:
    torch.manual_seed(1234)
    return _SlowWhereSharded(**TINY_GPT)


class _SwitchAt(L.Callback):
    """Saves a checkpoint after optimizer step ``step``, then moves training to ``plan`` in memory."""

    def __init__(self, step: int, plan: ParallelPlan, checkpoint: str) -> None:
        self.step, self.plan, self.checkpoint = step, plan, checkpoint

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.strategy.plan != self.plan:  # once (accumulation: the next
            trainer.save_checkpoint(self.checkpoint)  # batch ends with the same global step)
            trainer.strategy.replanning.switch(trainer, self.plan)


class _SaveAt(L.Callback):
    def __init__(self, step: int, checkpoint: str) -> None:
        self.step, self.checkpoint = step, checkpoint

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.checkpoint)


def _fit(
    cache: str,
    plan: Any = "auto",
    *,
    num_samples: int,
    max_epochs: int = 1,
    max_steps: int = -1,
    callbacks: tuple = (),
    ckpt_path: str | None = None,
    replan: bool = True,
    validate: bool = False,
    trainer_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The tiny GPT on this pool's ranks, from the cached selection (``plan="auto"``) or a given plan."""
    world = dist.get_world_size()
    strategy = GalvatronStrategy(
        plan=plan, memory_budget="1GB", profile_cache=cache, save_plan=False, trials=QUICK_TRIALS, replan=replan
    )
    recorder = _LossRecorder()
    trainer = L.Trainer(
        default_root_dir=tempfile.gettempdir(),
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=max_epochs,
        max_steps=max_steps,
        callbacks=[recorder, *callbacks],
        **(trainer_options or {}),
    )
    module = _model()
    loader = DataLoader(dataset(num_samples), batch_size=GLOBAL_BATCH // world, shuffle=True)
    validation = DataLoader(ArithmeticText(2 * GLOBAL_BATCH, SEQ, seed=1), batch_size=GLOBAL_BATCH // world)
    trainer.fit(module, loader, val_dataloaders=validation if validate else None, ckpt_path=ckpt_path)
    assert_plan_applied(strategy, _model)  # the parameters, blocks and groups of the plan it ends with
    replanning = strategy.replanning
    return dict(
        losses=_mean_over_ranks(recorder.losses),
        state=gather_full_state(trainer.lightning_module),
        plan=strategy.plan,
        events=list(replanning.events) if replanning is not None else None,
        same_module=trainer.lightning_module is module,
        val_loss=float(trainer.callback_metrics["val_loss"]) if validate else None,
    )


@pytest.fixture(scope="module")
def cached(pools, tmp_path_factory, linked_profile_cache):
    """``cached(tmp_path)``: a profile cache of the test's own holding the selection that one short ``fit`` with
    ``plan="auto"`` caches, and that selection's file (its name: the key of the profile and the settings). The ``fit``
    runs once per module; each test rewrites its own copy."""
    made: list[Path] = []

    def copy(tmp_path: Path) -> tuple[Path, Path]:
        if not made:
            made.append(linked_profile_cache(tmp_path_factory.mktemp("replan") / "cache"))
            pools(2).run(_fit, str(made[0]), num_samples=16, max_steps=1)
        cache = tmp_path / "cache"
        shutil.copytree(made[0], cache, symlinks=True)
        (selection,) = (cache / "selections").glob("*.json")
        return cache, selection

    return copy


def _set_selection(path: Path, chosen: tuple[ParallelPlan, float], runner_up: tuple[ParallelPlan, float]) -> None:
    """The cached selection chose ``chosen[0]``; each plan's trial measured its step time (three steps alike)."""
    data = json.loads(path.read_text())
    data["plan"] = chosen[0].to_dict()
    data["trials"] = [
        {
            "name": name,
            "plan": plan.to_dict(),
            "predicted_step_s": seconds,
            "predicted_peak_bytes": 1e6,
            "step_s": seconds,
            "peak_bytes": 10**6,
            "steps": [seconds] * 3,
        }
        for name, (plan, seconds) in (("searched", chosen), ("other", runner_up))
    ]
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------------------------------------- nothing is lost
@pytest.mark.parametrize(
    ("first", "second"),
    [(ZERO3, DDP), (DDP, TP2), (PIPELINE, DDP), (DDP, PIPELINE)],
    ids=["zero3-to-ddp", "ddp-to-tp2", "pipeline-to-ddp", "ddp-to-pipeline"],
)
def test_a_switch_at_step_k_equals_a_resume_into_the_second_plan_at_step_k(pools, cached, tmp_path, first, second):
    """Switched in memory after step k (the end of the first epoch), the run trains, step by step, what a resume
    from a checkpoint of step k into the second plan trains: the same losses and final parameters, bit for bit. The
    data parallel degrees differ where tensor parallelism or a pipeline comes or goes (the loaders made for the first
    plan keep serving, their samples regrouped); the LightningModule stays the same object."""
    cache, selection = cached(tmp_path)
    _set_selection(selection, (first, 0.01), (second, 1e3))  # never probed by itself: the test moves it
    k, checkpoint, epoch = 4, str(tmp_path / "k.ckpt"), dict(num_samples=4 * GLOBAL_BATCH, validate=True)
    switched = pools(2).run(_fit, str(cache), max_epochs=2, callbacks=(_SwitchAt(k, second, checkpoint),), **epoch)
    resumed = pools(2).run(_fit, str(cache), second, max_epochs=2, ckpt_path=checkpoint, **epoch)
    switched, resumed = switched[0], resumed[0]
    assert switched["plan"] == second and switched["same_module"]
    assert len(switched["losses"]) == 2 * k and switched["losses"][k:] == resumed["losses"]
    assert switched["state"].keys() == resumed["state"].keys()
    for name, value in resumed["state"].items():
        assert torch.equal(switched["state"][name], value), name
    assert switched["val_loss"] == resumed["val_loss"]  # the validation loader, made for the first plan, regrouped


# ---------------------------------------------------------------------------------------------- the automatic switch
def test_a_switch_with_gradient_accumulation_and_clipping_equals_a_resume(pools, cached, tmp_path):
    """With ``accumulate_grad_batches=2`` and norm clipping (features users turn on together), a move after
    optimizer step k -- the end of an accumulation window -- trains what a resume into the second plan trains."""
    cache, selection = cached(tmp_path)
    _set_selection(selection, (DDP, 0.01), (PIPELINE, 1e3))
    k, checkpoint = 4, str(tmp_path / "k.ckpt")
    options = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    epoch = dict(num_samples=8 * GLOBAL_BATCH, trainer_options=options)
    switched = pools(2).run(_fit, str(cache), max_epochs=2, callbacks=(_SwitchAt(k, PIPELINE, checkpoint),), **epoch)
    resumed = pools(2).run(_fit, str(cache), PIPELINE, max_epochs=2, ckpt_path=checkpoint, **epoch)
    switched, resumed = switched[0], resumed[0]
    assert switched["plan"] == PIPELINE
    assert len(switched["losses"]) == 4 * k and switched["losses"][2 * k :] == resumed["losses"]
    for name, value in resumed["state"].items():
        assert torch.equal(switched["state"][name], value), name


def test_a_cached_plan_that_trains_slower_than_the_runner_up_measured_is_replaced_within_the_window(
    pools, cached, tmp_path
):
    """A cached ZeRO-3 plan whose trial said 10 ms, training at over ``SLOW_S`` per step (its step sleeps where weights
    are sharded), and a DDP runner-up measured at 20 ms: the first window sees it, DDP is tried in training and kept,
    the cache now says so, and the run from then on equals a resume into DDP at that step. With ``replan=False`` the
    same run keeps its plan."""
    cache, selection = cached(tmp_path)
    _set_selection(selection, (ZERO3, 0.01), (DDP, 0.02))
    k = WARMUP_STEPS + WINDOW_STEPS  # the first window's end
    # k steps per epoch (a checkpoint at k resumes exactly), and as many steps as a probe at k needs to be made
    run = dict(num_samples=k * GLOBAL_BATCH, max_epochs=-1, max_steps=k + PAYBACK_STEPS)
    checkpoint = str(tmp_path / "k.ckpt")

    kept = pools(2).run(_fit, str(cache), replan=False, **run)[0]
    assert kept["plan"] == ZERO3 and kept["events"] is None
    assert json.loads(selection.read_text())["plan"] == ZERO3.to_dict()

    switched = pools(2).run(_fit, str(cache), callbacks=(_SaveAt(k, checkpoint),), **run)
    switched = switched[0]
    assert switched["plan"] == DDP, switched["events"]
    assert len(switched["events"]) == 2, switched["events"]
    assert f"steps {WARMUP_STEPS + 1}-{k} trained at" in switched["events"][0], switched["events"]
    assert "moved to it in memory" in switched["events"][0] and "re-planned" in switched["events"][1]
    cached = json.loads(selection.read_text())
    assert cached["plan"] == DDP.to_dict()
    measured = {ParallelPlan.from_dict(t["plan"]): t for t in cached["trials"]}
    assert measured[ZERO3]["step_s"] > max(SLOW_S, measured[DDP]["step_s"]), cached["trials"]
    assert len(measured[DDP]["steps"]) == WINDOW_STEPS

    resumed = pools(2).run(_fit, str(cache), DDP, ckpt_path=checkpoint, **run)[0]
    assert switched["losses"][k:] == resumed["losses"]
    for name, value in resumed["state"].items():
        assert torch.equal(switched["state"][name], value), name


def test_a_runner_up_that_does_not_train_faster_is_left_again(pools, cached, tmp_path):
    """A pipeline and a ZeRO-3 runner-up whose cached trial said 0.1 ms: tried in training, it is slower, so training
    moves back to the pipeline; the cache keeps both measurements, and the runner-up is not tried again."""
    cache, selection = cached(tmp_path)
    _set_selection(selection, (PIPELINE, 0.05), (ZERO3, 1e-4))
    steps = WARMUP_STEPS + WINDOW_STEPS + PAYBACK_STEPS
    out = pools(2).run(_fit, str(cache), max_steps=steps, num_samples=steps * GLOBAL_BATCH)[0]
    assert out["plan"] == PIPELINE and len(out["events"]) == 2, out["events"]
    assert "moved to it in memory" in out["events"][0] and "moved back" in out["events"][1]
    cached = json.loads(selection.read_text())
    measured = {ParallelPlan.from_dict(t["plan"]): t for t in cached["trials"]}
    assert cached["plan"] == PIPELINE.to_dict()
    assert measured[ZERO3]["step_s"] > max(SLOW_S, measured[PIPELINE]["step_s"]), cached["trials"]


# ---------------------------------------------------------------------------------------------- the rules
def test_a_plan_is_tried_only_when_the_window_is_measurably_slower_and_the_run_is_long_enough():
    noisy = [0.1 * (1 + 0.1 * ((i * 7) % 5 - 2)) for i in range(WINDOW_STEPS)]  # +-20% around 100 ms
    assert why_not_probe([0.3] * WINDOW_STEPS, [0.1, 0.11, 0.09], None) is None  # 3x slower
    assert why_not_probe([0.3] * WINDOW_STEPS, [0.1, 0.11, 0.09], PAYBACK_STEPS) is None
    assert "steps left" in why_not_probe([0.3] * WINDOW_STEPS, [0.1, 0.11, 0.09], PAYBACK_STEPS - 1)
    assert "fewer than" in why_not_probe([0.3] * (WINDOW_STEPS - 1), [0.1], None)
    assert why_not_probe(noisy, [0.1, 0.1, 0.1], None) is not None  # the same speed, noisy
    assert why_not_probe(noisy, [0.08, 0.12, 0.1], None) is not None
    assert why_not_probe([0.103] * WINDOW_STEPS, [0.1] * 3, None) is not None  # steady but within 5%
    assert why_not_probe([0.12] * WINDOW_STEPS, [0.1] * 3, None) is None  # steady, 20% slower: resolved


def test_a_tried_plan_is_kept_only_when_it_trained_measurably_faster():
    slow = [0.1 + 0.01 * (i % 3) for i in range(WINDOW_STEPS)]
    assert why_not_keep(slow, [s / 2 for s in slow]) is None
    assert why_not_keep(slow, slow) is not None
    assert why_not_keep(slow, [s * 0.97 for s in slow]) is not None  # within 5%
    assert why_not_keep(slow, [s * 2 for s in slow]) is not None


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 4), (4, 1), (1, 4), (2, 2), (4, 8)])
def test_samples_regrouped_into_other_data_shards_are_what_a_loader_for_them_reads(old, new):
    """A loader made for ``old`` data shards keeps serving after a switch to ``new``: each step's batches, regrouped,
    give each new shard exactly the samples, in the order, of a loader made for ``new`` shards (DistributedSampler,
    shuffled, the same epoch); labels and other per-sample leaves travel with their samples."""
    data = [(torch.tensor([i, i * 10]), i) for i in range(64)]
    global_batch = 8

    def batches(shards: int, shard: int) -> list[Any]:
        sampler = DistributedSampler(data, shards, shard, shuffle=True, seed=3)
        sampler.set_epoch(1)
        return list(DataLoader(data, batch_size=global_batch // shards, sampler=sampler))

    before = [batches(old, s) for s in range(old)]
    for shard in range(new):
        for step, expected in enumerate(batches(new, shard)):
            got = regrouped([before[s][step] for s in range(old)], new, shard)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
