"""Offline plan search: cost model, dynamic programming and pipeline partitioning (numpy only, no torch).

Entry points: :func:`search` (the best plan for a cluster and memory budget; its knobs are one
:class:`SearchOptions`) and :func:`evaluate` (predicted time and memory of any plan). Profiles are
:class:`lightning_galvatron.profiles.Profile`.

Modules: ``options`` (the knobs), ``space`` (candidates, asking :mod:`lightning_galvatron.plan.rules`), ``cost``
(time and memory), ``coefficients`` and ``calibration`` (the calibrated cost model and its fit), ``overheads``
(the calibration a profile's measured per-call overheads give, and which calibration prices a plan), ``dp``
(the block DP), ``pipeline`` (schedules and partitions), ``solver`` (one batch size, with the notation),
``engine`` (the driver, results, baselines), ``estimate`` (pricing any plan), ``report`` (tables).
"""

from lightning_galvatron.search.engine import (
    Baseline,
    InfeasibleBudgetError,
    NoValidPlanError,
    SearchResult,
    search,
)
from lightning_galvatron.search.estimate import BlockEstimate, Estimate, StageEstimate, evaluate
from lightning_galvatron.search.options import SearchOptions

__all__ = [
    "Baseline",
    "BlockEstimate",
    "Estimate",
    "InfeasibleBudgetError",
    "NoValidPlanError",
    "SearchOptions",
    "SearchResult",
    "StageEstimate",
    "evaluate",
    "search",
]
