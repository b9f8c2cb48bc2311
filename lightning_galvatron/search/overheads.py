"""The calibration a profile carries: per-call terms from the overheads measured with it.

A :class:`~.coefficients.Calibration` fitted from trials (:func:`~.calibration.fit_calibration`) needs
training steps of several plans. Most of what it corrects -- a fixed time per block call of each mechanism
(FSDP2, DTensor under tensor parallelism, recomputation), the optimizer's work per tensor, a pipeline schedule's
own work per micro-batch and model chunk, with the cores its waiting stages leave to the busy ones where processes
share cores, and the DDP reduction a backward leaves exposed -- the profiler measures directly
(:class:`~lightning_galvatron.profiles.Overheads`): :func:`profile_calibration` fits those terms to the probes the
same way, with compute and communication kept as the profile prices them (the compute at the speed one rank of
a node gets when all are busy: :func:`busy_compute_scale`).

:func:`applicable_calibration` is the one rule of which calibration prices a plan: an explicit one (a file,
or what measured selection fitted from its trials) wins; else the profile's; else none (the model alone).

Torch-free (numpy only), like the rest of the search.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from lightning_galvatron.plan import LayerStrategy
from lightning_galvatron.profiles import Overheads, Profile
from lightning_galvatron.search.calibration import nonnegative_least_squares
from lightning_galvatron.search.coefficients import (
    BLOCK_TERMS,
    IDENTITY_BLOCK,
    Calibration,
    block_features,
    load_calibration,
)
from lightning_galvatron.search.cost import CostModel, StageContext, block_costs, forward_compute_time
from lightning_galvatron.search.pipeline import p2p_transfers, schedule_overhead
from lightning_galvatron.search.space import StrategyArrays

#: The block terms the probes determine (compute and communication stay as the profile prices them).
CALL_TERMS = ("call", "zero2", "zero3", "tensor_parallel", "megatron_sp", "ulysses", "recompute_call")


def applicable_calibration(
    profile: Profile, calibration: Calibration | Mapping[str, Any] | str | os.PathLike[str] | None
) -> Calibration | None:
    """``calibration`` if given, else the profile's own (:func:`profile_calibration`), else ``None``."""
    explicit = load_calibration(calibration)
    return explicit if explicit is not None else profile_calibration(profile)


#: Profiles are immutable: each one's calibration is fitted once (``evaluate`` prices many plans with it, and the
#: fit costs about as much as pricing a plan). Keyed by identity; an entry goes when its profile does.
_FITTED: dict[int, tuple[weakref.ref[Profile], Calibration | None]] = {}


def profile_calibration(profile: Profile) -> Calibration | None:
    """A :class:`Calibration` from ``profile.overheads`` (``None`` without them); see :func:`_fit`."""
    key = id(profile)
    hit = _FITTED.get(key)
    if hit is not None and hit[0]() is profile:
        return hit[1]
    calibration = _fit(profile)

    def forget(_: weakref.ref[Profile]) -> None:
        _FITTED.pop(key, None)

    _FITTED[key] = (weakref.ref(profile, forget), calibration)
    return calibration


def _fit(profile: Profile) -> Calibration | None:
    """The profile's calibration, fitted to its measured overheads.

    Per block call: the probe's seconds less what the model prices for the same block, strategy, group and
    local batch (compute and communication), fitted to the per-call terms by non-negative least squares,
    relative errors counting. The compute is the profile's (measured on a core to itself) at the speed every rank
    computes with all busy: :func:`busy_compute_scale`. Optimizer: seconds per plain tensor, per DTensor and per
    element from its probes. Pipeline (where the profile has pipeline probes): the sharing of cores between
    stages and the schedule's own work (:func:`_schedule_overhead`). DDP (where it has reduction probes): what a
    backward leaves exposed per block (:func:`_ddp_reduction`). Step and per-call embedding/head overheads are not
    probed: 0.
    """
    overheads = profile.overheads
    if overheads is None:
        return None
    cm = CostModel(profile, profile.measured_precision or "32-true")
    model = profile.model
    rows, targets = [], []
    for probe in overheads.calls:
        layer = model.layer_types[probe.layer_type]
        s = probe.strategy
        replicas = probe.group_size // s.tp
        ctx = StageContext(probe.group_size, 1, probe.local_batch * replicas, 1)
        sa = StrategyArrays.build([s])
        forward = forward_compute_time(layer.forward_time, np.array([float(probe.local_batch)]), sa.tp)
        analytic = block_costs(cm, layer, sa, ctx).time
        rows.append(block_features(forward, layer.backward_to_forward, analytic, sa)[0])
        targets.append(probe.seconds)
    scale = busy_compute_scale(profile)
    block = {**IDENTITY_BLOCK, **{t: scale for t in COMPUTE_TERMS}}
    residual = 0.0
    if rows:
        a, y = np.array(rows), np.array(targets)
        modelled = np.array([block.get(t, 0.0) for t in BLOCK_TERMS])
        columns = [BLOCK_TERMS.index(t) for t in CALL_TERMS]
        weights = 1.0 / np.sqrt(np.maximum(y, 1e-6))
        rest = y - a @ modelled
        fitted = nonnegative_least_squares(a[:, columns] * weights[:, None], rest * weights)
        block.update({t: float(c) for t, c in zip(CALL_TERMS, fitted)})
        predicted = a[:, columns] @ fitted + a @ modelled
        residual = float(np.sqrt(np.mean(((predicted - y) / np.maximum(y, 1e-9)) ** 2)))

    per_tensor = per_element = 0.0
    per_dtensor = None
    if overheads.optimizer:
        ao = np.array(
            [[0 if o.dtensor else o.tensors, o.tensors if o.dtensor else 0, o.elements] for o in overheads.optimizer],
            dtype=float,
        )
        yo = np.array([o.seconds for o in overheads.optimizer])
        wo = 1.0 / np.maximum(yo, 1e-9)
        per_tensor, per_dtensor, per_element = (float(x) for x in nonnegative_least_squares(ao * wo[:, None], yo * wo))
        if not ao[:, 1].any():
            per_dtensor = None
    names = [t.name for t in model.layer_types]
    calibration = Calibration(
        block=block,
        vocab_compute=scale,  # the embedding and head compute on the same shared cores
        optimizer_s_per_tensor=per_tensor,
        optimizer_s_per_element=per_element,
        optimizer_s_per_dtensor=per_dtensor,
        tensors_per_layer_type=dict(zip(names, overheads.block_tensors)),
        vocab_tensors=overheads.vocab_tensors,
        ddp_reduction_s=_ddp_reduction(overheads),
        # The cores a pipeline's waiting stages leave to the busy ones (Calibration.sharing_factor) come with the
        # schedule's own work, which only a pipeline measures: both or neither. Alone, the sharing made pipelines
        # look twice as fast as they ran (4 processes on 2 cores).
        compute_slots_per_node=overheads.compute_slots if overheads.pipelines else None,
        observations=len(rows),
        residual=residual,
        source="the profile's measured overheads",
    )
    if not overheads.pipelines:
        return calibration
    return dataclasses.replace(calibration, pipeline_overhead_s=_schedule_overhead(profile, overheads, calibration))


