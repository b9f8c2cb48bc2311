"""Calibration of the cost model from measured training steps.

The cost model prices a block from its profile: compute from the block's forward-time fit, communication
from the collective fits, overlapped with the profile's coefficient. That is what a GPU spends its time
on. It leaves out what a machine adds per *call* -- FSDP2's hooks, DTensor's dispatch of every op under
tensor parallelism, the re-run of a recomputed block, the training loop, the optimizer's per-tensor work
-- and what contention does to compute when processes share cores. On a small model on CPUs those are
most of the step, and they differ between strategies (tensor parallelism several times more than data
parallelism), so they change which plan is fastest.

A :class:`Calibration` says what a machine adds, in terms the search can use; it is fitted
(:func:`~lightning_galvatron.search.calibration.fit_calibration`) from observations -- what
:class:`~lightning_galvatron.profiler.runtime.RuntimeProfiler` measured on each rank over a few training
steps of one or more plans (e.g. a probe plan with one block of each kind of strategy, at two micro-batch
sizes; :mod:`lightning_galvatron.cli.calibrate`), or, for the per-call terms and the optimizer only, from the probes
the profiler measured with the profile (:mod:`lightning_galvatron.search.overheads`, what prices plans when no
calibration is given). Per block call (forward and backward of one micro-batch)::

    time = c_compute[family] * (1 + beta) * f(b/g)  # the profiled compute, rescaled per family
                                                    # (plain, Megatron TP, Ulysses)
         + c_recompute * [recompute] * f(b/g)       # the replay of a recomputed block
         + c_communication * comm                   # the modelled communication left exposed
         + c_call + c_zero2 [zero2] + c_zero3 [zero3] + c_tensor_parallel [Megatron TP]
         + c_megatron_sp [Megatron SP] + c_ulysses [Ulysses] + c_recompute_call [recompute]

with ``f`` the profile's forward fit at local micro-batch ``b`` over a group of ``g``, ``beta`` its
backward/forward ratio and ``comm`` what the uncalibrated model predicts beyond compute. The coefficients
are non-negative and fitted by least squares over every measured block call (relocations into a block,
priced by the model, are taken off first). Strategies not seen in any observation are still priced: by the
terms they share (a ``tp2-megatron-zero2`` block adds the Megatron-TP, Megatron-SP and ZeRO-2 terms
measured on other blocks).

The embedding and head (everything outside the blocks in forward and backward, the loss included) get
their own compute scale and per-micro-batch time; the optimizer step costs ``c_tensor`` per parameter
tensor plus ``c_element`` per parameter element a rank holds; every step adds a fixed ``step_overhead_s``
(the training loop), and a pipeline adds ``pipeline_overhead_s`` per micro-batch and model chunk on every stage
(the schedule's own work besides the transfers). Where the ranks of a node share fewer cores than they are
(several CPU processes per core), a pipeline's stages, idle during its fill and drain, leave cores to the
busy ones: their work is scaled by :meth:`Calibration.sharing_factor`. Every block whose gradients DDP sums over
replicas adds ``ddp_reduction_s`` once per step: the reduction its backward leaves exposed (the runtime's last
buckets launch when backward ends, and the sum waits for the slowest rank), which the model's overlap of the
all-reduce with backward does not see.

This module holds the coefficients and how the cost model applies them (:func:`block_features`,
:func:`vocab_time`); the fit is :mod:`lightning_galvatron.search.calibration`, which uses the cost model.
Torch-free (numpy only), like the rest of the search.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np
from numpy.typing import NDArray

from lightning_galvatron.jsonfile import read_json_object

if TYPE_CHECKING:  # space imports the options, which import this module
    from lightning_galvatron.search.space import StrategyArrays

CALIBRATION_FORMAT = "lightning_galvatron.calibration"
CALIBRATION_VERSION = 2  # 2: ddp_reduction_s (files of version 1 load, without it)

#: Per-block-call terms, in the order of the feature columns (see the module docstring).
BLOCK_TERMS = (
    "compute",
    "compute_tensor_parallel",
    "compute_ulysses",
    "recompute",
    "communication",
    "call",
    "zero2",
    "zero3",
    "tensor_parallel",
    "megatron_sp",
    "ulysses",
    "recompute_call",
)
#: What an uncalibrated model amounts to: compute and communication as modelled, nothing per call.
IDENTITY_BLOCK = {
    "compute": 1.0,
    "compute_tensor_parallel": 1.0,
    "compute_ulysses": 1.0,
    "recompute": 1.0,
    "communication": 1.0,
}


# ---------------------------------------------------------------------------------------------- the calibration
@dataclass(frozen=True)
class Calibration:
    """Coefficients of the calibrated cost model (see the module docstring). Seconds throughout.

    Attributes:
        block: coefficient per term of :data:`BLOCK_TERMS` (missing terms: 0, or 1 for compute,
            recompute and communication).
        vocab_compute, vocab_communication, vocab_call_s: the embedding and head per micro-batch: scale of
            their profiled compute and modelled communication, and a fixed time.
        optimizer_s_per_tensor, optimizer_s_per_element: the optimizer step per parameter tensor and element.
        optimizer_s_per_dtensor: per parameter tensor instead, when it is a DTensor (sharded by ZeRO or split
            by tensor parallelism); ``None`` (older calibrations): as a plain tensor.
        tensors_per_layer_type: parameter tensors of one block of each layer type (by name).
        vocab_tensors: parameter tensors outside the blocks (embedding, head, final norm).
        step_overhead_s: fixed time per training step.
        pipeline_overhead_s: per micro-batch and model chunk of each pipeline stage (``v`` chunks per stage when
            interleaved).
        ddp_reduction_s: per step and block whose gradients DDP sums over replicas, beyond the modelled all-reduce.
        compute_slots_per_node: ranks of a node that can compute at full speed at once, when fewer than the
            ranks (processes sharing CPU cores): see :meth:`sharing_factor`. ``None``: devices are not shared.
        observations: how many block calls the fit used; residual: their relative RMS misfit.
    """

    block: Mapping[str, float] = field(default_factory=lambda: dict(IDENTITY_BLOCK))
    vocab_compute: float = 1.0
    vocab_communication: float = 1.0
    vocab_call_s: float = 0.0
    optimizer_s_per_tensor: float = 0.0
    optimizer_s_per_element: float = 0.0
    optimizer_s_per_dtensor: float | None = None
    tensors_per_layer_type: Mapping[str, int] = field(default_factory=dict)
    vocab_tensors: int = 0
    step_overhead_s: float = 0.0
    pipeline_overhead_s: float = 0.0
    ddp_reduction_s: float = 0.0
    compute_slots_per_node: int | None = None
    observations: int = 0
    residual: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.block) - set(BLOCK_TERMS)
        if unknown:
            raise ValueError(f"unknown block terms {sorted(unknown)}; known: {BLOCK_TERMS}")
        for name, value in [
            *self.block.items(),
            *(
                (f.name, getattr(self, f.name))
                for f in dataclasses.fields(self)
                if f.type == "float" or (f.type == "float | None" and getattr(self, f.name) is not None)
            ),
        ]:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"calibration term {name} must be a finite number >= 0, got {value!r}")
        object.__setattr__(self, "block", dict(self.block))
        object.__setattr__(self, "tensors_per_layer_type", dict(self.tensors_per_layer_type))

    @property
    def coefficients(self) -> NDArray[np.float64]:
        """Block coefficients in the order of :data:`BLOCK_TERMS`."""
        return np.array([self.block.get(t, IDENTITY_BLOCK.get(t, 0.0)) for t in BLOCK_TERMS])

    def sharing_factor(self, pp: int, micro_batches: int, ranks_per_node: int, virtual_stages: int = 1) -> float:
        """Time of a pipeline stage's work relative to the same work with every rank busy.

        When the ranks of a node share fewer compute slots (cores) than they are, a rank computes at
        ``min(1, slots / busy)`` of a slot's speed. The block terms are fitted (and apply) with every rank
        busy; a pipeline keeps a stage busy only ``U`` of its step (fill and drain: ``m`` micro-batches of
        work in a step of ``m + (pp - 1) / v`` of them, or ``pp + (m - 1) / v`` where ``m < pp`` with
        ``v > 1`` model chunks per rank, as :func:`~.pipeline.pipeline_step_time` schedules them), so on
        average ``ranks * U`` ranks compute at once and each runs faster by
        ``min(1, slots / ranks) / min(1, slots / (ranks * U))``. 1 without a pipeline or without sharing.
        """
        slots = self.compute_slots_per_node
        if pp <= 1 or slots is None or slots >= ranks_per_node:
            return 1.0
        m, v = micro_batches, virtual_stages
        span = pp + (m - 1) / v if v > 1 and m < pp else m + (pp - 1) / v
        busy = ranks_per_node * m / span
        return min(1.0, slots / ranks_per_node) / min(1.0, slots / busy)

    @property
    def optimizer_s_per_dtensor_or_tensor(self) -> float:
        return self.optimizer_s_per_tensor if self.optimizer_s_per_dtensor is None else self.optimizer_s_per_dtensor

    @overload
    def optimizer_time(self, tensors: float, elements: float, dtensors: bool = False) -> float: ...

    @overload
    def optimizer_time(
        self, tensors: float, elements: NDArray[np.float64], dtensors: bool | NDArray[np.bool_] = False
    ) -> NDArray[np.float64]: ...

    def optimizer_time(
        self, tensors: float, elements: float | NDArray[np.float64], dtensors: bool | NDArray[np.bool_] = False
    ) -> float | NDArray[np.float64]:
        """The optimizer step for ``tensors`` parameter tensors of ``elements`` elements (``dtensors``: DTensors),
        per candidate where ``elements`` is an array."""
        per_tensor = np.where(dtensors, self.optimizer_s_per_dtensor_or_tensor, self.optimizer_s_per_tensor)
        return per_tensor * tensors + self.optimizer_s_per_element * elements

    def describe(self) -> str:
        def ms(s: float) -> str:
            return f"{s * 1e3:.2f} ms"

        b = {t: self.block.get(t, IDENTITY_BLOCK.get(t, 0.0)) for t in BLOCK_TERMS}
        return (
            f"compute x{b['compute']:.2f} (Megatron TP x{b['compute_tensor_parallel']:.2f}, "
            f"Ulysses x{b['compute_ulysses']:.2f}), recompute replay x{b['recompute']:.2f} forwards, "
            f"communication x{b['communication']:.2f}; per block call {ms(b['call'])} (+ZeRO-2 {ms(b['zero2'])}, "
            f"+ZeRO-3 {ms(b['zero3'])}, +TP {ms(b['tensor_parallel'])}, "
            f"+Megatron-SP {ms(b['megatron_sp'])}, +Ulysses {ms(b['ulysses'])}, +recompute {ms(b['recompute_call'])}); "
            f"embedding/head x{self.vocab_compute:.2f} + {ms(self.vocab_call_s)} per micro-batch; optimizer "
            f"{self.optimizer_s_per_tensor * 1e6:.0f} us/tensor ({self.optimizer_s_per_dtensor_or_tensor * 1e6:.0f} "
            f"us/DTensor) + {self.optimizer_s_per_element * 1e9:.1f} ns/element; "
            f"step {ms(self.step_overhead_s)}, "
            f"pipeline {ms(self.pipeline_overhead_s)} per micro-batch and model chunk, "
            f"DDP reduction {ms(self.ddp_reduction_s)} per block and step"
            + (f"; {self.compute_slots_per_node} compute slots per node" if self.compute_slots_per_node else "")
            + " "
            f"({self.observations} block calls, misfit {self.residual:.0%})"
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        out = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION}
        out.update(dataclasses.asdict(self))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        if data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"not a lightning_galvatron calibration: format={data.get('format')!r}")
        if data.get("version", 0) > CALIBRATION_VERSION:
            raise ValueError(
                f"calibration version {data['version']} is newer than this lightning_galvatron understands"
            )
        kwargs = {k: v for k, v in data.items() if k not in ("format", "version")}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown calibration keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs)

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        data = read_json_object(path, "calibration file")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"calibration file {str(path)!r}: {err}") from None


def load_calibration(
    source: Calibration | Mapping[str, Any] | str | os.PathLike[str] | None,
) -> Calibration | None:
    if source is None or isinstance(source, Calibration):
        return source
    if isinstance(source, Mapping):
        return Calibration.from_dict(source)
    return Calibration.load(source)


# ---------------------------------------------------------------------------------------------- features
def block_features(
    forward: NDArray[np.float64], backward_to_forward: float, analytic_time: NDArray[np.float64], sa: StrategyArrays
) -> NDArray[np.float64]:
    """Feature columns (:data:`BLOCK_TERMS`) of each candidate: ``(S, len(BLOCK_TERMS))``.

    ``forward`` is the profiled forward compute ``f(b/g)``, ``analytic_time`` the uncalibrated time per
    micro-batch (compute, recompute and communication as the model overlaps them).
    """
    forward = np.asarray(forward, dtype=float)
    recompute = np.asarray(sa.recompute, dtype=float)
    compute = (1.0 + backward_to_forward) * forward
    replay = recompute * forward
    communication = np.maximum(np.asarray(analytic_time, dtype=float) - compute - replay, 0.0)
    ones = np.ones_like(forward)
    tensor_parallel = np.asarray(sa.splits_weights, dtype=bool)
    ulysses = np.asarray(sa.ulysses, dtype=bool)
    return np.stack(
        [
            np.where(tensor_parallel | ulysses, 0.0, compute),
            np.where(tensor_parallel, compute, 0.0),
            np.where(ulysses, compute, 0.0),
            replay,
            communication,
            ones,
            (sa.dp_code == 1).astype(float),
            (sa.dp_code == 2).astype(float),
            np.asarray(sa.splits_weights, dtype=float),
            np.asarray(sa.megatron_sp, dtype=float),
            np.asarray(sa.ulysses, dtype=float),
            recompute,
        ],
        axis=-1,
    )


def vocab_time(
    calibration: Calibration, compute: NDArray[np.float64], analytic_time: NDArray[np.float64], sa: StrategyArrays
) -> NDArray[np.float64]:
    """Calibrated time of the embedding or the head per micro-batch (half of the fixed time each)."""
    compute = np.asarray(compute, dtype=float)
    communication = np.maximum(np.asarray(analytic_time, dtype=float) - compute, 0.0)
    b = calibration.block
    mechanisms: NDArray[np.float64] = (
        (sa.dp_code == 1) * b.get("zero2", 0.0)
        + (sa.dp_code == 2) * b.get("zero3", 0.0)
        + np.asarray(sa.splits_weights, dtype=float) * b.get("tensor_parallel", 0.0)
    )
    return (
        calibration.vocab_compute * compute
        + calibration.vocab_communication * communication
        + 0.5 * (calibration.vocab_call_s + mechanisms)
    )


__all__ = [
    "BLOCK_TERMS",
    "CALIBRATION_FORMAT",
    "CALIBRATION_VERSION",
    "IDENTITY_BLOCK",
    "Calibration",
    "block_features",
    "load_calibration",
    "vocab_time",
]
