"""Pipeline terms: micro-batches in flight, step time of a schedule, and stage partitions.

Step time. With ``T_s`` the time stage ``s`` spends per micro-batch (its blocks' forward and
backward, the embedding/head on the end stages, its point-to-point transfers, and the
once-per-step gradient reduction spread over the ``m`` micro-batches), GPipe and 1F1B take
``sum_s T_s + (m - 1) * max_s T_s``: one micro-batch crosses every stage, the other ``m - 1`` follow
at the pace of the slowest. Interleaving ``v`` chunks per rank shrinks the fill and drain ``v``
times: ``sum_s T_s / v + (m - 1/v) * max_s T_s`` for ``m >= pp``. With fewer micro-batches than
stages (torch's interleaved schedule runs them: one round of ``m``) a rank waits for its micro-batches
to come round the ring before each next chunk, so one micro-batch crosses all ``pp * v`` chunks and the
others follow one chunk apart: ``sum_s T_s + (m - 1)/v * max_s T_s``. Both equal the length of torch's
own action order run with its dependencies at uniform stage times (checked for ``pp <= 4, v <= 3``,
``m <= 3 pp``). The formulas are monotone in every ``T_s``, so minimising each stage on its own
minimises the step: the per-stage DP is exact for them.

Partitions. ``even``; ``time-balanced`` and ``memory-balanced`` (exact min-max contiguous
partitions of per-block weights that may differ per stage, e.g. more micro-batches in flight on
early 1F1B stages); and, as in Galvatron-BMW, partitions between those two, refined by moving single blocks
across stage boundaries while the exact objective improves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from lightning_galvatron.plan import even_partition
from lightning_galvatron.plan.layout import rank_chunks
from lightning_galvatron.plan.rules import interleaved_rounds


def in_flight_micro_batches(schedule: str, pp: int, micro_batches: int, stage: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak (per chunk when interleaved).

    No pipeline: 1 (accumulation runs micro-batches one after another). GPipe: all ``m``. 1F1B:
    ``min(m, pp - stage)``. Interleaved 1F1B: torch's warm-up of ``2(pp - stage - 1) + (v - 1) r``
    chunk forwards (``r`` micro-batches per round, ``pp`` when ``m`` is a multiple of ``pp``, as in
    Megatron), plus the one in progress, at most all ``m v``, spread evenly over the rank's ``v`` chunks.
    """
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "1f1b":
        return float(min(micro_batches, pp - stage))
    if schedule == "interleaved_1f1b":
        v = virtual_stages
        per_round = micro_batches // interleaved_rounds(pp, micro_batches)
        chunks_in_flight = min(micro_batches * v, 2 * (pp - stage - 1) + (v - 1) * per_round + 1)
        return chunks_in_flight / v
    raise ValueError(f"unknown schedule {schedule!r}")


def p2p_transfers(pp: int, stage: int, virtual_stages: int = 1) -> int:
    """Transfers a rank receives per micro-batch: activations from the previous chunk, gradients from the next."""
    chunks = pp * virtual_stages
    return sum((c > 0) + (c < chunks - 1) for c in rank_chunks(stage, pp, virtual_stages))


def pipeline_step_time(
    stage_times: NDArray[np.float64], micro_batches: int, virtual_stages: int = 1
) -> NDArray[np.float64]:
    """Step time from per-stage times per micro-batch (last axis = stages); see the module docstring."""
    t = np.asarray(stage_times, dtype=float)
    v, m = virtual_stages, micro_batches
    slowest = t.max(axis=-1)
    with np.errstate(invalid="ignore"):  # inf (a stage that does not fit) times 0 when m = v = 1
        if v > 1 and m < t.shape[-1]:
            step = t.sum(axis=-1) + (m - 1.0) / v * slowest
        else:
            step = t.sum(axis=-1) / v + (m - 1.0 / v) * slowest
    return np.where(np.isinf(slowest), np.inf, step)


