"""Offline plan search: cost model, dynamic programming and pipeline partitioning (numpy only, no torch).

Entry points: :func:`search` (the best plan for a cluster and memory budget) and :func:`evaluate`
(predicted time and memory of any plan). Profiles are :class:`lightning_galvatron.profiles.Profile`.
"""

from lightning_galvatron.search.engine import (
    Baseline,
    InfeasibleBudgetError,
    NoValidPlanError,
    SearchResult,
    search,
)
from lightning_galvatron.search.estimate import BlockEstimate, Estimate, StageEstimate, evaluate

__all__ = [
    "Baseline",
    "BlockEstimate",
    "Estimate",
    "InfeasibleBudgetError",
    "NoValidPlanError",
    "SearchResult",
    "StageEstimate",
    "evaluate",
    "search",
]
