"""Calibration of the cost model from measured training steps: the fit.

What the calibrated model adds to the profile's prices, and the :class:`~.coefficients.Calibration`
holding it, are described in :mod:`lightning_galvatron.search.coefficients`. Here: what was measured
(:class:`Observation` per rank, of any plans -- :class:`~lightning_galvatron.profiler.runtime.RuntimeProfiler`
records them) and :func:`fit_calibration`, which inverts the cost model on those measurements: block
terms by non-negative least squares over every measured block call, the embedding/head, the optimizer,
and the step's and the pipeline's own overheads.

This module is torch-free (numpy only), like the rest of the search.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lightning_galvatron.plan import LayerStrategy, ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search.coefficients import (
    BLOCK_TERMS,
    CALIBRATION_FORMAT,
    CALIBRATION_VERSION,
    IDENTITY_BLOCK,
    Calibration,
    block_features,
    load_calibration,
    vocab_time,
)
from lightning_galvatron.search.cost import (
    CostModel,
    StageContext,
    block_costs,
    ddp_reduced,
    forward_compute_time,
    local_micro_batch,
    relocation_time,
    vocab_costs,
)
from lightning_galvatron.search.pipeline import p2p_transfers, schedule_overhead, step_span
from lightning_galvatron.search.space import StrategyArrays, layout_of


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


# ---------------------------------------------------------------------------------------------- fitting
def nonnegative_least_squares(
    a: NDArray[np.float64], y: NDArray[np.float64], max_iterations: int = 200
) -> NDArray[np.float64]:
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
    prior: Calibration | None = None,
) -> Calibration:
    """Fit a :class:`Calibration` to what the runtime profiler measured (any plans, any ranks).

    Block terms: non-negative least squares over every measured block call, each weighted by the inverse
    of its time (relative errors count). Embedding/head: from plans without a pipeline, the forward and
    backward time outside the blocks per micro-batch, against the modelled compute, with the DDP reduction per
    step and reduced block (the wait for it is outside the blocks too). Optimizer: per tensor
    and element, over the ranks. Step and pipeline overheads: what the measured steps have beyond the
    calibrated prediction (medians), the pipeline's per micro-batch and model chunk.

    ``prior`` (the profile's own calibration, :func:`~.overheads.profile_calibration`) is what the
    observations cannot tell: a few trials of one batch size leave compute and per-call terms
    interchangeable, and a mechanism no observed plan used has no column at all. Each block term is pulled
    towards the prior's with the weight of :data:`PRIOR_WEIGHT` of an observation, which decides such
    terms and moves the others little; the optimizer terms are the prior's when nothing measured them.
    """
    if not observations:
        raise ValueError("fit_calibration needs at least one observation")
    cm = CostModel(profile, precision, optimizer)
    model = profile.model
    rows: list[NDArray[np.float64]] = []
    calls: list[float] = []
    relocation_list: list[float] = []
    busy: list[float] = []
    tensors: dict[str, list[int]] = {}
    slots = [o.compute_slots for o in observations if o.compute_slots is not None]
    shared = Calibration(compute_slots_per_node=int(statistics.median(slots)) if slots else None)
    ranks_per_node = min(profile.hardware.devices_per_node, observations[0].plan.world_size)
    for obs in observations:
        parts = _analytic_parts(cm, obs.plan)
        factor = shared.sharing_factor(
            obs.plan.pp, obs.plan.micro_batches, min(ranks_per_node, obs.plan.world_size), obs.plan.virtual_stages
        )
        for timing in obs.blocks:
            forward, beta, analytic, relocation, strategy = parts.blocks[timing.index]
            rows.append(block_features(np.array([forward]), beta, np.array([analytic]), _arrays([strategy]))[0])
            calls.append(timing.call_s)
            relocation_list.append(relocation)
            busy.append(factor)
            if timing.parameter_tensors:
                tensors.setdefault(model.block_type(timing.index).name, []).append(timing.parameter_tensors)
    a, measured_calls, relocations = np.array(rows), np.array(calls), np.array(relocation_list)
    prior_block = None if prior is None else prior.coefficients

    def block_fit(factors: NDArray[np.float64]) -> tuple[NDArray[np.float64], float, float]:
        """Block terms with every rank busy (a pipeline's calls brought to that by ``factors`` first), their
        weighted residual, and their relative misfit of the calls as measured."""
        y = np.maximum(measured_calls / factors - relocations, 0.0)
        weights = 1.0 / np.sqrt(np.maximum(y, 1e-6))
        coefficients = nonnegative_least_squares(*_with_prior(a * weights[:, None], y * weights, prior_block))
        residual = float(np.sqrt(np.mean(((a @ coefficients - y) * weights) ** 2))) if len(y) else 0.0
        predicted = (a @ coefficients + relocations) * factors
        misfit = float(np.mean(((predicted - measured_calls) / np.maximum(measured_calls, 1e-9)) ** 2))
        return coefficients, residual, misfit

    # Whether a pipeline's waiting stages leave their cores to the busy ones (Calibration.sharing_factor): the
    # trials' own block calls tell. Where waiting ranks keep their cores (on 4 processes sharing 2 cores, the calls
    # of pipeline stages measured as slow as without a pipeline), assuming they do priced pipelines 10-30% fast.
    coefficients, residual, misfit = block_fit(np.array(busy))
    sharing = shared
    if shared.compute_slots_per_node is not None and any(f != 1.0 for f in busy):
        alone = block_fit(np.ones(len(busy)))
        if alone[2] < misfit:
            (coefficients, residual, _), sharing = alone, Calibration()
    block = {t: float(c) for t, c in zip(BLOCK_TERMS, coefficients)}
    tensors_per_type = {name: int(statistics.median(v)) for name, v in tensors.items()}

    # Embedding and head: per micro-batch, what the forward and backward spend outside the blocks; with it, per
    # step, the DDP reduction the backward leaves exposed (its wait comes after the first block's backward).
    vocab_rows, vocab_targets, reduced = [], [], []
    for obs in observations:
        if obs.plan.pp != 1 or not obs.blocks or obs.forward_backward_s <= 0:
            continue
        parts = _analytic_parts(cm, obs.plan)
        m = obs.plan.micro_batches
        outside = obs.forward_backward_s - sum(t.call_s * t.calls_per_step for t in obs.blocks)
        vocab_rows.append(parts.vocab_compute)
        vocab_targets.append(max(outside / m - parts.vocab_communication, 0.0))
        reduced.append(parts.reduced_blocks[0] / m)
    fixed = {"compute": 1.0, "call": 0.0, "reduction": 0.0}
    if prior is not None:
        fixed = {"compute": prior.vocab_compute, "call": prior.vocab_call_s, "reduction": prior.ddp_reduction_s}
    vocab_compute, vocab_call, reduction = fixed.values()
    if vocab_rows:
        columns = {"compute": np.array(vocab_rows), "call": np.ones(len(vocab_rows)), "reduction": np.array(reduced)}
        yv = np.array(vocab_targets)
        wv = 1.0 / np.maximum(yv, 1e-6)
        # Micro-batches of different sizes tell the compute from the per-call time, and plans that differ in the
        # blocks DDP reduces per micro-batch tell the reduction: those are fitted to the data alone; what they
        # cannot tell stays the prior's (fitted anyway, a plan of 4 micro-batches paid the head's time 4 times and
        # was priced 1.6-1.9x too slow).
        spread = {
            name: column.max() > 0 and column.max() >= VOCAB_SPREAD * column.min() for name, column in columns.items()
        }
        free = ["compute", *(["call"] if spread["compute"] else []), *(["reduction"] if spread["reduction"] else [])]
        rest = yv - sum(fixed[name] * column for name, column in columns.items() if name not in free)
        a = np.stack([columns[name] for name in free], axis=1)
        fitted = nonnegative_least_squares(a * wv[:, None], np.maximum(rest, 0.0) * wv)
        values = {**fixed, **{name: float(x) for name, x in zip(free, fitted)}}
        vocab_compute, vocab_call, reduction = values["compute"], values["call"], values["reduction"]

    # Optimizer: seconds per plain tensor, per DTensor and per element, over every rank.
    measured = [o for o in observations if o.optimizer_s > 0 and o.optimizer_tensors > 0]
    per_tensor = per_element = 0.0
    per_dtensor = None
    if prior is not None:
        per_tensor, per_element = prior.optimizer_s_per_tensor, prior.optimizer_s_per_element
        per_dtensor = prior.optimizer_s_per_dtensor
    if measured:
        ao = np.array(
            [
                [o.optimizer_tensors - o.optimizer_dtensors, o.optimizer_dtensors, o.optimizer_elements]
                for o in measured
            ],
            dtype=float,
        )
        yo = np.array([o.optimizer_s for o in measured])
        wo = 1.0 / yo
        per_tensor, per_dtensor, per_element = (float(x) for x in nonnegative_least_squares(ao * wo[:, None], yo * wo))
        if not ao[:, 0].any():  # only DTensors were seen: plain tensors cost no more than them
            per_tensor = per_dtensor
        if not ao[:, 1].any():
            per_dtensor = None
    block_tensors = {
        obs.rank: sum(t.parameter_tensors for t in obs.blocks)
        for obs in observations
        if obs.plan.pp == 1 and obs.blocks
    }
    vocab_tensors = [
        o.optimizer_tensors - block_tensors[o.rank] for o in observations if o.plan.pp == 1 and o.rank in block_tensors
    ]
    calibration = Calibration(
        block=block,
        vocab_compute=vocab_compute,
        vocab_call_s=vocab_call,
        ddp_reduction_s=reduction,
        optimizer_s_per_tensor=per_tensor,
        optimizer_s_per_element=per_element,
        optimizer_s_per_dtensor=per_dtensor,
        tensors_per_layer_type=tensors_per_type,
        vocab_tensors=max(int(statistics.median(vocab_tensors)), 0) if vocab_tensors else 0,
        compute_slots_per_node=sharing.compute_slots_per_node,
        observations=len(measured_calls),
        residual=residual,
        source=source,
    )

    # The training loop around the forward, backward and optimizer step: measured directly.
    loop = [o.step_s - o.forward_backward_s - o.optimizer_s for o in observations if o.forward_backward_s > 0]
    step_overhead = max(statistics.median(loop), 0.0) if loop else 0.0
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
        measured_s = statistics.median(o.forward_backward_s for o in group)
        residuals.append(schedule_overhead(measured_s, np.array(stage_times), plan.micro_batches, plan.virtual_stages))
    pipeline_overhead = max(statistics.median(residuals), 0.0) if residuals else 0.0
    return dataclasses.replace(calibration, step_overhead_s=step_overhead, pipeline_overhead_s=pipeline_overhead)


#: How much one prior term weighs in the block fit, as a fraction of one (weighted) observation.
PRIOR_WEIGHT = 0.1

#: The embedding/head's modelled compute must differ this much between observed plans (their micro-batches in
#: size) before the fit splits its time between compute and a per-call term.
VOCAB_SPREAD = 1.5


def _with_prior(
    a: NDArray[np.float64], y: NDArray[np.float64], prior: NDArray[np.float64] | None
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The weighted system ``a x = y`` with a row per term pulling it towards ``prior``'s value.

    A term's row is scaled by its column's typical weighted value (the mean over the observations that use it),
    so that the prior counts as :data:`PRIOR_WEIGHT` of an observation for every term alike; a term no
    observation uses takes the typical scale of the others, and the prior alone decides it.
    """
    if prior is None or not len(y):
        return a, y
    used = np.abs(a) > 0
    counts = used.sum(axis=0)
    scale = np.where(counts > 0, np.abs(a).sum(axis=0) / np.maximum(counts, 1), 0.0)
    typical = float(np.median(scale[counts > 0])) if (counts > 0).any() else 1.0
    scale = np.where(counts > 0, scale, typical) * PRIOR_WEIGHT
    return np.vstack([a, np.diag(scale)]), np.concatenate([y, scale * prior])


def _measured_stage_times(cm: CostModel, plan: ParallelPlan, group: Sequence[Observation]) -> list[float] | None:
    """Per stage, time per micro-batch: its measured blocks (median over its ranks), the calibrated
    embedding/head on the end stages, the calibrated DDP reduction (per step, carried per micro-batch as
    :func:`~.estimate.evaluate` carries it: :func:`~.pipeline.step_span`) and the modelled transfers."""
    n = plan.devices_per_stage
    per_stage: dict[int, list[float]] = {}
    for obs in group:
        per_stage.setdefault(obs.rank // n, []).append(
            sum(t.call_s * t.calls_per_step for t in obs.blocks) / plan.micro_batches
        )
    if len(per_stage) != plan.pp:
        return None
    ctx = StageContext(plan.world_size, plan.pp, _global_batch(plan), plan.micro_batches, 1.0, plan.virtual_stages)
    vsa = _arrays([plan.vocab])
    model = cm.profile.model
    reduction = cm.calibration.ddp_reduction_s if cm.calibration is not None else 0.0
    reduced = _reduced_blocks(plan)
    span = step_span(plan.pp, plan.micro_batches, plan.virtual_stages)
    out = []
    for stage in range(plan.pp):
        time = statistics.median(per_stage[stage]) + reduction * reduced[stage] / span
        if stage == 0:
            time += float(vocab_costs(cm, vsa, ctx, "embedding").time[0])
        if stage == plan.pp - 1:
            time += float(vocab_costs(cm, vsa, ctx, "head").time[0])
        time += p2p_transfers(plan.pp, stage, plan.virtual_stages) * cm.p2p_time(
            ctx, model.hidden_size, model.seq_length
        )
        out.append(time)
    return out


@dataclass
class _Parts:
    blocks: dict[int, tuple[float, float, float, float, LayerStrategy]]  # forward, beta, analytic, relocation, strategy
    vocab_compute: float  # embedding + head compute (forward and backward) per micro-batch
    vocab_communication: float
    reduced_blocks: list[int]  # per stage: blocks whose gradients DDP sums over replicas


def _global_batch(plan: ParallelPlan) -> int:
    if plan.global_batch_size is None:
        raise ValueError("an observed plan must fix its global batch size")
    return plan.global_batch_size


def _arrays(strategies: Sequence[LayerStrategy]) -> StrategyArrays:
    return StrategyArrays.build(strategies)


def _analytic_parts(cm: CostModel, plan: ParallelPlan) -> _Parts:
    """The uncalibrated model's pieces of ``plan`` that the fit compares measurements with."""
    model = cm.profile.model
    B = _global_batch(plan)
    W, pp, m = plan.world_size, plan.pp, plan.micro_batches
    ctx = StageContext(W, pp, B, m, 1.0, plan.virtual_stages)
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
    return _Parts(blocks, compute, max(analytic - compute, 0.0), _reduced_blocks(plan))


def _reduced_blocks(plan: ParallelPlan) -> list[int]:
    """Per stage: the blocks whose gradients DDP sums over replicas."""
    n = plan.devices_per_stage
    return [int(ddp_reduced(_arrays([plan.layers[i] for i in plan.stage_layers(s)]), n).sum()) for s in range(plan.pp)]


__all__ = [  # the coefficients are re-exported: this is where calibrations have always been imported from
    "BLOCK_TERMS",
    "CALIBRATION_FORMAT",
    "CALIBRATION_VERSION",
    "IDENTITY_BLOCK",
    "BlockTiming",
    "Calibration",
    "Observation",
    "block_features",
    "fit_calibration",
    "load_calibration",
    "nonnegative_least_squares",
    "vocab_time",
]
