"""Cost model: time and memory of blocks, the embedding/head, relocations and pipeline transfers.

Every term is a named function; each takes numpy arrays over candidate strategies (a
:class:`~lightning_galvatron.search.space.StrategyArrays`) so the search prices all candidates in one
go, and the evaluator prices a given plan with the very same code.

Notation (see :mod:`.solver` for the full legend): a stage has ``n = W/pp`` devices; a block with model-parallel
group ``g`` has ``d = n/g`` data-parallel replicas; with global batch ``B`` and ``m`` micro-batches its local
micro-batch is ``b = B/(m*d)`` samples (shared by the ``g`` ranks of its group). Times are seconds,
memory bytes per device.

What a block costs per micro-batch (what the runtime executes):

* compute: forward ``f(b/g)`` from the profile's linear fit; backward ``beta * f``; recompute one
  more ``f``;
* TP/SP communication on the critical path: Megatron ``c`` all-reduces of ``b*s*h`` per forward and
  per backward (with sequence parallelism an all-gather plus a reduce-scatter each, same volume);
  Ulysses 4 all-to-alls of ``b*s*h/g`` per forward and per backward; recomputation repeats the
  forward ones;
* FSDP2 parameter all-gathers (ZeRO-3: forward and backward, ZeRO-2: forward), overlapped with
  compute;
* gradient reduction once per optimizer step (DDP all-reduce; ZeRO reduce-scatter), overlapped with
  the backward of the last micro-batch (calibrated, DDP adds what its backward leaves exposed). ZeRO reduces
  every micro-batch instead when its gradients stay sharded (see :func:`accumulates_unsharded_gradients`).

Overlap of ``x`` and ``y`` costs ``max(x, y) + (alpha - 1) * min(x, y)`` with the profile's overlap
coefficient ``alpha``.

With a :class:`~lightning_galvatron.search.coefficients.Calibration` (fitted from measured steps), a
block's time per micro-batch is the calibrated combination of these terms plus fixed costs per call of
each mechanism, the optimizer step is priced per parameter tensor and element, and a step and each
pipeline micro-batch add fixed overheads (see :mod:`.calibration`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from lightning_galvatron.plan.layout import p2p_ranks_per_node, ranks_per_node
from lightning_galvatron.profiles import LayerTypeProfile, LinearFit, Profile, bus_volume
from lightning_galvatron.search.coefficients import Calibration, block_features, load_calibration, vocab_time
from lightning_galvatron.search.space import Layout, StrategyArrays


# ---------------------------------------------------------------------------------------------- precision, optimizer
@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor.

    Attributes:
        param_bytes: parameters as the optimizer keeps them (fp32 master weights under mixed precision).
        grad_bytes: sharded or replicated gradients the optimizer reads.
        compute_bytes: activations, gathered parameters and TP messages.
        reduce_bytes: gradient communication and FSDP2's unsharded gradient accumulation
            (``MixedPrecisionPolicy(reduce_dtype=float32)`` under mixed precision).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    compute_bytes: int
    reduce_bytes: int


PRECISIONS = {
    "bf16-mixed": Precision("bf16-mixed", 4, 4, 2, 4),
    "16-mixed": Precision("16-mixed", 4, 4, 2, 4),
    "bf16-true": Precision("bf16-true", 2, 2, 2, 2),
    "16-true": Precision("16-true", 2, 2, 2, 2),
    "32-true": Precision("32-true", 4, 4, 4, 4),
}

# Optimizer states per parameter, kept in the parameter dtype (as torch.optim does).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}


def resolve_precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    aliases = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true", "fp32": "32-true"}
    key = aliases.get(str(precision), str(precision))
    if key not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {sorted(PRECISIONS)}")
    return PRECISIONS[key]


def optimizer_state_bytes(optimizer: str | float, precision: Precision) -> float:
    """Optimizer-state bytes per parameter: AdamW 2 states, SGD with momentum 1, plain SGD 0; or a number given as
    is."""
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ValueError(f"optimizer state bytes per parameter cannot be negative, got {optimizer}")
        return float(optimizer)
    key = str(optimizer).lower().replace("-", "_")
    if key not in OPTIMIZER_STATES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZER_STATES)} or give its state bytes per "
            "parameter"
        )
    return float(OPTIMIZER_STATES[key] * precision.param_bytes)


# ---------------------------------------------------------------------------------------------- context
@dataclass(frozen=True)
class StageContext:
    """What a block's cost depends on besides its own strategy."""

    world_size: int
    pp: int
    global_batch: int
    micro_batches: int
    in_flight: float = 1.0
    virtual_stages: int = 1  # model chunks per pipeline rank: how much of the step a stage is busy

    @property
    def devices_per_stage(self) -> int:
        return self.world_size // self.pp

    @property
    def samples_per_device(self) -> float:
        """Samples of one micro-batch per device of a stage: ``B / (m * n)``."""
        return self.global_batch / (self.micro_batches * self.devices_per_stage)


