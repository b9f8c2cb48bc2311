"""``GalvatronStrategy``'s own arguments, checked when it is made: before any process is launched or profiled.

The search limits check themselves (:class:`~lightning_galvatron.strategy.autoplan.SearchSettings`, with the search's
rules), as does the watchdog (:class:`~lightning_galvatron.runtime.watchdog.WatchdogSettings`); what depends on
the devices (the world size a plan is for, a budget above a device's memory, the precision) is checked before
the launch, once Lightning has said which devices there are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_galvatron.plan import ParallelPlan, check_plan_source


def check_strategy_arguments(
    plan: ParallelPlan | Mapping[str, Any] | str | os.PathLike,
    layers: str | Sequence[str] | None,
    global_batch_size: int | None,
) -> None:
    """Raise ``ValueError`` naming the argument and what to give instead."""
    if plan is None:
        raise ValueError(
            'GalvatronStrategy needs a plan: plan="auto" (the default), a ParallelPlan, a dict or a JSON file'
        )
    if plan != "auto":
        check_plan_source(plan)
    if layers is not None and not (
        isinstance(layers, str) or (isinstance(layers, Sequence) and layers and all(isinstance(x, str) for x in layers))
    ):
        raise ValueError(f"layers must be a dotted path such as 'model.blocks', or a list of them, got {layers!r}")
    if global_batch_size is not None and (
        not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1
    ):
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
