"""Working memory: what a stage holds only for a while during backward, and what the search holds back for it.

A recomputed block re-materialises a micro-batch of its activations, and a ZeRO-3 block gathers its weights again
for backward; other blocks' activations and weights are counted where they live (:mod:`.cost`). Backward runs a
stage's blocks last to first, so when block ``i`` replays its forward, the activations the blocks after it stored
for that micro-batch are already freed: the replay only adds what exceeds them. A stage whose last block is not
recomputed and stores at least a replay's worth needs no reserve for recomputation at all (measured on the benchmark
GPT: two micro-batches with block 0 recomputed peaked 1 MiB *below* the same plan without recomputation).

The search's DP needs a reserve that depends on few of the blocks' strategies, so it solves each *reserve level* (the
kinds of transient need its strategies may have) apart, with that level's bounds, and charges a stage's reserve on
its last block (:func:`closing_reserve`); :func:`plan_working_memory_bytes` counts what a known plan's blocks need.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from lightning_galvatron.plan import LayerStrategy
from lightning_galvatron.profiles import LayerTypeProfile
from lightning_galvatron.search.cost import CostModel, StageContext
from lightning_galvatron.search.space import DP_CODE, StrategyArrays

__all__ = [
    "RESERVE_LEVELS",
    "admitted_by_level",
    "closing_reserve",
    "level_bounds",
    "plan_working_memory_bytes",
    "reserve_level",
    "reserve_tables",
    "working_memory_bytes",
]


#: What transient memory a stage's strategies may need during backward, narrowest first: a level admits recomputed
#: blocks (a micro-batch of a block's activations re-materialised), ZeRO-3 blocks (a block's weights gathered
#: again), both, or neither. The search solves each level with the reserve it needs (one bound for every level
#: would overstate a stage of plain blocks by a block's activations and weights).
RESERVE_LEVELS: dict[str, tuple[bool, bool]] = {
    "plain": (False, False),
    "gathered": (False, True),
    "recomputed": (True, False),
    "all": (True, True),
}


def reserve_level(strategies: Sequence[LayerStrategy]) -> str:
    """The narrowest of :data:`RESERVE_LEVELS` that admits every one of ``strategies``."""
    recompute = any(s.recompute for s in strategies)
    gather = any(s.dp_type == "zero3" for s in strategies)
    return next(name for name, (r, g) in RESERVE_LEVELS.items() if r >= recompute and g >= gather)


def admitted_by_level(sa: StrategyArrays, level: str) -> NDArray[np.bool_]:
    """Which candidates of ``sa`` the reserve ``level`` admits."""
    recompute, gather = RESERVE_LEVELS[level]
    admitted: NDArray[np.bool_] = (recompute | ~sa.recompute) & (gather | (sa.dp_code != DP_CODE["zero3"]))
    return admitted


def _replay_bytes(cm: CostModel, layer: LayerTypeProfile, ctx: StageContext) -> float:
    """What recomputing a block of type ``layer`` re-materialises: ``B/(m*n)`` samples of degree-1 activations (an
    upper bound for every strategy of the type)."""
    return cm.activation_scale * ctx.samples_per_device * layer.activation_bytes_per_sample.at(1)


def _gathered_bytes(cm: CostModel, layer: LayerTypeProfile, strategy: LayerStrategy | None = None) -> float:
    """The weights a ZeRO-3 block of type ``layer`` gathers for backward, in the compute dtype (whole weights
    without a strategy: the bound for every strategy)."""
    split = strategy.tp if strategy is not None and strategy.splits_weights else 1
    return layer.parameters / split * cm.precision.compute_bytes


def level_bounds(
    cm: CostModel, layers: Sequence[LayerTypeProfile], ctx: StageContext, level: str
) -> tuple[float, float]:
    """``(replay, gathered)``: the most one block of types ``layers`` re-materialises when recomputed and gathers
    when ZeRO-3, each 0 where ``level`` does not admit it."""
    recompute, gather = RESERVE_LEVELS[level]
    replay = max((_replay_bytes(cm, t, ctx) for t in layers), default=0.0) if recompute else 0.0
    gathered = max((_gathered_bytes(cm, t) for t in layers), default=0.0) if gather else 0.0
    return replay, gathered


def working_memory_bytes(
    cm: CostModel, layers: Sequence[LayerTypeProfile], ctx: StageContext, level: str = "all"
) -> float:
    """Transient memory reserved on a stage whose blocks take strategies of reserve ``level``, whichever they are
    and wherever they sit: a replay plus a gather (:func:`level_bounds`). What :func:`closing_reserve` charges a stage
    whose last block is recomputed; an upper bound for every plan of the level."""
    replay, gathered = level_bounds(cm, layers, ctx, level)
    return replay + gathered


def closing_reserve(
    replay: float, gathered: float, recompute: NDArray[np.bool_], stored: NDArray[np.float64]
) -> NDArray[np.float64]:
    """The reserve of a stage at a level with bounds ``(replay, gathered)`` (:func:`level_bounds`), for each candidate
    of its last block: recomputed (``recompute``) or storing ``stored`` bytes of one micro-batch's activations.

    Block ``i``'s replay coexists with the activations of the blocks up to ``i`` only; those of the blocks after it
    are freed. Every block before the last has at least the last block's activations behind it, so a stage whose
    last block is not recomputed needs ``replay - stored`` at most (nothing when it stores a replay's worth); one
    whose last block is recomputed needs the whole replay. A gathered block's weights may coexist with any of it.
    """
    return gathered + np.where(recompute, replay, np.maximum(replay - np.asarray(stored, dtype=float), 0.0))


def plan_working_memory_bytes(
    cm: CostModel,
    chunks: Sequence[Sequence[tuple[LayerTypeProfile, LayerStrategy, float]]],
    ctx: StageContext,
) -> float:
    """Transient memory of a given plan's stage: its chunks' blocks in order, each with its strategy and the bytes
    it stores for one micro-batch.

    During block ``i``'s backward it needs its replay (if recomputed) beyond what the blocks after it in its chunk
    stored and freed, plus its gathered weights (if ZeRO-3); the stage's need is the largest over its blocks. At
    most :func:`closing_reserve` of the plan's level, which is what the search holds back for it.
    """
    need = 0.0
    for blocks in chunks:
        after = 0.0  # what the blocks after this one stored for the micro-batch in backward
        for layer, strategy, stored in reversed(blocks):
            replay = max(_replay_bytes(cm, layer, ctx) - after, 0.0) if strategy.recompute else 0.0
            gathered = _gathered_bytes(cm, layer, strategy) if strategy.dp_type == "zero3" else 0.0
            need = max(need, replay + gathered)
            after += stored
    return need


def reserve_tables(
    cm: CostModel, types: NDArray[np.int64], ctx: StageContext, level: str, max_blocks: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """:func:`level_bounds` of every stage ``[a, a+j)`` of the blocks of layer types ``types``: two
    ``(L+1, max_blocks+1)`` tables, the largest replay and the largest gather over the block types the stage holds."""
    L = len(types)
    bounds = np.array([level_bounds(cm, [lt], ctx, level) for lt in cm.profile.model.layer_types])  # (T, 2)
    last = np.arange(L + 1)[:, None] + np.arange(max_blocks + 1)[None, :] - 1  # last block of [a, a+j)
    valid = (last >= np.arange(L + 1)[:, None]) & (last < L)
    per_block = bounds[types[np.clip(last, 0, L - 1)]]  # (L+1, J+1, 2)
    tables = np.maximum.accumulate(np.where(valid[..., None], per_block, 0.0), axis=1)
    return tables[..., 0], tables[..., 1]