def accumulates_unsharded_gradients(pp: int, micro_batches: int) -> bool:
    """Whether ZeRO blocks keep unsharded gradients across the micro-batches of a step.

    The runtime lets FSDP2 reduce(-scatter) the gradients after every micro-batch's backward, with
    or without a pipeline (``PipelineStage`` does not wrap our FSDP modules, so it never switches
    gradient synchronisation off): gradients stay sharded and the reduction is paid ``m`` times.
    Kept as a function so that a runtime that accumulates unsharded gradients can say so here.
    """
    return False


def overlap_time(compute: NDArray[np.float64], comm: NDArray[np.float64], alpha: float) -> NDArray[np.float64]:
    """Time of computation and communication overlapped: ``max + (alpha - 1) * min``."""
    return np.maximum(compute, comm) + (alpha - 1.0) * np.minimum(compute, comm)


# ---------------------------------------------------------------------------------------------- the model
class CostModel:
    """A profile bound to a precision, an optimizer and optionally a calibration; collectives are looked up
    once and cached."""

    def __init__(
        self,
        profile: Profile,
        precision: str | Precision = "bf16-mixed",
        optimizer: str | float = "adamw",
        calibration: Calibration | str | None = None,
    ):
        self.profile = profile
        self.calibration = load_calibration(calibration)
        self.precision = resolve_precision(precision)
        self.optimizer_bytes = optimizer_state_bytes(optimizer, self.precision)
        self.alpha = profile.hardware.overlap_coefficient
        self.activation_scale = self.precision.compute_bytes / profile.model.activation_dtype_bytes
        self._fits: dict[tuple[str, int, int], tuple[float, float]] = {}

    # -------------------------------------------------------------------------------------- collectives
    def collective_time(
        self, kind: str, nbytes: float | NDArray[np.float64], group_size: int, stride: int, world_size: int
    ) -> NDArray[np.float64]:
        """Seconds for ``kind`` of ``nbytes`` (the unsharded tensor) over a group; 0 for a group of one."""
        if group_size <= 1:
            return np.zeros_like(np.asarray(nbytes, dtype=float))
        hw = self.profile.hardware
        k = ranks_per_node(group_size, stride, hw.devices_per_node, world_size)
        key = (kind, group_size, k)
        if key not in self._fits:
            fit = hw.collective(kind, group_size, k)
            # A fallback from all-reduce measures the same bus bandwidth; only the volume differs.
            self._fits[key] = (fit.latency_s, fit.bandwidth_bytes_per_s)
        latency, bandwidth = self._fits[key]
        return latency + bus_volume(kind, group_size) * np.asarray(nbytes, dtype=float) / bandwidth

    def collective_times(
        self,
        kind: str,
        nbytes: float | NDArray[np.float64],
        group_sizes: NDArray[np.int64],
        strides: NDArray[np.int64],
        world_size: int,
    ) -> NDArray[np.float64]:
        """:meth:`collective_time` per candidate (arrays of group sizes, strides and bytes)."""
        group_sizes = np.asarray(group_sizes)
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=float), group_sizes.shape)
        out = np.zeros(group_sizes.shape)
        for g, t in set(zip(group_sizes.tolist(), np.asarray(strides).tolist())):
            if g > 1:
                mask = (group_sizes == g) & (strides == t)
                out[mask] = self.collective_time(kind, nbytes[mask], g, t, world_size)
        return out

    def step_overhead(self) -> float:
        """Fixed time per training step (calibrated; 0 without a calibration)."""
        return self.calibration.step_overhead_s if self.calibration is not None else 0.0

    def pipeline_overhead(self, pp: int, virtual_stages: int = 1) -> float:
        """Fixed time per micro-batch a pipeline stage spends besides its blocks and transfers (calibrated): the
        schedule's own work, once per model chunk the stage runs."""
        if self.calibration is None or pp == 1:
            return 0.0
        return self.calibration.pipeline_overhead_s * virtual_stages

    def p2p_time(self, ctx: StageContext, hidden: int, seq: int) -> float:
        """One stage-to-stage transfer of a micro-batch's activations (each device sends its share)."""
        if ctx.pp == 1:
            return 0.0
        hw = self.profile.hardware
        fit = hw.collective("p2p", ctx.pp, p2p_ranks_per_node(ctx.world_size, ctx.pp, hw.devices_per_node))
        nbytes = ctx.samples_per_device * seq * hidden * self.precision.compute_bytes
        if fit.kind == "p2p":
            return fit.latency_s + nbytes / fit.bandwidth_bytes_per_s
        return float(fit.time(nbytes, 2))


