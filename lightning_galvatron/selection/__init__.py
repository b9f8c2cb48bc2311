"""Measured selection (``GalvatronStrategy(trials=...)``): short real runs of a few candidate plans choose the plan.

:mod:`.measured` chooses and caches, :mod:`.memory` measures a step's peak memory, :mod:`.settings` holds what the
trials may spend, what runs them (``CandidateRunner``) and what they measured. The trials run in
:mod:`lightning_galvatron.strategy.trials` (the Lightning side); the candidates come from
:mod:`lightning_galvatron.search.candidates`.
"""

from lightning_galvatron.selection.measured import Selection, SelectionCache, TrialRecord, select_by_measurement
from lightning_galvatron.selection.settings import (
    CandidateRunner,
    Measurement,
    TrialSettings,
    TrialUnavailable,
    preserved_rng,
)

__all__ = [
    "CandidateRunner",
    "Measurement",
    "Selection",
    "SelectionCache",
    "TrialRecord",
    "TrialSettings",
    "TrialUnavailable",
    "preserved_rng",
    "select_by_measurement",
]
