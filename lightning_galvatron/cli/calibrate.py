"""Calibrate the cost model on this machine: train a few probe plans briefly, time them, fit.

A calibration (:mod:`lightning_galvatron.search.coefficients`) says what a machine adds to the profile's
prices; it is fitted from what the runtime profiler measures while real plans train. :func:`calibrate` is the
whole workflow (``lightning-galvatron calibrate`` runs it), on every rank of a job -- under ``torchrun``, or
any launcher that sets ``WORLD_SIZE``/``RANK``, or Lightning's own launcher with ``devices=N``:

1. :func:`probe_plans`: plans that exercise every mechanism once -- one block of each kind of strategy (DDP,
   ZeRO-2, ZeRO-3, recomputation, Megatron TP, Megatron-SP, Ulysses) as the model allows them, at two
   micro-batch sizes, and a pipeline;
2. each trains ``warmup_steps + timed_steps`` steps with a :class:`CalibrationProbe`: the runtime profiler
   times the timed steps, and every rank's :class:`~lightning_galvatron.search.calibration.Observation` is
   gathered;
3. :func:`~lightning_galvatron.search.calibration.fit_calibration` fits the coefficients to all of them.

The probes are for measuring, not for training: each starts from a fresh module.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as L
import torch.distributed as dist

from lightning_galvatron._compat import override
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError, divisors
from lightning_galvatron.profiler.runtime import RuntimeProfiler
from lightning_galvatron.profiles import Profile, load_profile
from lightning_galvatron.search.calibration import Observation, fit_calibration
from lightning_galvatron.search.coefficients import Calibration
from lightning_galvatron.search.overheads import profile_calibration
from lightning_galvatron.search.profile_facts import layer_problem
from lightning_galvatron.strategy.autoplan import optimizer_kind
from lightning_galvatron.strategy.trainer_strategy import GalvatronStrategy


def probe_plans(profile: Profile, world_size: int, global_batch_size: int) -> dict[str, ParallelPlan]:
    """Plans that exercise every mechanism once (see the module docstring), as far as ``profile``'s model, the
    world size and the global batch allow: the strategies every block type runs, spread over the blocks."""
    model, W, B = profile.model, world_size, global_batch_size
    num_blocks = model.num_blocks

    def runnable(kinds: list[dict[str, Any]]) -> tuple[LayerStrategy, ...]:
        out = []
        for kind in kinds:
            if kind.get("tp", 1) == 1 and kind.get("sp", "none") != "none":
                continue
            strategy = LayerStrategy(**kind)
            if all(layer_problem(strategy, t) is None for t in model.layer_types):
                out.append(strategy)
        return tuple(out[i * len(out) // num_blocks] for i in range(num_blocks))

    small = next((d for d in divisors(W) if d > 1), 1)
    mixed = runnable(
        [
            {},
            {"dp_type": "zero2"},
            {"dp_type": "zero3"},
            {"dp_type": "zero3", "recompute": True},
            {"tp": small, "dp_type": "zero2"},
            {"tp": W},
            {"tp": small, "sp": "megatron"},
            {"tp": W, "sp": "ulysses"},
        ]
    )
    candidates = {"probe": {"layers": mixed}, "probe-4-micro-batches": {"layers": mixed, "micro_batches": 4}}
    if W % 2 == 0 and num_blocks >= 2 and model.block_lists == 1:
        # The stages differ in how many of their parameters are plain tensors and how many DTensors, which the
        # optimizer updates at different costs.
        g = next((d for d in divisors(W // 2) if d > 1), 1)
        staged = runnable(
            [
                {},
                {"tp": g, "sp": "ulysses"},
                {"dp_type": "zero2"},
                {"dp_type": "zero3", "recompute": True},
                {"tp": g, "dp_type": "zero2"},
                {"tp": g},
                {"tp": g, "sp": "megatron"},
                {"dp_type": "zero3"},
            ]
        )
        candidates["probe-pp2"] = {"layers": staged, "pp": 2, "schedule": "1f1b", "micro_batches": 4}
    out = {}
    for name, fields in candidates.items():
        try:
            out[name] = ParallelPlan(world_size=W, global_batch_size=B, **fields)
        except PlanError:
            continue  # e.g. a global batch that 4 micro-batches of every data shard cannot split
    if not out:
        raise PlanError(f"no probe plan splits a global batch of {B} over {W} devices: use a multiple of {W}")
    return out


class CalibrationProbe(L.Callback):
    """Runs the runtime profiler in a training run of a ``GalvatronStrategy``: ``warmup`` steps, then ``timed``
    recorded steps; :attr:`observations` holds every rank's afterwards (gathered, on every rank)."""

    def __init__(self, warmup: int, timed: int) -> None:
        self.warmup, self.timed = warmup, timed
        self.runtime: Any = None
        self.steps = 0
        self.observations: list[Observation] = []

    @property
    def total_steps(self) -> int:
        """Steps a run needs: the last recorded step ends when the next one starts."""
        return self.warmup + self.timed + 1

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        applied = getattr(strategy, "_applied", None)
        if applied is None:  # not a GalvatronStrategy: nothing to observe
            return
        # With a pipeline the containers keep only this stage's blocks (in order): local_blocks are their indices.
        everything = range(len(strategy.structure.blocks))
        local = applied.partition.local_blocks if applied.partition is not None else everything
        blocks = dict(zip(local, strategy.structure.blocks))
        self.runtime = RuntimeProfiler(strategy.plan, blocks, trainer.optimizers, pl_module.device)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if self.runtime is None:
            return
        if self.steps == self.warmup:
            self.runtime.start()
        elif self.steps == self.warmup + self.timed:
            self.runtime.stop()
        self.runtime.step_started()
        self.steps += 1

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.runtime is not None:
            self.runtime.optimizer_started()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.runtime is None:
            return
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.runtime.observation(dist.get_rank()))
        self.runtime.remove()
        self.runtime = None
        self.observations = list(gathered)


