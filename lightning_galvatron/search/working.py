"""Working memory: what a stage holds only for a while during backward, and what the search holds back for it.

A recomputed block re-materialises a micro-batch of its activations, and a ZeRO-3 block gathers its weights again
for backward; other blocks' activations and weights are counted where they live (:mod:`.cost`). The search's DP
needs a reserve per stage that does not depend on the blocks' strategies, so it solves each *reserve level* (the
kinds of transient need its strategies may have) apart, with that level's bound; :func:`evaluate` counts what a
known plan's blocks need.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_galvatron.plan import LayerStrategy
from lightning_galvatron.profiles import LayerTypeProfile
from lightning_galvatron.search.cost import CostModel, StageContext
from lightning_galvatron.search.space import DP_CODE, StrategyArrays

__all__ = [
    "RESERVE_LEVELS",
    "admitted_by_level",
    "plan_working_memory_bytes",
    "reserve_level",
    "reserve_table",
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


def admitted_by_level(sa: StrategyArrays, level: str) -> np.ndarray:
    """Which candidates of ``sa`` the reserve ``level`` admits."""
    recompute, gather = RESERVE_LEVELS[level]
    return (recompute | ~sa.recompute) & (gather | (sa.dp_code != DP_CODE["zero3"]))


def working_memory_bytes(
    cm: CostModel, layers: Sequence[LayerTypeProfile], ctx: StageContext, level: str = "all"
) -> float:
    """Transient memory reserved on a stage whose blocks take strategies of reserve ``level``, whichever they are.

    During a recomputed block's backward one micro-batch of its full activations is live, and a ZeRO-3
    block's weights are gathered. The reserve is the largest block type's ``B/(m*n)`` samples of degree-1
    activations (if the level admits recomputation) plus its whole weights in the compute dtype (if it admits
    ZeRO-3): an upper bound for every strategy of the level, so the search's DP stays additive.
    """
    recompute, gather = RESERVE_LEVELS[level]
    if not (recompute or gather):
        return 0.0
    costliest = LayerStrategy(dp_type="zero3" if gather else "ddp", recompute=recompute)
    return plan_working_memory_bytes(cm, [(t, costliest) for t in layers], ctx)


def plan_working_memory_bytes(
    cm: CostModel, blocks: Sequence[tuple[LayerTypeProfile, LayerStrategy]], ctx: StageContext
) -> float:
    """Transient memory of a given plan's stage: what :func:`working_memory_bytes` reserves, for the blocks that need
    it.

    Only a recomputed block re-materialises a micro-batch of its activations during backward, and only a
    ZeRO-3 block gathers its weights again for backward; other blocks' activations and weights are already
    counted where they live (measured: reserving them for every block overstated DDP and pipeline stages by
    a block's activations). The search keeps a bound per reserve level so that its DP stays additive; an
    estimate of a known plan uses this.
    """
    samples = ctx.samples_per_device
    need = 0.0
    for t, s in blocks:
        recompute = cm.activation_scale * samples * t.activation_bytes_per_sample.at(1) if s.recompute else 0.0
        gathered = (
            t.parameters / (s.tp if s.splits_weights else 1) * cm.precision.compute_bytes
            if s.dp_type == "zero3"
            else 0.0
        )
        need = max(need, recompute + gathered)
    return need


def reserve_table(cm: CostModel, types: np.ndarray, ctx: StageContext, level: str, max_blocks: int) -> np.ndarray:
    """The reserve of a stage ``[a, a+j)`` of the blocks of layer types ``types`` at reserve ``level``: the largest
    over the block types it holds, as an ``(L+1, max_blocks+1)`` table."""
    L = len(types)
    per_type = np.array([working_memory_bytes(cm, [lt], ctx, level) for lt in cm.profile.model.layer_types])
    last = np.arange(L + 1)[:, None] + np.arange(max_blocks + 1)[None, :] - 1  # last block of [a, a+j)
    valid = (last >= np.arange(L + 1)[:, None]) & (last < L)
    return np.maximum.accumulate(np.where(valid, per_type[types[np.clip(last, 0, L - 1)]], 0.0), axis=1)
