"""Measured selection (``GalvatronStrategy(trials=...)``): short real runs of a few candidate plans choose the plan.

:mod:`.trials` runs a plan on a copy of the model, :mod:`.memory` measures a step's peak memory,
:mod:`.measured` chooses and caches, :mod:`.running` compares the running plan's first steps with what was
predicted and measured.
"""

from lightning_galvatron.selection.measured import Selection, SelectionCache, TrialRecord, select_by_measurement
from lightning_galvatron.selection.trials import TrialSettings

__all__ = ["Selection", "SelectionCache", "TrialRecord", "TrialSettings", "select_by_measurement"]