# ---------------------------------------------------------------------------------------------- terms
def local_micro_batch(ctx: StageContext, dp: NDArray[np.int64]) -> NDArray[np.float64]:
    """Samples of a micro-batch each data-parallel replica processes: ``B / (m * d)``."""
    return ctx.global_batch / (ctx.micro_batches * np.asarray(dp, dtype=float))


def forward_compute_time(
    fit: LinearFit, local_batch: NDArray[np.float64], group: NDArray[np.int64]
) -> NDArray[np.float64]:
    """Forward time of one device: the group splits the work of ``b`` samples ``g`` ways: ``f(b/g)``."""
    forward: NDArray[np.float64] = fit(local_batch / group)  # LinearFit takes scalars or arrays, untyped
    return forward


def backward_compute_time(
    forward: NDArray[np.float64], backward_to_forward: float, recompute: NDArray[np.bool_]
) -> NDArray[np.float64]:
    """Backward time: ``beta * f``, plus one more forward for a recomputed block."""
    return backward_to_forward * forward + np.where(recompute, forward, 0.0)


def tensor_parallel_comm_time(
    cm: CostModel,
    sa: StrategyArrays,
    ctx: StageContext,
    local_batch: NDArray[np.float64],
    hidden: int,
    seq: int,
    calls_forward: float,
    calls_backward: float,
    ulysses_calls: float,
) -> NDArray[np.float64]:
    """Per micro-batch time of the TP/SP collectives, which sit on the critical path.

    Megatron without SP: ``calls`` all-reduces of ``b*s*h`` per pass; with SP an all-gather and a
    reduce-scatter of the same tensor instead. Ulysses: ``ulysses_calls`` all-to-alls of the
    ``b*s*h/g`` each rank holds, per forward and per backward. Recomputation repeats the forward's.
    """
    n = ctx.devices_per_stage
    g = sa.tp
    d = n // g
    stride = np.where(sa.consecutive, 1, d)
    message = local_batch * seq * hidden * cm.precision.compute_bytes
    forward_calls = calls_forward * (1 + sa.recompute)
    megatron_calls = forward_calls + calls_backward
    W = ctx.world_size
    ar = cm.collective_times("all_reduce", message, g, stride, W)
    ag_rs = cm.collective_times("all_gather", message, g, stride, W) + cm.collective_times(
        "reduce_scatter", message, g, stride, W
    )
    a2a = cm.collective_times("all_to_all", message / g, g, stride, W)
    return np.where(
        sa.ulysses,
        ulysses_calls * (2 + sa.recompute) * a2a,
        np.where(sa.megatron_sp, megatron_calls * ag_rs, np.where(sa.replicated_tp, megatron_calls * ar, 0.0)),
    )


