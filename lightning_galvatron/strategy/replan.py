"""Re-planning while training (``GalvatronStrategy(replan=True)``, the default with ``plan="auto"``).

Measured selection decides on a few trial steps, and its decision is cached; a plan can then train much slower than
it measured (a busy or throttled machine, a pipeline whose steps vary from run to run), while another candidate
would be faster. :class:`Replanning` times every training step and, when the plan trains measurably slower than the
runner-up of the selection measured, tries the runner-up **in training**: the model moves to it in memory between
two optimizer steps (:mod:`lightning_galvatron.strategy.plan_switch`), trains a window of steps, and stays there if it
trained measurably faster, else moves back. Trying it in training rather than in a trial on a copy measures both plans
the same way (the loop's own work included) and needs no second model in memory; and nothing is lost either way: a
switch carries the parameters, the optimizer states and the position in the data exactly, the random state goes on
untouched. Both measurements go to the cached selection, so the next ``fit`` starts from what was learned, and a
cached selection that no longer measures as it did is checked the same way.

The rules are pure functions (:func:`why_not_probe`, :func:`why_not_keep`), with measured selection's noise rule
(:func:`~lightning_galvatron.selection.resolution.measurably_faster`). Each switch is printed on rank 0 as an event
and the number of re-plans kept is logged as ``galvatron/replans``. What cannot be moved exactly (manual
optimization, a runner-up with another global batch size, batches that cannot be regrouped, not enough host memory
for the whole state) is not moved, and the notice says why.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_galvatron._compat import override
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.runtime.mesh import reduce_over_ranks
from lightning_galvatron.search.report import plan_summary
from lightning_galvatron.selection import Selection, SelectionCache, TrialRecord, preserved_rng
from lightning_galvatron.selection.resolution import TIE, measurably_faster, trial_steps
from lightning_galvatron.strategy.autoplan import optimizer_kind
from lightning_galvatron.strategy.metrics import sync_metrics_over_data_shards
from lightning_galvatron.strategy.plan_switch import (
    CarriedShards,
    ModuleBlueprint,
    gather_whole_state,
    give_new_parameters,
    host_memory_available,
    load_whole_state,
    regroupable,
    same_data_shards,
    whole_state_bytes,
)
from lightning_galvatron.strategy.precision import precision_flag

if TYPE_CHECKING:
    import lightning.pytorch as L

    from lightning_galvatron.model.outside_layers import OutsideLayers
    from lightning_galvatron.strategy.auto_setup import PlanningContext
    from lightning_galvatron.strategy.prediction import Prediction
    from lightning_galvatron.strategy.trainer_strategy import GalvatronStrategy

#: Steps not timed after the start of training and after each switch: they pay for lazy initialisation (FSDP's, the
#: allocator's, compilation), not for the plan.
WARMUP_STEPS = 2
#: Steps per window: the median of 8 steps stands two disturbed ones, and its standard error (about 0.44 of a step's
#: standard deviation sigma) next to a trial's 3 steps (0.72 sigma) resolves a plan slower by about 2 x 0.85 sigma,
#: while a plan 2-3x slower is seen in the first window. A window that does not resolve costs nothing: the next one
#: is timed. Longer windows resolve finer but leave a slow plan training longer before it is replaced.
WINDOW_STEPS = 8
#: Steps that must be left for a probe: it costs up to two switches and a window on a plan that may be slower.
PAYBACK_STEPS = 4 * WINDOW_STEPS
#: Probes per fit: a machine whose speed keeps changing does not keep the run switching.
MAX_PROBES = 2

_CARRIED_STAGES = (RunningStage.TRAINING, RunningStage.VALIDATING, RunningStage.SANITY_CHECKING)


def why_not_probe(window: Sequence[float], runner_up: Sequence[float], remaining_steps: int | None) -> str | None:
    """Why not to try the runner-up now (``None``: try it), from the window's step times of the plan that trains and
    the runner-up's measured steps. Tried when the window is measurably slower (beyond the noise of both
    measurements: :func:`~lightning_galvatron.selection.resolution.measurably_faster`) and slower by more than
    :data:`~lightning_galvatron.selection.resolution.TIE` -- the rules by which measured selection tells plans apart
    -- and :data:`PAYBACK_STEPS` steps are left (``None``: unknown, as many as it takes)."""
    if len(window) < WINDOW_STEPS:
        return f"fewer than {WINDOW_STEPS} steps timed"
    if not (
        measurably_faster(runner_up, window) and (1 + TIE) * statistics.median(runner_up) < statistics.median(window)
    ):
        return "not measurably slower than the runner-up measured"
    if remaining_steps is not None and remaining_steps < PAYBACK_STEPS:
        return f"only {remaining_steps} steps left (a probe needs {PAYBACK_STEPS} to pay back)"
    return None


def why_not_keep(before: Sequence[float], after: Sequence[float]) -> str | None:
    """Why the plan tried (its window ``after``) is not kept over the one before it (``before``), or ``None``: it is
    kept only where it trained measurably faster, by more than :data:`~lightning_galvatron.selection.resolution.TIE`
    (so that noise cannot make the run switch back and forth)."""
    if measurably_faster(after, before) and (1 + TIE) * statistics.median(after) < statistics.median(before):
        return None
    return "not measurably faster"


def check_replan(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"replan must be True or False, got {value!r}")
    return value


@dataclasses.dataclass
class _Probe:
    previous: ParallelPlan
    before: list[float]  # the previous plan's window
    steps: str  # which steps it was, for the events


class Replanning(Callback):
    """Times training steps on every rank and moves training to a faster plan (a callback on every rank: its windows
    are collective). ``events``: what it did, as printed."""

    def __init__(
        self,
        strategy: GalvatronStrategy,
        context: PlanningContext,
        blueprint: ModuleBlueprint,
        outside: OutsideLayers | None,
        selection: Selection,
    ) -> None:
        self.strategy, self.context, self.blueprint = strategy, context, blueprint
        self.outside, self.selection = outside, selection
        self.events: list[str] = []
        self.kept = 0  # re-plans kept: what galvatron/replans logs
        self.stopped: str | None = None  # why it no longer checks
        self._times: list[float] = []
        self._skip = WARMUP_STEPS
        self._started: float | None = None
        self._step_at_start = 0
        self._probe: _Probe | None = None
        self._probes = 0
        self._unsupported: dict[ParallelPlan, str] = {}

    @classmethod
    def start(
        cls, strategy: GalvatronStrategy, context: PlanningContext, outside: OutsideLayers | None
    ) -> Replanning | None:
        """In ``setup`` under ``plan="auto"``, right before the first plan is applied (the blueprint is taken then): the
        re-planning of this fit, added to the trainer's callbacks, or ``None`` where there is nothing to re-plan."""
        if not context.fitting:
            return None
        if not strategy.lightning_module.automatic_optimization:
            rank_zero_info(
                "Galvatron: re-planning while training is off: manual optimization (the step runs the optimizers "
                "itself, so no trial measured another plan)"
            )
            return None
        selection = strategy.selection
        if selection is None or selection.runner_up is None:
            return None  # no other measured plan: nothing to move to
        try:
            blueprint, problem = ModuleBlueprint(strategy.lightning_module), ""
        except Exception as error:  # noqa: BLE001 - re-planning is off, training goes on
            blueprint, problem = None, f"{type(error).__name__}: {error}"
        if reduce_over_ranks([float(blueprint is not None)], dist.ReduceOp.MIN)[0] < 1:
            rank_zero_info(f"Galvatron: re-planning while training is off: the model cannot be copied ({problem})")
            return None
        budget = selection.memory_budget_bytes
        if outside is None and any(t.plan.pp > 1 for t in selection.trials if t.fits(budget)):
            try:  # collective, on the module before any plan; the same error on every rank
                outside = context.trace_outside_layers()
            except PlanError:
                outside = None  # pipelines are not moved to (the notice says why)
        replanning = cls(strategy, context, blueprint, outside, selection)
        for record in selection.trials:  # while the structure is whole (a pipeline stage keeps its own blocks)
            try:
                context.check(record.plan)
            except PlanError as error:  # a cached selection's other plans were not checked when it was read
                replanning._unsupported[record.plan] = f"the runtime cannot run it on this model ({error})"
        context.trainer.callbacks.append(replanning)
        return replanning

    # ------------------------------------------------------------------ timing
    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.stopped is None and self._started is None:  # the first batch of an optimizer step
            self._started = self._now()
            self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None or trainer.global_step == self._step_at_start:
            return  # still accumulating gradients
        seconds = (self._now() - self._started) / trainer.accumulate_grad_batches
        self._started = None
        if self._skip > 0:
            self._skip -= 1
            return
        self._times.append(seconds)
        if len(self._times) < WINDOW_STEPS:
            return
        window = [float(t) for t in reduce_over_ranks(self._times, dist.ReduceOp.MAX)]  # each step: the slowest rank
        self._times = []
        steps = f"{trainer.global_step - WINDOW_STEPS + 1}-{trainer.global_step}"
        if self._probe is None:
            self._watch(trainer, batch, window, steps)
        else:
            self._judge(trainer, window, steps)

    def _now(self) -> float:
        if self.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(self.strategy.root_device)
        return time.perf_counter()

    # ------------------------------------------------------------------ decisions
    def _watch(self, trainer: L.Trainer, batch: Any, window: list[float], steps: str) -> None:
        runner_up = self.selection.runner_up
        if runner_up is None:
            return
        if why_not_probe(window, trial_steps(runner_up), _remaining_steps(trainer)) is not None:
            return
        ms = statistics.median(window) * 1e3
        head = (
            f"Galvatron: re-planning: steps {steps} trained at {ms:.1f} ms each, but the runner-up of the measured "
            f"selection, {runner_up.name} ({plan_summary(runner_up.plan)}), measured {runner_up.step_s * 1e3:.1f} ms"
        )
        refusal = self._refusal(runner_up.plan, batch)
        if refusal is not None:
            self.stopped = refusal
            self._event(trainer, f"{head}; not moved: {refusal}")
            return
        previous = self.strategy.plan
        seconds = self.switch(trainer, runner_up.plan)
        self._probe = _Probe(previous, window, steps)
        self._event(
            trainer, f"{head}: moved to it in memory in {seconds:.2f} s, to train {WINDOW_STEPS} steps and compare"
        )

    def _judge(self, trainer: L.Trainer, window: list[float], steps: str) -> None:
        probe, self._probe = self._probe, None
        assert probe is not None
        tried = self.strategy.plan
        before, after = statistics.median(probe.before) * 1e3, statistics.median(window) * 1e3
        windows = {probe.previous: probe.before, tried: window}
        records = [_measured(t, windows.get(t.plan)) for t in self.selection.trials]
        if why_not_keep(probe.before, window) is None:
            self.kept += 1
            self.selection = dataclasses.replace(self.selection, plan=tried, trials=tuple(records))
            line = (
                f"Galvatron: re-planned: {plan_summary(tried)} trained steps {steps} at {after:.1f} ms each against "
                f"{before:.1f} ms (steps {probe.steps}): training it from now on"
            )
        else:
            seconds = self.switch(trainer, probe.previous)
            self.selection = dataclasses.replace(self.selection, trials=tuple(records))
            line = (
                f"Galvatron: re-planning: {plan_summary(tried)} trained steps {steps} at {after:.1f} ms each, not "
                f"measurably faster than {before:.1f} ms: moved back in {seconds:.2f} s"
            )
        self.strategy.selection = self.selection
        saved = self._save_selection()
        self._event(trainer, line + (f"; the cached selection {saved} now says so" if saved else ""))
        self._probes += 1
        if self._probes >= MAX_PROBES:
            self.stopped = f"{MAX_PROBES} probes made in this fit"

    def _refusal(self, plan: ParallelPlan, batch: Any) -> str | None:
        """Why training cannot move to ``plan`` exactly (the same on every rank), or ``None``."""
        strategy, current = self.strategy, self.strategy.plan
        if plan.world_size != current.world_size:
            return f"it is a plan for {plan.world_size} devices, not {current.world_size}"
        if plan.global_batch_size != current.global_batch_size:
            return f"it trains a global batch of {plan.global_batch_size}, not {current.global_batch_size}"
        if plan in self._unsupported:
            return self._unsupported[plan]
        if plan.pp > 1 and self.outside is None:
            return "it is a pipeline, and the step could not be traced for one"
        if plan.pp > 1 and not self.context.sharded_checkpoints:
            return "it is a pipeline, which save_distributed_checkpoint=False cannot save"
        made_with = getattr(strategy.data_shards, "made_with", {})
        if not same_data_shards(made_with.get(RunningStage.TRAINING, current), plan) and (why := regroupable(batch)):
            return f"it reads other data shards, and the batches cannot be regrouped into them ({why})"
        need = whole_state_bytes(strategy.lightning_module, strategy.optimizers) * strategy.num_processes
        available = host_memory_available()
        fits = available is None or need <= 0.8 * available
        if reduce_over_ranks([float(fits)], dist.ReduceOp.MIN)[0] < 1:
            return "the host has not enough free memory to hold the whole training state while it moves"
        return None

    # ------------------------------------------------------------------ the switch
    def switch(self, trainer: L.Trainer, plan: ParallelPlan) -> float:
        """Move training to ``plan`` in memory, between two optimizer steps (collective); the seconds it took."""
        strategy, module = self.strategy, self.strategy.lightning_module
        optimizers = strategy.optimizers
        started = time.perf_counter()
        self.context.progress(f"re-planning: moving to {plan_summary(plan)}")
        made_with = getattr(strategy.data_shards, "made_with", {})
        made_with = {stage: made_with.get(stage, strategy.plan) for stage in _CARRIED_STAGES}
        with preserved_rng(strategy.root_device):
            state = gather_whole_state(module, optimizers)
            strategy.release_plan()
            for optimizer in optimizers:  # no reference to the old parameters stays
                optimizer.state.clear()
                for group in optimizer.param_groups:
                    group["params"] = []
            self.blueprint.install(module)
            applied = strategy.reapply_plan(plan, self.outside if plan.pp > 1 else None)
            give_new_parameters(module, optimizers, state.groups)
            load_whole_state(module, optimizers, state)
            del state
            trainer.fit_loop._skip_backward = applied.runner is not None  # as in setup
            sync_metrics_over_data_shards(module, plan)
            strategy.data_shards = CarriedShards(
                plan, strategy.global_rank, self.context.meshes, strategy.root_device, made_with
            )
            strategy.prediction = _repriced(strategy, plan, self.selection)
        gc.collect()
        if strategy.root_device.type == "cuda":
            torch.cuda.empty_cache()
        self._times, self._skip, self._started = [], WARMUP_STEPS, None
        self.context.progress(f"re-planning: training {plan_summary(plan)}")
        return time.perf_counter() - started

    def regroup(self, batch: Any, stage: Any) -> Any:
        """The batch of the plan that trains, where the loader still reads an earlier plan's data shards."""
        shards = self.strategy.data_shards
        return shards.regroup(batch, stage) if isinstance(shards, CarriedShards) else batch

    # ------------------------------------------------------------------ reporting
    def _event(self, trainer: L.Trainer, line: str) -> None:
        self.events.append(line)
        rank_zero_info(line)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"galvatron/replans": float(self.kept)}, step=trainer.global_step)

    def _save_selection(self) -> str | None:
        """Rank 0 writes the selection as re-planning left it where it was read from (or written to)."""
        file = self.selection.cache_file
        cache = SelectionCache.of(self.context.search.profile_cache)
        if self.strategy.global_rank != 0 or file is None or cache is None:
            return None
        path = cache.save(Path(file).stem, self.selection)
        return None if path is None else str(path)