#: The block terms that scale the profiled compute.
COMPUTE_TERMS = ("compute", "compute_tensor_parallel", "compute_ulysses", "recompute")


def busy_compute_scale(profile: Profile) -> float:
    """How much slower than the profile's compute fits every rank computes with all of a node's ranks busy: the
    fits time a block on a core to itself (their quiet end), and ``r`` ranks sharing ``c < r`` cores get ``c / r``
    of a core each (the premise of :meth:`~.coefficients.Calibration.sharing_factor` too); 1 on devices of their
    own. Not fitted: the probes time one batch size, where a slower compute and a time per call look the same, and
    a block probed at a quarter of it ran as if alone (calls shorter than the scheduler's slices of a core)."""
    overheads = profile.overheads
    slots = overheads.compute_slots if overheads is not None else None
    ranks = min(profile.hardware.devices_per_node, overheads.world_size) if overheads is not None else 1
    return max(ranks / slots, 1.0) if slots else 1.0


def _ddp_reduction(overheads: Overheads) -> float:
    """Per block and step, what the reduction probes' backward with DDP's gradient reduction took beyond the same
    without it: the median over the probes, >= 0; 0 without probes.

    Added to the model's own price of the reduction (its all-reduce, overlapped with backward), not in its place:
    on 4 processes sharing 2 cores that price alone matched the probe (4.6 against 4.0 ms per block) yet left
    uniform DDP 17% fast, and the sum priced it within 4% (``benchmarks/cost_model_accuracy.py``). The all-reduce
    that runs beside backward also takes the cores backward computes on, which the probe's difference does not
    show and the overlap's price does."""
    values = [(r.reduced_seconds - r.plain_seconds) / r.blocks for r in overheads.reductions]
    return max(float(np.median(values)), 0.0) if values else 0.0


def _schedule_overhead(profile: Profile, overheads: Overheads, calibration: Calibration) -> float:
    """What the pipeline probes (``overheads``, the profile's) took beyond the stage times ``calibration`` prices for
    them (their blocks, with the sharing of cores, and transfers), per micro-batch and model chunk: the median over
    the probes, >= 0."""
    cm = CostModel(profile, profile.measured_precision or "32-true", calibration=calibration)
    plain, residuals = StrategyArrays.build([LayerStrategy()]), []
    for probe in overheads.pipelines:
        layer = profile.model.layer_types[probe.layer_type]
        pp, m, v = probe.pp, probe.micro_batches, probe.virtual_stages
        replicas = overheads.world_size // pp
        ctx = StageContext(overheads.world_size, pp, probe.micro_batch * m * replicas, m, 1.0, v)
        block = float(block_costs(cm, layer, plain, ctx).time[0])
        transfer = cm.p2p_time(ctx, layer.hidden_size, layer.seq_length)
        stage_times = np.array(
            [v * probe.blocks_per_chunk * block + p2p_transfers(pp, stage, v) * transfer for stage in range(pp)]
        )
        residuals.append(schedule_overhead(probe.seconds, stage_times, m, v))
    return max(float(np.median(residuals)), 0.0)


__all__ = ["CALL_TERMS", "COMPUTE_TERMS", "applicable_calibration", "busy_compute_scale", "profile_calibration"]