def data_parallel_comm_times(
    cm: CostModel, sa: StrategyArrays, ctx: StageContext, parameters: float
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """FSDP2/DDP communication: (forward all-gather, backward all-gather + per-micro-batch gradient
    reduction, once-per-step gradient reduction), each in seconds per occurrence.

    Parameters are gathered in the compute dtype; gradients are reduced in the reduce dtype.
    Megatron splits the weights over its group, so its messages are ``1/g`` of the block; Ulysses
    keeps them whole and its gradients must also be summed over the Ulysses group (DDP: one
    all-reduce over the stage; ZeRO: reduce-scatter over the replicas, then an all-reduce of the
    shard over the Ulysses group).
    """
    n = ctx.devices_per_stage
    W = ctx.world_size
    g = sa.tp
    d = n // g
    weights = parameters / np.where(sa.splits_weights, g, 1)
    dp_stride = np.where(sa.consecutive, g, 1)
    tp_stride = np.where(sa.consecutive, 1, d)
    gather = cm.collective_times("all_gather", weights * cm.precision.compute_bytes, d, dp_stride, W)
    grad_bytes = weights * cm.precision.reduce_bytes
    scatter = cm.collective_times("reduce_scatter", grad_bytes, d, dp_stride, W) + np.where(
        sa.ulysses, cm.collective_times("all_reduce", grad_bytes / d, g, tp_stride, W), 0.0
    )
    allreduce = np.where(
        sa.ulysses,
        cm.collective_times("all_reduce", grad_bytes, np.full_like(g, n), np.ones_like(g), W),
        cm.collective_times("all_reduce", grad_bytes, d, dp_stride, W),
    )
    zero = sa.dp_code > 0
    forward_gather = np.where(zero, gather, 0.0)
    backward_gather = np.where(sa.dp_code == 2, gather, 0.0)
    # DDP layers sum their gradients once per step, after the last micro-batch (``runtime.gradient_sync``).
    if accumulates_unsharded_gradients(ctx.pp, ctx.micro_batches):
        per_micro_batch, per_step = np.zeros_like(scatter), np.where(zero, scatter, allreduce)
    else:  # every micro-batch's backward reduce-scatters the ZeRO blocks' gradients
        per_micro_batch, per_step = np.where(zero, scatter, 0.0), np.where(zero, 0.0, allreduce)
    return forward_gather, backward_gather + per_micro_batch, per_step


def model_state_bytes(cm: CostModel, sa: StrategyArrays, ctx: StageContext, parameters: float) -> NDArray[np.float64]:
    """Parameters, gradients and optimizer states one device holds for a block.

    With ``P`` the block's parameters on the device (``/g`` when Megatron splits the weights) and
    ``S = P * (param + grad + optimizer bytes)``: DDP holds ``S`` plus, when it computes in another dtype than
    it stores, the compute-dtype copy of its weights (autocast's cache, kept for backward); its gradient
    buckets are transient, at most two of ``runtime.gradient_sync.DEFAULT_BUCKET_BYTES`` in flight; ZeRO-2 ``S/d``
    plus the unsharded compute-dtype weights it keeps from forward through backward; ZeRO-3 ``S/d`` (its gathered
    weights are transient, see :mod:`.working`). ZeRO blocks add unsharded gradients in the reduce dtype
    when they accumulate across micro-batches (:func:`accumulates_unsharded_gradients`).
    """
    pr = cm.precision
    n = ctx.devices_per_stage
    g = sa.tp
    d = n // g
    weights = parameters / np.where(sa.splits_weights, g, 1)
    full = weights * (pr.param_bytes + pr.grad_bytes + cm.optimizer_bytes)
    working_copy = weights * pr.compute_bytes
    ddp = full + (working_copy if pr.compute_bytes != pr.param_bytes else 0.0)
    out: NDArray[np.float64] = np.select([sa.dp_code == 0, sa.dp_code == 1], [ddp, full / d + working_copy], full / d)
    if accumulates_unsharded_gradients(ctx.pp, ctx.micro_batches):
        out = out + np.where(sa.dp_code > 0, weights * pr.reduce_bytes, 0.0)
    return out


def activation_bytes(
    cm: CostModel,
    sa: StrategyArrays,
    local_batch: NDArray[np.float64],
    per_degree: Callable[[int], float],
    recompute_bytes: float,
    replicated_bytes: float,
) -> NDArray[np.float64]:
    """Bytes one device keeps for backward per micro-batch in flight.

    ``b * act(g)`` from the profile's per-degree table; Megatron TP without SP also keeps the
    ``(1 - 1/g)`` share of the replicated part whole; a recomputed block keeps only its input,
    split by ``g`` when the sequence is split. Rescaled to the compute dtype.
    """
    g = sa.tp
    per_sample = np.array([per_degree(int(x)) for x in g], dtype=float).reshape(g.shape)
    stored = local_batch * (per_sample + np.where(sa.replicated_tp, (1 - 1 / g) * replicated_bytes, 0.0))
    kept = local_batch * recompute_bytes / np.where(sa.sequence_split, g, 1)
    return cm.activation_scale * np.where(sa.recompute, kept, stored)


@dataclass(frozen=True, eq=False)
class LayerCosts:
    """Costs of each candidate strategy (arrays over candidates) in one stage context.

    ``time`` is per micro-batch; ``last_extra`` what the last micro-batch adds (the gradient
    reduction that backward cannot hide); ``state_bytes`` and ``activation_bytes`` per device,
    the latter per micro-batch in flight.
    """

    time: NDArray[np.float64]
    last_extra: NDArray[np.float64]
    state_bytes: NDArray[np.float64]
    activation_bytes: NDArray[np.float64]

    def step_share(self, span: float) -> NDArray[np.float64]:
        """Time per micro-batch carrying the step's extra, ``t + E/span``, with ``span`` the schedule's step in
        stage times (:func:`~.pipeline.step_span`; ``m`` without a pipeline): the step then counts ``E`` once."""
        return self.time + self.last_extra / span

    def memory(self, in_flight: float) -> NDArray[np.float64]:
        return self.state_bytes + in_flight * self.activation_bytes

    def take(self, keep: NDArray[np.bool_] | NDArray[np.intp]) -> LayerCosts:
        """The costs of the candidates ``keep`` selects (a mask or indices)."""
        return LayerCosts(self.time[keep], self.last_extra[keep], self.state_bytes[keep], self.activation_bytes[keep])


def _costs(
    cm: CostModel,
    sa: StrategyArrays,
    ctx: StageContext,
    *,
    parameters: float,
    forward_fit: LinearFit,
    backward_to_forward: float,
    hidden: int,
    seq: int,
    per_degree: Callable[[int], float],
    recompute_bytes: float,
    replicated_bytes: float,
    tp_calls_forward: float,
    tp_calls_backward: float,
    ulysses_calls: float,
    vocab: bool = False,
    parameter_tensors: float = 0.0,
) -> LayerCosts:
    """Assemble the terms above for blocks and for the embedding/head (which differ only in their data).

    Per micro-batch: forward overlapped with its parameter gathers, backward (and recompute)
    overlapped with its gathers and per-micro-batch gradient reductions, plus TP/SP communication;
    the last micro-batch also overlaps the once-per-step gradient reduction with its backward.
    Calibrated: the block (or embedding/head) terms recombined as the calibration says, and the
    optimizer's work on the ``parameter_tensors`` and the elements this device holds added once per step.
    """
    n = ctx.devices_per_stage
    d = n // sa.tp
    b = local_micro_batch(ctx, d)
    forward = forward_compute_time(forward_fit, b, sa.tp)
    backward = backward_compute_time(forward, backward_to_forward, sa.recompute)
    tp = tensor_parallel_comm_time(cm, sa, ctx, b, hidden, seq, tp_calls_forward, tp_calls_backward, ulysses_calls)
    gather_f, backward_comm, per_step = data_parallel_comm_times(cm, sa, ctx, parameters)
    fwd = overlap_time(forward, gather_f, cm.alpha)
    time = fwd + overlap_time(backward, backward_comm, cm.alpha) + tp
    last = fwd + overlap_time(backward, backward_comm + per_step, cm.alpha) + tp
    cal = cm.calibration
    if cal is not None:
        if vocab:
            calibrated = vocab_time(cal, (1.0 + backward_to_forward) * forward, time, sa)
        else:
            calibrated = block_features(forward, backward_to_forward, time, sa) @ cal.coefficients
        weights = parameters / np.where(sa.splits_weights, sa.tp, 1)
        elements = np.where(sa.dp_code > 0, weights / d, weights)
        dtensors = (sa.dp_code > 0) | sa.splits_weights  # ZeRO shards and tensor-parallel splits: DTensors
        extra = (last - time) + cal.optimizer_time(parameter_tensors, elements, dtensors)  # after the pipeline's flush
        if not vocab:
            extra = extra + cal.ddp_reduction_s * ddp_reduced(sa, n)
        ranks_per_node = min(cm.profile.hardware.devices_per_node, ctx.world_size)
        calibrated = calibrated * cal.sharing_factor(ctx.pp, ctx.micro_batches, ranks_per_node, ctx.virtual_stages)
        time, last = calibrated, calibrated + extra
    return LayerCosts(
        time=time,
        last_extra=last - time,
        state_bytes=model_state_bytes(cm, sa, ctx, parameters),
        activation_bytes=activation_bytes(cm, sa, b, per_degree, recompute_bytes, replicated_bytes),
    )


def ddp_reduced(sa: StrategyArrays, devices_per_stage: int) -> NDArray[np.bool_]:
    """Which candidates' gradients DDP sums over replicas (``ddp`` with more than one copy of the weights)."""
    replicas = devices_per_stage // np.where(sa.splits_weights, sa.tp, 1)
    reduced: NDArray[np.bool_] = (sa.dp_code == 0) & (replicas > 1)
    return reduced


def block_costs(cm: CostModel, layer: LayerTypeProfile, sa: StrategyArrays, ctx: StageContext) -> LayerCosts:
    """Costs of a Transformer block of type ``layer`` under each candidate strategy."""
    return _costs(
        cm,
        sa,
        ctx,
        parameters=layer.parameters,
        forward_fit=layer.forward_time,
        backward_to_forward=layer.backward_to_forward,
        hidden=layer.hidden_size,
        seq=layer.seq_length,
        per_degree=layer.activation_bytes_per_sample.at,
        recompute_bytes=layer.recompute_activation_bytes_per_sample,
        replicated_bytes=layer.replicated_activation_bytes_per_sample,
        tp_calls_forward=layer.tp_collectives_per_forward,
        tp_calls_backward=layer.tp_collectives_per_forward,
        ulysses_calls=layer.ulysses_all_to_alls_per_forward,
        parameter_tensors=cm.calibration.tensors_per_layer_type.get(layer.name, 0) if cm.calibration is not None else 0,
    )


def vocab_costs(cm: CostModel, sa: StrategyArrays, ctx: StageContext, part: str) -> LayerCosts:
    """Costs of the embedding (``part="embedding"``, first stage) or the head and loss (``"head"``, last stage).

    Vocabulary parallelism costs one all-reduce (or all-gather + reduce-scatter with SP) of
    ``b*s*h`` per micro-batch per part: the embedding's output in forward, the head's input
    gradient in backward (the vocabulary-parallel loss exchanges only per-token scalars, not
    modelled). Sequence-split execution has no communication besides gradients. A tied head
    holds its own copy of the embedding when it is on another stage. The runtime recomputes blocks
    only: a ``recompute`` flag of the vocabulary strategy keeps the embedding's and head's activations
    (found by ``lightning-galvatron dry-run``: pricing them as recomputed under-counted the head's logits).
    """
    sa = dataclasses.replace(sa, recompute=np.zeros_like(sa.recompute))
    model = cm.profile.model
    vocab = model.vocab
    tensors = cm.calibration.vocab_tensors if cm.calibration is not None else 0
    if part == "embedding":
        parameters, fit, table = (
            vocab.embedding_parameters,
            vocab.embedding_forward_time,
            vocab.embedding_activation_bytes_per_sample,
        )
        tensors = (tensors + 1) // 2
    elif part == "head":
        tensors //= 2
        parameters = vocab.head_parameters if not vocab.tied else (vocab.embedding_parameters if ctx.pp > 1 else 0)
        fit, table = vocab.head_forward_time, vocab.head_activation_bytes_per_sample
    else:
        raise ValueError(f"part must be 'embedding' or 'head', got {part!r}")
    return _costs(
        cm,
        sa,
        ctx,
        parameters=parameters,
        forward_fit=fit,
        backward_to_forward=vocab.backward_to_forward,
        hidden=model.hidden_size,
        seq=model.seq_length,
        per_degree=table.at,
        recompute_bytes=0.0,
        replicated_bytes=0.0,
        tp_calls_forward=1.0,
        tp_calls_backward=0.0,
        ulysses_calls=0.0,
        vocab=True,
        parameter_tensors=tensors,
    )


def relocation_time(cm: CostModel, before: Layout, after: Layout, ctx: StageContext, hidden: int, seq: int) -> float:
    """Forward plus backward time to hand activations from a block in layout ``before`` to one in ``after``.

    Between blocks each device holds ``B/(m*n)`` samples' worth of ``s*h`` activations (more, ``g``
    times, in a replicated TP layout). Changing layouts moves them within the smallest group that
    covers both (``lcm`` of the degrees; the whole stage when the rank orders differ): into a
    replicated layout an all-gather in forward (its adjoint is a slice), out of one a slice in
    forward and an all-gather of the gradient in backward, between split layouts an all-to-all
    each way.
    """
    if before == after:
        return 0.0
    n = ctx.devices_per_stage
    group = math.lcm(before.group, after.group)
    if before.consecutive != after.consecutive and 1 < min(before.group, after.group):
        group = n  # different rank orders: the data crosses the whole stage
    strided = not (before.consecutive and after.consecutive)
    stride = n // group if strided else 1
    share = ctx.samples_per_device * seq * hidden * cm.precision.compute_bytes
    W = ctx.world_size
    total = 0.0
    if after.replicated:
        total += float(cm.collective_time("all_gather", after.group * share, group, stride, W))
    if before.replicated:
        total += float(cm.collective_time("all_gather", before.group * share, group, stride, W))
    if not (before.replicated or after.replicated):
        total += 2.0 * float(cm.collective_time("all_to_all", share, group, stride, W))
    return total


def relocation_matrix(
    cm: CostModel, layouts: Sequence[Layout], ctx: StageContext, hidden: int, seq: int
) -> NDArray[np.float64]:
    """:func:`relocation_time` between every pair of layouts (rows: before, columns: after)."""
    k = len(layouts)
    out = np.zeros((k, k))
    for i in range(k):
        for j in range(k):
            if i != j:
                out[i, j] = relocation_time(cm, layouts[i], layouts[j], ctx, hidden, seq)
    return out