def _measured(record: TrialRecord, window: list[float] | None) -> TrialRecord:
    return (
        record if window is None else dataclasses.replace(record, step_s=statistics.median(window), steps=tuple(window))
    )


def _remaining_steps(trainer: L.Trainer) -> int | None:
    total = trainer.estimated_stepping_batches
    return None if total is None or not math.isfinite(total) else int(total) - trainer.global_step


def _repriced(strategy: GalvatronStrategy, plan: ParallelPlan, selection: Selection) -> Prediction:
    """The strategy's prediction, for ``plan``: what the setup report, the monitor and the first steps' check read."""
    from lightning_galvatron.search import evaluate

    prediction = strategy.prediction
    source = prediction.source if "re-planned" in prediction.source else f"{prediction.source}, re-planned"
    estimate = None
    if prediction.profile is not None:
        try:
            estimate = evaluate(
                prediction.profile,
                plan,
                optimizer=optimizer_kind(strategy.optimizers[0] if strategy.optimizers else None),
                precision=precision_flag(strategy.precision_plugin),
                memory_budget_bytes=prediction.memory_budget_bytes,
                calibration=selection.calibration,
            )
        except ValueError:
            estimate = None
    return dataclasses.replace(prediction, plan=plan, source=source, estimate=estimate)


__all__ = ["MAX_PROBES", "PAYBACK_STEPS", "WARMUP_STEPS", "WINDOW_STEPS", "Replanning", "why_not_keep", "why_not_probe"]
