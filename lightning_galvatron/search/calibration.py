"""Calibration of the cost model from measured training steps.

The cost model prices a block from its profile: compute from the block's forward-time fit, communication
from the collective fits, overlapped with the profile's coefficient. That is what a GPU spends its time
on. It leaves out what a machine adds per *call* -- FSDP2's hooks, DTensor's dispatch of every op under
tensor parallelism, the re-run of a recomputed block, the training loop, the optimizer's per-tensor work
-- and what contention does to compute when processes share cores. On a small model on CPUs those are
most of the step, and they differ between strategies (tensor parallelism several times more than data
parallelism), so they change which plan is fastest.

A :class:`Calibration` says what a machine adds, in terms the search can use; it is fitted from
:class:`Observation` s -- what :class:`~lightning_galvatron.profiler.runtime.RuntimeProfiler` measured on
each rank over a few training steps of one or more plans (e.g. a probe plan with one block of each kind
of strategy, at two micro-batch sizes). Per block call (forward and backward of one micro-batch)::

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
(the training loop), and a pipeline adds ``pipeline_overhead_s`` per micro-batch and stage (the
schedule's own work besides the transfers). Where the ranks of a node share fewer cores than they are
(several CPU processes per core), a pipeline's stages, idle during its fill and drain, leave cores to the
busy ones: their work is scaled by :meth:`Calibration.sharing_factor`.

This module is torch-free (numpy only), like the rest of the search.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_galvatron.jsonfile import read_json_object
from lightning_galvatron.plan import LayerStrategy, ParallelPlan
from lightning_galvatron.profiles import Profile

CALIBRATION_FORMAT = "lightning_galvatron.calibration"
CALIBRATION_VERSION = 1

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
IDENTITY_BLOCK = {"compute": 1.0, "compute_tensor_parallel": 1.0, "compute_ulysses": 1.0, "recompute": 1.0, "communication": 1.0}


# ---------------------------------------------------------------------------------------------- measurements
@dataclass(frozen=True)
class BlockTiming:
    """One block on one rank: median seconds of a forward and of a backward call, calls per step."""

    index: int
    forward_s: float
    backward_s: float
    calls_per_step: float
    parameter_tensors: int = 0

    @property
    def call_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Observation:
    """What one rank measured over a few steps of ``plan`` (medians per step).

    Attributes:
        step_s: one training step, start to start.
        forward_backward_s: from the start of the step to the start of the optimizer step.
        optimizer_s: the optimizer step.
        optimizer_tensors, optimizer_elements: parameter tensors and elements the rank's optimizer updates.
        optimizer_dtensors: how many of those tensors are DTensors (sharded or tensor-parallel), whose
            every update goes through DTensor's dispatch.
        blocks: the rank's blocks.
        compute_slots: ranks of a node that can compute at full speed at once (CPU cores available to the
            processes of a node); ``None`` when every rank has a device of its own (GPUs).
    """

    plan: ParallelPlan
    rank: int
    step_s: float
    forward_backward_s: float
    optimizer_s: float
    optimizer_tensors: int
    optimizer_elements: int
    blocks: tuple[BlockTiming, ...] = ()
    optimizer_dtensors: int = 0
    compute_slots: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["plan"] = self.plan.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Observation:
        kwargs = dict(data)
        kwargs["plan"] = ParallelPlan.from_dict(kwargs["plan"])
        kwargs["blocks"] = tuple(BlockTiming(**b) for b in kwargs.get("blocks", ()))
        return cls(**kwargs)


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
        pipeline_overhead_s: per micro-batch and stage of a pipeline.
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
    compute_slots_per_node: int | None = None
    observations: int = 0
    residual: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.block) - set(BLOCK_TERMS)
        if unknown:
            raise ValueError(f"unknown block terms {sorted(unknown)}; known: {BLOCK_TERMS}")
        for name, value in [*self.block.items(), *((f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.type == "float" or (f.type == "float | None" and getattr(self, f.name) is not None))]:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"calibration term {name} must be a finite number >= 0, got {value!r}")
        object.__setattr__(self, "block", dict(self.block))
        object.__setattr__(self, "tensors_per_layer_type", dict(self.tensors_per_layer_type))

    @property
    def coefficients(self) -> np.ndarray:
        """Block coefficients in the order of :data:`BLOCK_TERMS`."""
        return np.array([self.block.get(t, IDENTITY_BLOCK.get(t, 0.0)) for t in BLOCK_TERMS])

    def sharing_factor(self, pp: int, micro_batches: int, ranks_per_node: int) -> float:
        """Time of a pipeline stage's work relative to the same work with every rank busy.

        When the ranks of a node share fewer compute slots (cores) than they are, a rank computes at
        ``min(1, slots / busy)`` of a slot's speed. The block terms are fitted (and apply) with every rank
        busy; a pipeline keeps a stage busy only ``U = m / (m + pp - 1)`` of its step (fill and drain), so
        on average ``ranks * U`` ranks compute at once and each runs faster by
        ``min(1, slots / ranks) / min(1, slots / (ranks * U))``. 1 without a pipeline or without sharing.
        """
        slots = self.compute_slots_per_node
        if pp <= 1 or slots is None or slots >= ranks_per_node:
            return 1.0
        busy = ranks_per_node * micro_batches / (micro_batches + pp - 1)
        return min(1.0, slots / ranks_per_node) / min(1.0, slots / busy)

    @property
    def optimizer_s_per_dtensor_or_tensor(self) -> float:
        return self.optimizer_s_per_tensor if self.optimizer_s_per_dtensor is None else self.optimizer_s_per_dtensor

    def optimizer_time(self, tensors: Any, elements: Any, dtensors: Any = False) -> Any:
        """The optimizer step for ``tensors`` parameter tensors of ``elements`` elements (``dtensors``: DTensors)."""
        per_tensor = np.where(dtensors, self.optimizer_s_per_dtensor_or_tensor, self.optimizer_s_per_tensor)
        return per_tensor * tensors + self.optimizer_s_per_element * elements

    def describe(self) -> str:
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        b = {t: self.block.get(t, IDENTITY_BLOCK.get(t, 0.0)) for t in BLOCK_TERMS}
        return (
            f"compute x{b['compute']:.2f} (Megatron TP x{b['compute_tensor_parallel']:.2f}, Ulysses x{b['compute_ulysses']:.2f}), recompute replay x{b['recompute']:.2f} forwards, communication x{b['communication']:.2f}; "
            f"per block call {ms(b['call'])} (+ZeRO-2 {ms(b['zero2'])}, +ZeRO-3 {ms(b['zero3'])}, +TP {ms(b['tensor_parallel'])}, "
            f"+Megatron-SP {ms(b['megatron_sp'])}, +Ulysses {ms(b['ulysses'])}, +recompute {ms(b['recompute_call'])}); "
            f"embedding/head x{self.vocab_compute:.2f} + {ms(self.vocab_call_s)} per micro-batch; optimizer "
            f"{self.optimizer_s_per_tensor * 1e6:.0f} us/tensor ({self.optimizer_s_per_dtensor_or_tensor * 1e6:.0f} "
            f"us/DTensor) + {self.optimizer_s_per_element * 1e9:.1f} ns/element; "
            f"step {ms(self.step_overhead_s)}, pipeline {ms(self.pipeline_overhead_s)} per micro-batch and stage"
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
            raise ValueError(f"calibration version {data['version']} is newer than this lightning_galvatron understands")
        kwargs = {k: v for k, v in data.items() if k not in ("format", "version")}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown calibration keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        data = read_json_object(path, "calibration file")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"calibration file {str(path)!r}: {err}") from None


def load_calibration(source: Calibration | Mapping[str, Any] | str | os.PathLike | None) -> Calibration | None:
    if source is None or isinstance(source, Calibration):
        return source
    if isinstance(source, Mapping):
        return Calibration.from_dict(source)
    return Calibration.load(source)


# ---------------------------------------------------------------------------------------------- features
def block_features(
    forward: np.ndarray, backward_to_forward: float, analytic_time: np.ndarray, sa: Any
) -> np.ndarray:
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


def vocab_time(calibration: Calibration, compute: np.ndarray, analytic_time: np.ndarray, sa: Any) -> np.ndarray:
    """Calibrated time of the embedding or the head per micro-batch (half of the fixed time each)."""
    compute = np.asarray(compute, dtype=float)
    communication = np.maximum(np.asarray(analytic_time, dtype=float) - compute, 0.0)
    b = calibration.block
    mechanisms = (
        (sa.dp_code == 1) * b.get("zero2", 0.0)
        + (sa.dp_code == 2) * b.get("zero3", 0.0)
        + np.asarray(sa.splits_weights, dtype=float) * b.get("tensor_parallel", 0.0)
    )
    return calibration.vocab_compute * compute + calibration.vocab_communication * communication + 0.5 * (calibration.vocab_call_s + mechanisms)


# ---------------------------------------------------------------------------------------------- fitting
def nonnegative_least_squares(a: np.ndarray, y: np.ndarray, max_iterations: int = 200) -> np.ndarray:
    """``argmin ||a x - y||`` subject to ``x >= 0`` (Lawson and Hanson's active-set method)."""
    a = np.asarray(a, dtype=float)
    y = np.asarray(y, dtype=float)
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tolerance = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0)) * float(np.abs(y).max(initial=0.0)))
    for _ in range(max_iterations):
        w = a.T @ (y - a @ x)
        if passive.all() or (w[~passive] <= tolerance).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            negative = passive & (z <= 0)
            step = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + step * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x


