"""Trials: a few real training steps of a candidate plan on a copy of the user's model -- the Lightning side of
measured selection (:mod:`lightning_galvatron.selection` decides; this module runs and reports).

A trial deep-copies the LightningModule (never touching the user's module, whose first optimizer step must be
that of the chosen plan), applies the plan to the copy as the strategy does
(:func:`~lightning_galvatron.strategy.preparation.prepare`: rank 0's weights, precision, entry methods, pipeline stages,
placement), makes the copy's own optimizers with its ``configure_optimizers`` and trains it on one real global batch
of the user's data with training's step
(:func:`~lightning_galvatron.runtime.step.train_step`; gradients clipped through the module's
``configure_gradient_clipping`` and the precision plugin, as the Trainer's ``gradient_clip_val`` says):

* ``warmup_steps`` untimed steps (lazy initialisation, first collectives);
* ``timed_steps`` steps timed on every rank; a step's time is the slowest rank's, the trial's the median step
  (what training runs at: not the fastest step, which favours the plans whose steps vary most -- at 2 CPU
  processes an interleaved pipeline's fastest of 3 steps beat DDP's by 5-8%, and it trained 13-16% slower); a step
  more than twice as slow as the fastest plan so far ends the trial (it cannot win);
* on CPU the runtime profiler (:mod:`lightning_galvatron.profiler.runtime`) records the same steps (its hooks
  cost microseconds there); on CUDA, where it synchronises the device at every boundary, two more steps;
* the peak memory of a step (:mod:`lightning_galvatron.selection.memory`), the largest over the ranks.

``self.log`` calls of the copy are dropped; the random state is restored after the trials.

:func:`select_in_trials` is what the recipe of ``plan="auto"``
(:func:`~lightning_galvatron.strategy.auto_setup.resolve_automatic_plan`) calls when fitting; :class:`StepClock` then
compares the first training steps with the prediction. The training loop adds its own work to every step (logging,
callbacks) that neither the cost model nor a trial counts, so that comparison is a sanity check, not a calibration.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_galvatron._compat import override
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.outside_layers import OutsideLayers
from lightning_galvatron.model.tensor_parallel_plans import block_tensor_parallel_plans
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.runtime.apply import AppliedPlan, input_shard
from lightning_galvatron.runtime.mesh import MeshCache, reduce_over_ranks
from lightning_galvatron.runtime.step import NormScope, train_step
from lightning_galvatron.runtime.vocab_parallel import parallel_cross_entropy
from lightning_galvatron.search.calibration import Observation
from lightning_galvatron.search.report import plan_summary
from lightning_galvatron.selection import Selection, SelectionCache, select_by_measurement
from lightning_galvatron.selection.memory import step_peak_bytes
from lightning_galvatron.selection.resolution import measurably_faster, trial_steps
from lightning_galvatron.selection.settings import Measurement, TrialSettings, TrialUnavailable
from lightning_galvatron.strategy.precision import GlobalNormClipping, precision_flag
from lightning_galvatron.strategy.preparation import count_optimizer_steps, overridden_step_methods, prepare

if TYPE_CHECKING:
    import lightning.pytorch as L

    from lightning_galvatron.strategy.auto_setup import PlanningContext
    from lightning_galvatron.strategy.autoplan import AutoPlan


# ---------------------------------------------------------------------------------------------- the strategy's side
def select_in_trials(context: PlanningContext, auto: AutoPlan, loader: Iterable[Any]) -> Selection | None:
    """Measured selection: the candidates of ``auto`` train a few steps on copies of the user's module and the
    fastest measured plan that fits is chosen; ``None`` (saying why) where the module cannot be tried.

    Collective: every rank calls it and gets the same selection.
    """
    settings = context.trials
    assert settings is not None
    try:
        reason = no_trials_reason(context.module)
        if reason is not None:
            raise TrialUnavailable(reason)
        batch = global_batch_samples(loader, auto.plan.global_batch_size)
    except TrialUnavailable as why:
        rank_zero_info(f"Galvatron: no trials ({why}): training the search's plan")
        return None
    rank_zero_info(f"Galvatron: measured selection: trying candidate plans for up to {settings.budget_s:g} s")
    selection = select_by_measurement(
        auto,
        _trial_runner(context, batch),
        settings,
        cache=SelectionCache.of(context.search.profile_cache),
        check=context.check,
        report=rank_zero_info,
        progress=context.progress,
    )
    rank_zero_info(selection.report())
    return selection


def _trial_runner(context: PlanningContext, batch: Any) -> TrialRunner:
    """The trials' runner: the user's module and data, and how the strategy applies a plan."""
    module = context.module
    traced: list[OutsideLayers] = []

    def outside_layers() -> OutsideLayers:  # traced once, for the first pipelined candidate (collective)
        if not traced:
            traced.append(context.trace_outside_layers())
        return traced[0]

    return TrialRunner(
        module,
        context.trainer,
        context.layers,
        batch,
        context.meshes,
        context.precision_plugin,
        context.device,
        overridden_step_methods(module),
        context.vocab_parallel_loss,
        outside_layers,
        context.progress,
    )


# ---------------------------------------------------------------------------------------------- running a trial
def global_batch_samples(loader: Any, count: int) -> Any:
    """``count`` samples of the loader's first batches joined along the batch (the loader's random state kept)."""
    batches, have = [], 0
    with torch.random.fork_rng():
        for batch in loader:
            batches.append(batch)
            have += _batch_size(batch)
            if have >= count:
                break
    if not batches:
        raise TrialUnavailable("the training DataLoader gave no batch")
    while have < count:  # a small dataset: repeat its batches
        batches = batches + batches
        have *= 2
    leaves = [tree_flatten(b) for b in batches]
    spec = leaves[0][1]
    if any(s != spec for _, s in leaves):
        raise TrialUnavailable("the DataLoader's batches differ in structure")
    joined = []
    for column in zip(*(flat for flat, _ in leaves)):
        first = column[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            if any(t.shape[1:] != first.shape[1:] for t in column):
                raise TrialUnavailable("the DataLoader's batches differ in shape beyond the batch dimension")
            joined.append(torch.cat(column)[:count])
        elif isinstance(first, list):
            joined.append([x for part in column for x in part][:count])
        else:
            joined.append(first)
    return tree_unflatten(joined, spec)


def _batch_size(batch: Any) -> int:
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise TrialUnavailable("the DataLoader's batches hold no tensor with a batch dimension")


def _shard(batch: Any, num_shards: int, shard: int) -> Any:
    flat, spec = tree_flatten(batch)
    size = _batch_size(batch) // num_shards

    def part(x: Any) -> Any:
        batched = (isinstance(x, torch.Tensor) and x.dim() > 0) or isinstance(x, list)
        return x[shard * size : (shard + 1) * size] if batched else x

    return tree_unflatten([part(x) for x in flat], spec)


@dataclass
class TrialRunner:
    """What a trial needs from the strategy: the user's module and data, and how the strategy applies a plan."""

    module: nn.Module  # the user's LightningModule: copied, never changed
    trainer: L.Trainer
    layers: str | Sequence[str] | None
    batch: Any  # a global batch of samples (global_batch_samples)
    meshes: MeshCache
    precision_plugin: Any  # the strategy's: converts the copy, and its precision is the trial's
    device: torch.device
    entry_methods: Sequence[str]
    vocab_parallel_loss: bool
    outside_layers: Callable[[], OutsideLayers]  # collective; called only for pipelined candidates
    progress: Callable[[str], None] = lambda where: None  # tells the rank monitor where this rank is
    # Start from rank 0's weights as training will (the strategy's argument): the trial's step is training's first.
    broadcast_initial_weights: bool = True

    def run(
        self, plan: ParallelPlan, settings: TrialSettings, observe: bool = True, stop_above: float | None = None
    ) -> tuple[Measurement, list[Observation]]:
        """Train ``plan`` for a few steps on a copy (collective: every rank, the same plans in the same order).

        A timed step slower than ``stop_above`` seconds (the slowest rank's) ends the trial there, its memory not
        measured: the plan cannot win. Returns the measurement (the same on every rank) and, on rank 0, every
        rank's observation for the calibration (empty elsewhere, and when ``observe`` is false or it failed).
        """
        started = time.perf_counter()
        outcome: tuple[list[float], int | None, Observation | None, str | None]
        outside = self.outside_layers() if plan.pp > 1 else None  # collective, before anything can fail
        try:
            outcome = self._train(plan, settings, observe, outside, stop_above)
        except Exception as error:  # noqa: BLE001 - a plan that fails here is not chosen; the others go on
            outcome = ([], None, None, f"{type(error).__name__}: {error}")
            # Where it failed on some ranks only, the others wait inside the trial's collectives until the
            # watchdog ends the job: its report then says why, from where this rank waits.
            self.progress(f"setup: the trial of {plan_summary(plan)} failed on this rank ({outcome[3][:300]})")
        finally:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, outcome)
        errors = [error for *_, error in gathered if error is not None]
        seconds = time.perf_counter() - started
        if errors:
            return Measurement(None, None, seconds, errors[0]), []
        steps = [max(column) for column in zip(*(times for times, *_ in gathered))]
        peaks = [peak for _, peak, *_ in gathered if peak is not None]
        observations = [obs for _, _, obs, _ in gathered if obs is not None] if dist.get_rank() == 0 else []
        stopped = len(steps) < settings.timed_steps
        return (
            Measurement(
                statistics.median(steps),
                max(peaks) if peaks else None,
                seconds,
                stopped_early=stopped,
                steps=tuple(steps),
            ),
            observations,
        )

    # ------------------------------------------------------------------ one trial on this rank
    def _train(
        self,
        plan: ParallelPlan,
        settings: TrialSettings,
        observe: bool,
        outside: OutsideLayers | None,
        stop_above: float | None,
    ) -> tuple[list[float], int | None, Observation | None, None]:
        from lightning_galvatron.profiler.runtime import RuntimeProfiler

        model = self._copy()
        structure = find_blocks(model, self.layers)
        blocks = structure.blocks  # by global index; a pipeline stage keeps only its own in the containers
        model = self.precision_plugin.convert_module(model)
        applied = prepare(  # as the strategy applies a plan (rank 0's weights, precision, placement, hooks)
            model,
            structure,
            plan,
            self.meshes,
            precision_flag(self.precision_plugin),
            self.device,
            tp_plans=block_tensor_parallel_plans(structure),
            broadcast_initial_weights=self.broadcast_initial_weights,
            entry_methods=self.entry_methods,
            parallel_loss=self._parallel_loss(plan),
            outside_layers=outside,
        )
        optimizers = [o for o in _init_optimizers_and_lr_schedulers(model)[0] if o.param_groups]
        count_optimizer_steps(applied, optimizers)
        num_shards, shard = input_shard(plan, dist.get_rank())
        batch = move_data_to_device(_shard(self.batch, num_shards, shard), self.device)
        takes_index = is_param_in_hook_signature(model.training_step, "batch_idx", min_args=2)
        train_context = self.precision_plugin.train_step_context
        runtime: RuntimeProfiler | None = None

        def user_step(micro_batch: Any) -> Any:
            with train_context():
                return model.training_step(micro_batch, 0) if takes_index else model.training_step(micro_batch)

        def clip(optimizer: torch.optim.Optimizer) -> None:  # as Lightning clips (Precision._clip_gradients)
            trainer = self.trainer
            model.configure_gradient_clipping(
                optimizer,
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            )

        def optimizer_started() -> None:
            if runtime is not None:
                runtime.optimizer_started()

        def step() -> None:
            train_step(
                applied,
                optimizers,
                batch,
                user_step,
                context=parallel_cross_entropy if self._parallel_loss(plan) else nullcontext,
                after_backward=optimizer_started,
                clip=clip,
            )
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)

        local = applied.partition.local_blocks if applied.partition is not None else range(len(blocks))
        cuda = self.device.type == "cuda"
        model.train()
        with self._clipping_over(applied):
            for _ in range(settings.warmup_steps):
                step()
            if observe and not cuda:
                runtime = RuntimeProfiler(plan, {i: blocks[i] for i in local}, optimizers, self.device)
                runtime.start()
            times = []
            for _ in range(settings.timed_steps):
                if runtime is not None:
                    runtime.step_started()
                began = _now(self.device)
                step()
                times.append(float(reduce_over_ranks([_now(self.device) - began], dist.ReduceOp.MAX)[0]))
                if stop_above is not None and times[-1] > stop_above:
                    break
            observation = _finish(runtime)
            runtime = None
            stopped = len(times) < settings.timed_steps
            measure = settings.measure_memory and not stopped
            peak = step_peak_bytes(step, model, optimizers, self.device) if measure else None
            if observe and cuda:
                runtime = RuntimeProfiler(plan, {i: blocks[i] for i in local}, optimizers, self.device)
                runtime.start()
                for _ in range(2):
                    runtime.step_started()
                    step()
                observation = _finish(runtime)
        applied.gradients.remove()
        return times, peak, observation, None

    @contextmanager
    def _clipping_over(self, applied: AppliedPlan) -> Iterator[None]:
        """While a trial trains, the precision plugin that clips (the trainer's, the strategy's) clips by the norm
        over the trial's plan; the strategy sets its own plan's when it applies it."""
        plugin = self.trainer.precision_plugin
        if not isinstance(plugin, GlobalNormClipping):
            yield
            return
        saved, plugin.norm_scope = plugin.norm_scope, NormScope.of(applied)
        try:
            yield
        finally:
            plugin.norm_scope = saved

    def _parallel_loss(self, plan: ParallelPlan) -> bool:
        return self.vocab_parallel_loss and plan.vocab.tp > 1

    def _copy(self) -> nn.Module:
        """A deep copy of the user's module that shares the Trainer (Lightning drops it when copying) and logs
        nothing."""
        try:
            model = copy.deepcopy(self.module)
        except Exception as error:
            raise TrialUnavailable(
                f"the LightningModule cannot be copied for trials ({type(error).__name__}: {error})"
            ) from error
        model._trainer = self.trainer
        model.log = _ignore_log  # type: ignore[method-assign]
        return model