def launched_world(devices: int | None = None) -> tuple[int | None, int | None]:
    """(processes per node, processes in all): from an initialised process group, else the launcher's environment
    (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``), else ``devices`` on one node; ``None`` where nothing says.

    The group first: Lightning's own environment deletes ``WORLD_SIZE`` when a Trainer tears down, so a process
    that trained before has lost it."""
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        return devices or int(os.environ.get("LOCAL_WORLD_SIZE") or world), world
    environment = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE")
    devices = devices or (int(environment) if environment else None)
    return devices, int(os.environ.get("WORLD_SIZE") or devices) if devices is not None else None


def calibrate(
    profile: Profile | str,
    make_module: Callable[[], L.LightningModule],
    train_data: Any,
    *,
    global_batch_size: int,
    plans: Mapping[str, ParallelPlan] | None = None,
    layers: str | Sequence[str] | None = None,
    warmup_steps: int = 2,
    timed_steps: int = 4,
    precision: str = "32-true",
    accelerator: str = "auto",
    devices: int | None = None,
) -> Calibration:
    """Fit a :class:`~lightning_galvatron.search.coefficients.Calibration` of ``profile``'s cost model to short
    runs of ``plans`` (default: :func:`probe_plans`) on this machine; run it on every rank.

    Args:
        profile: the profile of this model on this machine (``lightning-galvatron profile``).
        make_module: a fresh LightningModule per run.
        train_data: what ``Trainer.fit`` takes: a LightningDataModule or a training DataLoader.
        global_batch_size: samples per optimizer step of the probes.
        layers: where the blocks are, as ``GalvatronStrategy(layers=...)`` takes it (default: detected).
        devices: processes per node; default ``LOCAL_WORLD_SIZE`` or ``WORLD_SIZE`` from the launcher's
            environment. Without one, Lightning's launcher starts them.
    """
    profile = load_profile(profile)
    devices, world = launched_world(devices)
    if devices is None or world is None:
        raise ValueError("say how many processes to calibrate on: pass devices, or run under torchrun")
    observations: list[Observation] = []
    optimizer = "adamw"
    for plan in (plans or probe_plans(profile, world, global_batch_size)).values():
        probe = CalibrationProbe(warmup_steps, timed_steps)
        trainer = L.Trainer(
            accelerator=accelerator,
            devices=devices,
            num_nodes=world // devices,
            precision=precision,
            strategy=GalvatronStrategy(plan=plan, layers=layers, save_plan=False, global_batch_size=global_batch_size),
            max_steps=probe.total_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[probe],
        )
        trainer.fit(make_module(), train_data)
        optimizer = optimizer_kind(trainer.optimizers[0] if trainer.optimizers else None)
        observations += probe.observations
    return fit_calibration(
        profile,
        observations,
        precision=precision,
        optimizer=optimizer,
        source="probe plans",
        prior=profile_calibration(profile),
    )


__all__ = ["CalibrationProbe", "calibrate", "probe_plans"]
