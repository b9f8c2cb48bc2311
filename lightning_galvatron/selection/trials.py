"""Trials: a few real training steps of a candidate plan, on a copy of the user's model.

A trial deep-copies the LightningModule (never touching the user's module, whose first optimizer step must be
that of the chosen plan), applies the plan to the copy exactly as the strategy would (precision, FSDP mixed
precision, entry methods, pipeline stages), makes the copy's own optimizers with its ``configure_optimizers``
and trains it on one real global batch of the user's data:

* ``warmup_steps`` untimed steps (lazy initialisation, first collectives);
* ``timed_steps`` steps timed on every rank; a step's time is the slowest rank's, the trial's the fastest step
  (other work on the machine only ever adds to a step, so the fastest is the least disturbed);
* on CPU the runtime profiler (:mod:`lightning_galvatron.profiler.runtime`) records the same steps (its hooks
  cost microseconds there); on CUDA, where it synchronises the device at every boundary, two more steps;
* the peak memory of a step (:mod:`.memory`), the largest over the ranks.

``self.log`` calls of the copy are dropped. The caller keeps the random state (:func:`preserved_rng`).
"""

from __future__ import annotations

import copy
import gc
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.outside_layers import OutsideLayers
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.runtime.apply import apply_plan, input_shard
from lightning_galvatron.runtime.mesh import MeshCache
from lightning_galvatron.runtime.pipeline import loss_of
from lightning_galvatron.runtime.vocab_parallel import parallel_cross_entropy
from lightning_galvatron.search.calibration import Observation
from lightning_galvatron.selection.memory import step_peak_bytes