def fit_calibration(
    profile: Profile,
    observations: Sequence[Observation],
    *,
    precision: str = "bf16-mixed",
    optimizer: str | float = "adamw",
    source: str = "",
) -> Calibration:
    """Fit a :class:`Calibration` to what the runtime profiler measured (any plans, any ranks).

    Block terms: non-negative least squares over every measured block call, each weighted by the inverse
    of its time (relative errors count). Embedding/head: from plans without a pipeline, the forward and
    backward time outside the blocks per micro-batch, against the modelled compute. Optimizer: per tensor
    and element, over the ranks. Step and pipeline overheads: what the measured steps have beyond the
    calibrated prediction (medians), the pipeline's per micro-batch and stage.
    """
    from lightning_galvatron.search.cost import CostModel

    if not observations:
        raise ValueError("fit_calibration needs at least one observation")
    cm = CostModel(profile, precision, optimizer)
    model = profile.model
    rows, targets = [], []
    tensors: dict[str, list[int]] = {}
    slots = [o.compute_slots for o in observations if o.compute_slots is not None]
    sharing = Calibration(compute_slots_per_node=int(statistics.median(slots)) if slots else None)
    ranks_per_node = min(profile.hardware.devices_per_node, observations[0].plan.world_size)
    for obs in observations:
        parts = _analytic_parts(cm, obs.plan)
        # Block terms hold with every rank busy: a pipeline's measurements are brought to that first.
        busy = sharing.sharing_factor(obs.plan.pp, obs.plan.micro_batches, min(ranks_per_node, obs.plan.world_size))
        for timing in obs.blocks:
            forward, beta, analytic, relocation, strategy = parts.blocks[timing.index]
            features = block_features(np.array([forward]), beta, np.array([analytic]), _arrays([strategy]))[0]
            rows.append(features)
            targets.append(max(timing.call_s / busy - relocation, 0.0))
            if timing.parameter_tensors:
                tensors.setdefault(model.block_type(timing.index).name, []).append(timing.parameter_tensors)
    a, y = np.array(rows), np.array(targets)
    weights = 1.0 / np.sqrt(np.maximum(y, 1e-6))
    coefficients = nonnegative_least_squares(a * weights[:, None], y * weights)
    residual = float(np.sqrt(np.mean(((a @ coefficients - y) * weights) ** 2))) if len(y) else 0.0
    block = {t: float(c) for t, c in zip(BLOCK_TERMS, coefficients)}
    tensors_per_type = {name: int(statistics.median(v)) for name, v in tensors.items()}

    # Embedding and head: per micro-batch, what the forward and backward spend outside the blocks.
    vocab_rows, vocab_targets = [], []
    for obs in observations:
        if obs.plan.pp != 1 or not obs.blocks or obs.forward_backward_s <= 0:
            continue
        parts = _analytic_parts(cm, obs.plan)
        m = obs.plan.micro_batches
        outside = obs.forward_backward_s - sum(t.call_s * t.calls_per_step for t in obs.blocks)
        vocab_rows.append(parts.vocab_compute)
        vocab_targets.append(max(outside / m - parts.vocab_communication, 0.0))
    vocab_compute, vocab_call = 1.0, 0.0
    if vocab_rows:
        av = np.stack([np.array(vocab_rows), np.ones(len(vocab_rows))], axis=1)
        yv = np.array(vocab_targets)
        wv = 1.0 / np.maximum(yv, 1e-6)
        vocab_compute, vocab_call = (float(x) for x in nonnegative_least_squares(av * wv[:, None], yv * wv))

    # Optimizer: seconds per plain tensor, per DTensor and per element, over every rank.
    measured = [o for o in observations if o.optimizer_s > 0 and o.optimizer_tensors > 0]
    per_tensor = per_element = 0.0
    per_dtensor = None
    if measured:
        ao = np.array([[o.optimizer_tensors - o.optimizer_dtensors, o.optimizer_dtensors, o.optimizer_elements] for o in measured], dtype=float)
        yo = np.array([o.optimizer_s for o in measured])
        wo = 1.0 / yo
        per_tensor, per_dtensor, per_element = (float(x) for x in nonnegative_least_squares(ao * wo[:, None], yo * wo))
        if not ao[:, 0].any():  # only DTensors were seen: plain tensors cost no more than them
            per_tensor = per_dtensor
        if not ao[:, 1].any():
            per_dtensor = None
    block_tensors = {
        obs.rank: sum(t.parameter_tensors for t in obs.blocks) for obs in observations if obs.plan.pp == 1 and obs.blocks
    }
    vocab_tensors = [o.optimizer_tensors - block_tensors[o.rank] for o in observations if o.plan.pp == 1 and o.rank in block_tensors]
    calibration = Calibration(
        block=block,
        vocab_compute=vocab_compute,
        vocab_call_s=vocab_call,
        optimizer_s_per_tensor=per_tensor,
        optimizer_s_per_element=per_element,
        optimizer_s_per_dtensor=per_dtensor,
        tensors_per_layer_type=tensors_per_type,
        vocab_tensors=max(int(statistics.median(vocab_tensors)), 0) if vocab_tensors else 0,
        compute_slots_per_node=sharing.compute_slots_per_node,
        observations=len(y),
        residual=residual,
        source=source,
    )

    # The training loop around the forward, backward and optimizer step: measured directly.
    outside = [o.step_s - o.forward_backward_s - o.optimizer_s for o in observations if o.forward_backward_s > 0]
    step_overhead = max(statistics.median(outside), 0.0) if outside else 0.0
    # A pipeline's own work: its measured forward and backward beyond the schedule's time over the stage
    # times built from the measured blocks (the embedding/head and transfers as calibrated and modelled).
    residuals = []
    by_plan: dict[ParallelPlan, list[Observation]] = {}
    for obs in observations:
        if obs.plan.pp > 1 and obs.blocks and obs.forward_backward_s > 0:
            by_plan.setdefault(obs.plan, []).append(obs)
    calibrated = CostModel(profile, precision, optimizer, calibration)
    for plan, group in by_plan.items():
        stage_times = _measured_stage_times(calibrated, plan, group)
        if stage_times is None:
            continue
        from lightning_galvatron.search.pipeline import pipeline_step_time

        schedule = float(pipeline_step_time(np.array(stage_times), plan.micro_batches, plan.virtual_stages))
        measured = statistics.median(o.forward_backward_s for o in group)
        residuals.append((measured - schedule) / (plan.pp + plan.micro_batches - 1))
    pipeline_overhead = max(statistics.median(residuals), 0.0) if residuals else 0.0
    return dataclasses.replace(calibration, step_overhead_s=step_overhead, pipeline_overhead_s=pipeline_overhead)