def _finish(runtime: Any) -> Observation | None:
    """Stop the runtime profiler (closing the step in progress) and take its observation."""
    if runtime is None:
        return None
    runtime.stop()
    runtime.step_started()
    observation = runtime.observation(dist.get_rank())
    runtime.remove()
    return observation


def _ignore_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` of a trial's copy: what trials compute is not the user's training."""


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def no_trials_reason(module: Any) -> str | None:
    """Why a module cannot be tried (the strategy then trains the search's plan), or ``None``."""
    if not getattr(module, "automatic_optimization", True):
        return "manual optimization (the trial would have to run your optimizers' steps itself)"
    return None


# ---------------------------------------------------------------------------------------------- after the trials
class StepClock(Callback):
    """Times training steps (start to start) and reports once, after ``skip`` + ``steps`` steps (a callback the
    strategy adds on rank 0).

    Args:
        predicted_s: the running plan's predicted step time (the calibrated one when there is one).
        trial_s: its step time measured in its trial, if it had one.
        runner_up: ``(name, plan, step times)`` of the fastest other fitting plan of the trials: named only when
            its trial was measurably faster (:func:`~lightning_galvatron.selection.resolution.measurably_faster`)
            than the training steps timed here.
        report: where the line goes (rank 0's output).
    """

    def __init__(
        self,
        predicted_s: float | None,
        trial_s: float | None,
        runner_up: tuple[str, object, Sequence[float]] | None,
        report: Callable[[str], None],
        skip: int = 2,
        steps: int = 5,
    ) -> None:
        self.predicted_s = predicted_s
        self.trial_s = trial_s
        self.runner_up = runner_up
        self.report = report
        self.skip, self.steps = skip, steps
        self._starts: list[float] = []
        self.measured_s: float | None = None

    @classmethod
    def for_plan(cls, auto: AutoPlan, selection: Selection | None) -> StepClock:
        """The clock of the plan that trains: the search's (its predicted step), or the trials' choice (its
        calibrated prediction and its trial's steps, with the runner-up of the trials)."""
        predicted = auto.search_result.estimate.step_time_s if auto.search_result is not None else None
        trial_s = runner_up = None
        if selection is not None:
            chosen, other = selection.chosen, selection.runner_up
            if chosen is not None:
                predicted, trial_s = chosen.calibrated_step_s or chosen.predicted_step_s, chosen.step_s
            runner_up = (other.name, other.plan, trial_steps(other)) if other is not None else None
        return cls(predicted, trial_s, runner_up, rank_zero_info)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.step_started()

    def step_started(self) -> None:
        if self.measured_s is not None:
            return
        self._starts.append(time.perf_counter())
        if len(self._starts) == self.skip + self.steps + 1:
            durations = [b - a for a, b in zip(self._starts[self.skip :], self._starts[self.skip + 1 :])]
            self.measured_s = statistics.median(durations)
            self.report(self.message(durations))

    def message(self, durations: Sequence[float]) -> str:
        assert self.measured_s is not None
        measured = self.measured_s
        first, last = self.skip + 1, self.skip + self.steps
        line = f"Galvatron: training steps {first}-{last} took {measured * 1e3:.1f} ms each (median, rank 0)"
        parts = []
        if self.predicted_s is not None:
            parts.append(f"predicted {self.predicted_s * 1e3:.1f} ms ({_ratio(measured, self.predicted_s)})")
        if self.trial_s is not None:
            parts.append(f"its trial measured {self.trial_s * 1e3:.1f} ms")
        if parts:
            line += "; " + ", ".join(parts)
        if self.runner_up is not None and measurably_faster(self.runner_up[2], durations):
            name, plan, steps = self.runner_up
            line += (
                f"\nGalvatron: the runner-up of the trials, {name} ({plan_summary(plan)}), measured "
                f"{statistics.median(steps) * 1e3:.1f} ms per step in its trial, less than this plan takes now "
                "beyond the noise of either measurement (trials leave out "
                "the training loop's own work -- logging, callbacks -- and a busy machine disturbs them); with "
                "replan=True (the default) training moves to it in memory once a window of steps confirms this and "
                "enough steps remain; with replan=False, delete the cached selection or give trials= more timed steps"
            )
        return line


def _ratio(measured: float, predicted: float) -> str:
    return f"measured {measured / predicted:.2f}x" if predicted > 0 else "-"


__all__ = ["StepClock", "TrialRunner", "global_batch_samples", "no_trials_reason", "select_in_trials"]