@dataclass(frozen=True)
class TrialSettings:
    """How much measured selection may spend (``GalvatronStrategy(trials=...)``).

    Attributes:
        budget_s: wall-clock seconds for all trials together; the search's best plan is always tried, the next
            candidate only while the trials so far say it will end within the budget.
        warmup_steps, timed_steps: untimed and timed training steps per trial.
        max_candidates: plans tried at most (the search's best, the best of other kinds, the uniform plans).
        measure_memory: measure each trial's peak memory per rank (a plan over the budget is not chosen).
    """

    budget_s: float = 20.0
    warmup_steps: int = 1
    timed_steps: int = 3
    max_candidates: int = 6
    measure_memory: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.budget_s, bool) or not isinstance(self.budget_s, (int, float)) or not 0 < self.budget_s < math.inf:
            raise ValueError(f"trials budget_s must be a positive number of seconds, got {self.budget_s!r}")
        for name, least in (("warmup_steps", 0), ("timed_steps", 1), ("max_candidates", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"trials {name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.measure_memory, bool):
            raise ValueError(f"trials measure_memory must be True or False, got {self.measure_memory!r}")  # noqa: TRY004

    @classmethod
    def of(cls, value: bool | float | Mapping[str, Any] | TrialSettings | None) -> TrialSettings | None:
        """``True``: the defaults; ``False``/``None``: no trials; a number: the budget in seconds; a dict: fields."""
        if value is True:
            return cls()
        if value is False or value is None:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, (int, float)):
            return cls(budget_s=value)
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise ValueError(f"unknown trials settings {sorted(unknown)}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(
            f"trials must be True, False, a budget in seconds or a dict of {sorted(f.name for f in fields(cls))}, "
            f"got {value!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Measurement:
    """What a trial measured, the same on every rank."""

    step_s: float | None  # the fastest timed step (each the slowest rank's); None: the trial failed
    peak_bytes: int | None  # the largest peak over the ranks; None: not measured
    seconds: float  # the whole trial: copying, applying the plan, all its steps
    error: str | None = None


class TrialUnavailable(RuntimeError):
    """Trials cannot run for this module or data (the message says why); the search's plan is used."""


@contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore torch's (CPU and CUDA), numpy's and Python's random states on exit."""
    import numpy as np

    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


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
    return tree_unflatten(
        [x[shard * size : (shard + 1) * size] if isinstance(x, (torch.Tensor, list)) and len(x) else x for x in flat], spec
    )


@dataclass
class TrialRunner:
    """What a trial needs from the strategy: the user's module and data, and how the strategy applies a plan."""

    module: nn.Module  # the user's LightningModule: copied, never changed
    trainer: Any
    layers: str | Sequence[str] | None
    batch: Any  # a global batch of samples (global_batch_samples)
    meshes: MeshCache
    precision_plugin: Any
    mp_policy: MixedPrecisionPolicy
    boundary_dtype: torch.dtype
    device: torch.device
    entry_methods: Sequence[str]
    vocab_parallel_loss: bool
    outside_layers: Callable[[], OutsideLayers]  # collective; called only for pipelined candidates

    def run(self, plan: ParallelPlan, settings: TrialSettings, observe: bool = True) -> tuple[Measurement, list[Observation]]:
        """Train ``plan`` for a few steps on a copy (collective: every rank, the same plans in the same order).

        Returns the measurement (the same on every rank) and, on rank 0, every rank's observation for the
        calibration (empty elsewhere, and when ``observe`` is false or the trial failed).
        """
        started = time.perf_counter()
        outcome: tuple[list[float], int | None, Observation | None, str | None]
        outside = self.outside_layers() if plan.pp > 1 else None  # collective, before anything can fail
        try:
            outcome = self._train(plan, settings, observe, outside)
        except Exception as error:  # noqa: BLE001 - a plan that fails here is not chosen; the others go on
            outcome = ([], None, None, f"{type(error).__name__}: {error}")
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
        return Measurement(min(steps), max(peaks) if peaks else None, seconds), observations

    # ------------------------------------------------------------------ one trial on this rank
    def _train(
        self, plan: ParallelPlan, settings: TrialSettings, observe: bool, outside: OutsideLayers | None
    ) -> tuple[list[float], int | None, Observation | None, None]:
        from lightning_galvatron.profiler.runtime import RuntimeProfiler

        model = self._copy()
        structure = find_blocks(model, self.layers)
        blocks = structure.blocks  # by global index; a pipeline stage keeps only its own in the containers
        model = self.precision_plugin.convert_module(model)
        applied = apply_plan(
            model, structure, plan, self.meshes, self.mp_policy, entry_methods=self.entry_methods,
            parallel_loss=self._parallel_loss(plan), boundary_dtype=self.boundary_dtype, outside_layers=outside,
        )
        _materialize_distributed_module(model, self.device)
        model.to(self.device)
        optimizers = [o for o in _init_optimizers_and_lr_schedulers(model)[0] if o.param_groups]
        for optimizer in optimizers:
            optimizer.register_step_post_hook(lambda *_: applied.gradients.optimizer_stepped())
        num_shards, shard = input_shard(plan, dist.get_rank())
        batch = move_data_to_device(_shard(self.batch, num_shards, shard), self.device)
        takes_index = is_param_in_hook_signature(model.training_step, "batch_idx", min_args=2)
        train_context = self.precision_plugin.train_step_context
        step_context = parallel_cross_entropy if self._parallel_loss(plan) else nullcontext

        def user_step(micro_batch: Any) -> Any:
            with train_context():
                return model.training_step(micro_batch, 0) if takes_index else model.training_step(micro_batch)

        def step() -> None:
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            if applied.runner is None:
                with step_context():
                    loss = loss_of(user_step(batch))
                    if loss is None:
                        raise TrialUnavailable("training_step returned no loss")
                    (loss / applied.input_shards).backward()
            else:
                scale = 1.0 / (applied.input_shards * plan.micro_batches)
                with step_context(), applied.gradients.deferred():
                    applied.runner.run(batch, user_step, loss_scale=scale, train=True)
                applied.gradients.reduce()
            if runtime is not None:
                runtime.optimizer_started()
            for optimizer in optimizers:
                optimizer.step()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)

        runtime: RuntimeProfiler | None = None
        local = applied.partition.local_blocks if applied.partition is not None else range(len(blocks))
        cuda = self.device.type == "cuda"
        model.train()
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
            times.append(_now(self.device) - began)
        observation = _finish(runtime)
        runtime = None
        peak = step_peak_bytes(step, model, optimizers, self.device) if settings.measure_memory else None
        if observe and cuda:
            runtime = RuntimeProfiler(plan, {i: blocks[i] for i in local}, optimizers, self.device)
            runtime.start()
            for _ in range(2):
                runtime.step_started()
                step()
            observation = _finish(runtime)
        applied.gradients.remove()
        return times, peak, observation, None

    def _parallel_loss(self, plan: ParallelPlan) -> bool:
        return self.vocab_parallel_loss and plan.vocab.tp > 1

    def _copy(self) -> nn.Module:
        """A deep copy of the user's module that shares the Trainer (Lightning drops it when copying) and logs
        nothing."""
        try:
            model = copy.deepcopy(self.module)
        except Exception as error:
            raise TrialUnavailable(f"the LightningModule cannot be copied for trials ({type(error).__name__}: {error})") from error
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


__all__ = [
    "Measurement",
    "TrialRunner",
    "TrialSettings",
    "TrialUnavailable",
    "global_batch_samples",
    "no_trials_reason",
    "preserved_rng",
]