def _measured_stage_times(cm: Any, plan: ParallelPlan, group: Sequence[Observation]) -> list[float] | None:
    """Per stage, time per micro-batch: its measured blocks (median over its ranks), the calibrated
    embedding/head on the end stages and the modelled transfers."""
    from lightning_galvatron.search.cost import StageContext, vocab_costs
    from lightning_galvatron.search.pipeline import p2p_transfers

    n = plan.devices_per_stage
    per_stage: dict[int, list[float]] = {}
    for obs in group:
        per_stage.setdefault(obs.rank // n, []).append(sum(t.call_s * t.calls_per_step for t in obs.blocks) / plan.micro_batches)
    if len(per_stage) != plan.pp:
        return None
    ctx = StageContext(plan.world_size, plan.pp, plan.global_batch_size, plan.micro_batches)
    vsa = _arrays([plan.vocab])
    model = cm.profile.model
    out = []
    for stage in range(plan.pp):
        time = statistics.median(per_stage[stage])
        if stage == 0:
            time += float(vocab_costs(cm, vsa, ctx, "embedding").time[0])
        if stage == plan.pp - 1:
            time += float(vocab_costs(cm, vsa, ctx, "head").time[0])
        time += p2p_transfers(plan.pp, stage, plan.virtual_stages) * cm.p2p_time(ctx, model.hidden_size, model.seq_length)
        out.append(time)
    return out


@dataclass
class _Parts:
    blocks: dict[int, tuple[float, float, float, float, LayerStrategy]]  # forward, beta, analytic, relocation, strategy
    vocab_compute: float  # embedding + head compute (forward and backward) per micro-batch
    vocab_communication: float


def _arrays(strategies: Sequence[LayerStrategy]) -> Any:
    from lightning_galvatron.search.space import StrategyArrays

    return StrategyArrays.build(strategies)


def _analytic_parts(cm: Any, plan: ParallelPlan) -> _Parts:
    """The uncalibrated model's pieces of ``plan`` that the fit compares measurements with."""
    from lightning_galvatron.search.cost import (
        StageContext,
        block_costs,
        forward_compute_time,
        local_micro_batch,
        relocation_time,
        vocab_costs,
    )
    from lightning_galvatron.search.space import layout_of

    model = cm.profile.model
    B = plan.global_batch_size
    if B is None:
        raise ValueError("an observed plan must fix its global batch size")
    W, pp, m = plan.world_size, plan.pp, plan.micro_batches
    ctx = StageContext(W, pp, B, m)
    n = plan.devices_per_stage
    blocks = {}
    for chunk in range(pp * plan.virtual_stages):
        previous = None
        for i in plan.chunk_layers(chunk):
            s = plan.layers[i]
            lt = model.block_type(i)
            sa = _arrays([s])
            b = local_micro_batch(ctx, np.array([n // s.tp]))
            forward = float(forward_compute_time(lt.forward_time, b, sa.tp)[0])
            analytic = float(block_costs(cm, lt, sa, ctx).time[0])
            move = 0.0
            if previous is not None:
                move = relocation_time(cm, layout_of(previous, n), layout_of(s, n), ctx, lt.hidden_size, lt.seq_length)
            blocks[i] = (forward, lt.backward_to_forward, analytic, move, s)
            previous = s
    vocab = model.vocab
    vsa = _arrays([plan.vocab])
    b = local_micro_batch(ctx, np.array([n // plan.vocab.tp]))
    compute = sum(
        (1.0 + vocab.backward_to_forward) * float(forward_compute_time(fit, b, vsa.tp)[0])
        for fit in (vocab.embedding_forward_time, vocab.head_forward_time)
    )
    analytic = sum(float(vocab_costs(cm, vsa, ctx, part).time[0]) for part in ("embedding", "head"))
    return _Parts(blocks, compute, max(analytic - compute, 0.0))


__all__ = [
    "BLOCK_TERMS",
    "BlockTiming",
    "Calibration",
    "Observation",
    "block_features",
    "fit_calibration",
    "load_calibration",
    "nonnegative_least_squares",
    "vocab_time",
]