def step_span(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """How many stage times per micro-batch the schedule's step lasts when every stage takes the same (``m``
    without a pipeline; ``m + pp - 1`` for 1F1B and GPipe). A time once per step (the gradient reduction and the
    optimizer after the last backward) is carried in the stage times per micro-batch divided by it, so that the
    step counts it once, not ``span / m`` times (a pipeline of 4 stages and 1 micro-batch counted it 4 times)."""
    return float(pipeline_step_time(np.ones(pp), micro_batches, virtual_stages))


def schedule_overhead(
    measured_s: float, stage_times: NDArray[np.float64], micro_batches: int, virtual_stages: int = 1
) -> float:
    """The schedule's own time per micro-batch and model chunk (besides blocks and transfers) that turns stage
    times per micro-batch without it into the ``measured_s`` a pipeline took: the step's excess over
    :func:`pipeline_step_time`, over how many such times the schedule runs one after another (every stage adds it
    once per chunk it holds: ``v`` per micro-batch). Negative where the step ran faster than its stage times."""
    t, m, v = np.asarray(stage_times, dtype=float), micro_batches, virtual_stages
    return (measured_s - float(pipeline_step_time(t, m, v))) / (v * step_span(t.shape[-1], m, v))


# ---------------------------------------------------------------------------------------------- partitions
def balanced_partition(
    pp: int,
    weights: NDArray[np.float64],
    constants: Sequence[float] | NDArray[np.float64] = (),
    max_blocks: int | None = None,
) -> tuple[int, ...] | None:
    """Contiguous partition of the blocks into ``pp`` stages minimising the largest stage cost.

    ``weights`` is ``(pp, L)``: the cost of each block if it sits on each stage (or ``(L,)`` for all
    stages alike); ``constants`` adds a fixed cost per stage (the embedding on the first, the head on
    the last). Stages hold between 1 and ``max_blocks`` blocks. Exact: a DP over (stage, last block)
    with the min-max recurrence, ``O(pp * L^2)`` in numpy. ``None`` if no partition respects
    ``max_blocks``.
    """
    w = np.atleast_2d(np.asarray(weights, dtype=float))
    if w.shape[0] == 1:
        w = np.repeat(w, pp, axis=0)
    L = w.shape[1]
    limit = min(max_blocks or L, L - pp + 1)
    if limit * pp < L:
        return None
    consts = np.zeros(pp) if len(constants) == 0 else np.asarray(constants, dtype=float)
    prefix = np.concatenate([np.zeros((pp, 1)), np.cumsum(w, axis=1)], axis=1)  # (pp, L+1)
    a = np.arange(L + 1)[:, None]
    e = np.arange(L + 1)[None, :]
    allowed = (e - a >= 1) & (e - a <= limit)
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((pp, L + 1), dtype=np.int64)
    for s in range(pp):
        cost = np.where(allowed, consts[s] + prefix[s][None, :] - prefix[s][:, None], np.inf)  # (start, end)
        candidates = np.maximum(best[:, None], cost)
        choice[s] = np.argmin(candidates, axis=0)
        best = candidates[choice[s], np.arange(L + 1)]
    if not np.isfinite(best[L]):
        return None
    sizes, end = [], L
    for s in range(pp - 1, -1, -1):
        start = int(choice[s, end])
        sizes.append(end - start)
        end = start
    return tuple(reversed(sizes))


def interpolate_partitions(a: Sequence[int], b: Sequence[int], steps: int = 4) -> list[tuple[int, ...]]:
    """Partitions whose stage boundaries lie between those of ``a`` and ``b`` (Galvatron-BMW's middle ground)."""
    ba, bb = np.cumsum(a)[:-1], np.cumsum(b)[:-1]
    out = []
    for i in range(1, steps):
        bounds = np.rint(ba + (bb - ba) * i / steps).astype(int)
        bounds = np.maximum.accumulate(bounds)
        sizes = np.diff(np.concatenate([[0], bounds, [sum(a)]]))
        if (sizes >= 1).all():
            out.append(tuple(int(x) for x in sizes))
    return out


def partition_neighbours(partition: Sequence[int] | NDArray[np.int64], max_blocks: int) -> NDArray[np.int64]:
    """All partitions one block away: a boundary moved by one (rows of an ``(N, pp)`` array)."""
    p = np.asarray(partition)
    rows = []
    for s in range(len(p) - 1):
        for delta in (1, -1):
            q = p.copy()
            q[s] += delta
            q[s + 1] -= delta
            if q[s] >= 1 and q[s + 1] >= 1 and q[s] <= max_blocks and q[s + 1] <= max_blocks:
                rows.append(q)
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(p))


def refine_partition(
    start: Sequence[int],
    objective: Callable[[NDArray[np.int64]], NDArray[np.float64]],
    max_blocks: int,
    max_rounds: int = 256,
) -> tuple[tuple[int, ...], float]:
    """Hill-climb from ``start``: move one block across a stage boundary while the objective drops.

    ``objective`` maps an ``(N, pp)`` array of partitions to their ``N`` values (inf = infeasible).
    """
    current = np.asarray(start, dtype=np.int64)
    value = float(objective(current[None, :])[0])
    for _ in range(max_rounds):
        neighbours = partition_neighbours(current, max_blocks)
        if not len(neighbours):
            break
        values = objective(neighbours)
        best = int(np.argmin(values))
        if not values[best] < value * (1 - 1e-12):
            break
        current, value = neighbours[best], float(values[best])
    return tuple(int(x) for x in current), value


def rank_blocks(sizes: Sequence[int], pp: int, rank: int) -> tuple[list[int], list[bool]]:
    """The blocks of pipeline rank ``rank`` (its chunks, :func:`~lightning_galvatron.plan.layout.rank_chunks`, of
    ``sizes`` blocks each), and whether each starts a chunk (activations arrive by point-to-point there: no
    relocation)."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    blocks, resets = [], []
    for c in rank_chunks(rank, pp, len(sizes) // pp):
        for i in range(int(starts[c]), int(starts[c + 1])):
            blocks.append(i)
            resets.append(i == starts[c])
    return blocks, resets


__all__ = [
    "balanced_partition",
    "even_partition",
    "in_flight_micro_batches",
    "interpolate_partitions",
    "p2p_transfers",
    "partition_neighbours",
    "pipeline_step_time",
    "rank_blocks",
    "refine_partition",
    "schedule_overhead",
    "step_span",
]
