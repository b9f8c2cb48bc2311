"""What a machine adds per call, measured at profile time: the optional ``overheads`` section of a profile.

The model half of a profile prices compute, the hardware half communication; neither sees what FSDP2's
hooks, DTensor's dispatch under tensor parallelism, a recomputed block's checkpoint, the optimizer's
per-tensor work, a pipeline schedule's own work or the DDP reduction a backward leaves exposed add. On small
models and CPUs that is most of a step, and it differs between strategies. The profiler times it directly
(:mod:`lightning_galvatron.profiler.model.overheads`): one block of each type, forward and backward, under each kind of
strategy, the optimizer step over plain tensors and DTensors, steps of real pipeline schedules over copies of a
block, and copies of a block without and with DDP's gradient reduction; the search turns the probes into a
calibration (:mod:`lightning_galvatron.search.overheads`).

JSON (``"overheads"`` at the top level of a profile; absent in profiles measured before it)::

    {"world_size": 4, "compute_slots": 2, "block_tensors": [12], "vocab_tensors": 4,
     "calls": [{"layer_type": 0, "strategy": {"tp": 2, "sp": "megatron", ...}, "group_size": 4,
                "local_batch": 2, "seconds": 0.031}, ...],
     "optimizer": [{"tensors": 8, "elements": 2048, "dtensor": false, "seconds": 0.0012}, ...],
     "pipelines": [{"layer_type": 0, "pp": 2, "schedule": "1f1b", "micro_batches": 2, "virtual_stages": 1,
                    "blocks_per_chunk": 2, "micro_batch": 4, "seconds": 0.046}, ...],
     "reductions": [{"layer_type": 0, "blocks": 8, "group_size": 4, "local_batch": 4, "plain_seconds": 0.054,
                     "reduced_seconds": 0.085}]}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_galvatron.plan import SCHEDULES, LayerStrategy, PlanError
from lightning_galvatron.profiles.fields import ProfileError, _fields, _finite_nonneg, _positive_int


def _layer_type(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProfileError(f"{where}: layer_type must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class CallProbe:
    """Forward and backward of one block call: the slowest rank's seconds (the median of its repeated calls).

    Attributes:
        layer_type: index into the profile's layer types.
        strategy: how the block ran (``ddp``: unwrapped, its gradient reduction is the model's).
        group_size: ranks that ran it together (the world of the probe; ``tp`` of them per group).
        local_batch: samples each group processed.
    """

    layer_type: int
    strategy: LayerStrategy
    group_size: int
    local_batch: int
    seconds: float

    def __post_init__(self) -> None:
        _layer_type("call probe", self.layer_type)
        _positive_int("call probe: group_size", self.group_size)
        _positive_int("call probe: local_batch", self.local_batch)
        _finite_nonneg("call probe: seconds", self.seconds)
        if self.group_size % self.strategy.tp:
            raise ProfileError(f"call probe: tp={self.strategy.tp} does not divide group_size={self.group_size}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_type": self.layer_type,
            "strategy": self.strategy.to_dict(),
            "group_size": self.group_size,
            "local_batch": self.local_batch,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CallProbe:
        kwargs = _fields(data, where, cls=cls)
        try:
            kwargs["strategy"] = LayerStrategy.from_dict(kwargs["strategy"], f"{where}.strategy")
        except PlanError as err:
            raise ProfileError(str(err)) from None
        return cls(**kwargs)


@dataclass(frozen=True)
class OptimizerProbe:
    """One optimizer step over ``tensors`` parameters of ``elements`` local elements in all (DTensors or not)."""

    tensors: int
    elements: int
    dtensor: bool
    seconds: float

    def __post_init__(self) -> None:
        _positive_int("optimizer probe: tensors", self.tensors)
        _positive_int("optimizer probe: elements", self.elements)
        if not isinstance(self.dtensor, bool):
            raise ProfileError(f"optimizer probe: dtensor must be true or false, got {self.dtensor!r}")
        _finite_nonneg("optimizer probe: seconds", self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> OptimizerProbe:
        return cls(**_fields(data, where, cls=cls))


@dataclass(frozen=True)
class PipelineProbe:
    """One training step (forward and backward, no optimizer) of a real pipeline schedule whose stages are copies
    of one block type: the slowest rank's seconds (the median of its steps). The world runs ``world_size / pp``
    such pipelines side by side, so every rank is in one, as in training.

    Attributes:
        layer_type: index into the profile's layer types.
        pp, schedule, micro_batches, virtual_stages: the pipeline (``virtual_stages`` model chunks per rank).
        blocks_per_chunk: block copies in each model chunk.
        micro_batch: samples of one micro-batch.
    """

    layer_type: int
    pp: int
    schedule: str
    micro_batches: int
    virtual_stages: int
    blocks_per_chunk: int
    micro_batch: int
    seconds: float

    def __post_init__(self) -> None:
        _layer_type("pipeline probe", self.layer_type)
        for name in ("pp", "micro_batches", "virtual_stages", "blocks_per_chunk", "micro_batch"):
            _positive_int(f"pipeline probe: {name}", getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise ProfileError(f"pipeline probe: schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        _finite_nonneg("pipeline probe: seconds", self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> PipelineProbe:
        return cls(**_fields(data, where, cls=cls))


@dataclass(frozen=True)
class ReductionProbe:
    """Forward and backward of copies of one block type in sequence, without and with the runtime's DDP gradient
    reduction over the world (``runtime.gradient_sync.GradientReducer``, buckets as in training): the slowest
    rank's seconds of each (medians of their steps). What the second takes beyond the first is the reduction the
    backward leaves exposed -- the buckets still in flight when it ends, and the wait for the slowest rank.

    Attributes:
        layer_type: index into the profile's layer types.
        blocks: block copies, as many as the model has of that type (at most a few).
        group_size: ranks whose gradients were summed (the world of the probe).
        local_batch: samples each rank processed.
    """

    layer_type: int
    blocks: int
    group_size: int
    local_batch: int
    plain_seconds: float
    reduced_seconds: float

    def __post_init__(self) -> None:
        _layer_type("reduction probe", self.layer_type)
        for name in ("blocks", "group_size", "local_batch"):
            _positive_int(f"reduction probe: {name}", getattr(self, name))
        _finite_nonneg("reduction probe: plain_seconds", self.plain_seconds)
        _finite_nonneg("reduction probe: reduced_seconds", self.reduced_seconds)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ReductionProbe:
        return cls(**_fields(data, where, cls=cls))


@dataclass(frozen=True)
class Overheads:
    """The probes of one profiling run.

    Attributes:
        world_size: ranks that measured them (all at once, so contention for shared cores is in them).
        calls, optimizer, pipelines, reductions: the probes (``pipelines`` and ``reductions`` empty in profiles
            measured before them, or on one rank).
        compute_slots: CPU cores the node's ranks share (``None`` on GPUs: a device per rank).
        block_tensors: parameter tensors of one block, per layer type (the optimizer's per-tensor work).
        vocab_tensors: parameter tensors outside the blocks (embedding, head, final norm).
    """

    world_size: int
    calls: tuple[CallProbe, ...]
    optimizer: tuple[OptimizerProbe, ...] = ()
    compute_slots: int | None = None
    block_tensors: tuple[int, ...] = ()
    vocab_tensors: int = 0
    pipelines: tuple[PipelineProbe, ...] = ()
    reductions: tuple[ReductionProbe, ...] = ()

    def __post_init__(self) -> None:
        _positive_int("overheads: world_size", self.world_size)
        if self.compute_slots is not None:
            _positive_int("overheads: compute_slots", self.compute_slots)
        for n in (*self.block_tensors, self.vocab_tensors):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ProfileError(f"overheads: tensor counts must be integers >= 0, got {n!r}")
        object.__setattr__(self, "calls", tuple(self.calls))
        object.__setattr__(self, "optimizer", tuple(self.optimizer))
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        object.__setattr__(self, "reductions", tuple(self.reductions))
        object.__setattr__(self, "block_tensors", tuple(self.block_tensors))

    def check(self, layer_types: int) -> None:
        """Every probe names one of the profile's ``layer_types``."""
        for kind, probes in (("call", self.calls), ("pipeline", self.pipelines), ("reduction", self.reductions)):
            for probe in probes:
                if probe.layer_type >= layer_types:
                    raise ProfileError(
                        f"overheads: a {kind} probe names layer type {probe.layer_type}; the model has {layer_types}"
                    )
        if self.block_tensors and len(self.block_tensors) != layer_types:
            raise ProfileError(
                f"overheads: block_tensors has {len(self.block_tensors)} entries; "
                f"the model has {layer_types} layer types"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "compute_slots": self.compute_slots,
            "block_tensors": list(self.block_tensors),
            "vocab_tensors": self.vocab_tensors,
            "calls": [c.to_dict() for c in self.calls],
            "optimizer": [o.to_dict() for o in self.optimizer],
            "pipelines": [p.to_dict() for p in self.pipelines],
            "reductions": [r.to_dict() for r in self.reductions],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "overheads") -> Overheads:
        kwargs = _fields(data, where, cls=cls)
        for name, probe in (
            ("calls", CallProbe),
            ("optimizer", OptimizerProbe),
            ("pipelines", PipelineProbe),
            ("reductions", ReductionProbe),
        ):
            items = kwargs.get(name, ())
            if not isinstance(items, (list, tuple)):
                raise ProfileError(f"{where}.{name} must be a list, got {type(items).__name__}")
            kwargs[name] = tuple(probe.from_dict(item, f"{where}.{name}[{i}]") for i, item in enumerate(items))
        if not isinstance(kwargs.get("block_tensors", ()), (list, tuple)):
            raise ProfileError(f"{where}.block_tensors must be a list of integers")
        return cls(**kwargs)


__all__ = ["CallProbe", "OptimizerProbe", "Overheads", "PipelineProbe", "ReductionProbe"]
