"""When two measured plans count as equally fast, and which of them is simpler: the rules measured selection
decides by (a few short trials on a shared machine err by 5-15%)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_galvatron.plan import ParallelPlan

if TYPE_CHECKING:
    from lightning_galvatron.selection.measured import TrialRecord


#: A more complex plan is trained over a simpler one only when it measured faster by more than this many standard
#: errors of the difference of their median steps.
RESOLUTION = 2.0


#: ... and only when the simpler plan's median is within this fraction of the faster one's: a trial so noisy that a
#: plan twice as slow cannot be told apart from the fastest must not make the slow one win.
TIE = 0.05

_SHARDING = {"ddp": 0, "zero2": 1, "zero3": 2}


def complexity(plan: ParallelPlan) -> tuple[int, ...]:
    """How much machinery a plan runs, simplest first: mixed strategies per layer, pipeline stages, virtual stages,
    split weights (tensor parallelism, then sharding: ZeRO-3 over ZeRO-2 over DDP), micro-batches, recomputed
    layers. What a few trial steps miss (a pipeline's bubbles, per-call overheads varying with the machine's load)
    grows with it."""
    layers = (*plan.layers, plan.vocab)
    return (
        int(not plan.is_uniform),
        plan.pp,
        plan.virtual_stages,
        max(s.tp for s in layers),
        max(_SHARDING.get(s.dp_type, len(_SHARDING)) for s in layers),
        plan.micro_batches,
        sum(s.recompute for s in plan.layers),
    )


def simplest_within_resolution(fastest: TrialRecord, fitting: list[TrialRecord]) -> TrialRecord:
    """The simplest plan of ``fitting`` (by :func:`complexity`) that the trials cannot tell apart from ``fastest``
    (its median within :data:`RESOLUTION` standard errors of the difference of the two medians, and within
    :data:`TIE` of the fastest's); ``fastest`` when none is simpler.

    A user gets DDP or a uniform plan without any search, so extra machinery must win by measurement: plans a few
    percent ahead in their trials have trained several percent behind the simpler plan (docs/performance.md)."""

    def indistinguishable(t: TrialRecord) -> bool:
        if t is fastest:
            return True
        assert t.step_s is not None and fastest.step_s is not None
        return (
            not t.stopped_early
            and t.step_s <= (1 + TIE) * fastest.step_s
            and not measurably_faster(trial_steps(fastest), trial_steps(t))
        )

    return min((t for t in fitting if indistinguishable(t)), key=lambda t: (complexity(t.plan), t.step_s))


def trial_steps(t: TrialRecord) -> tuple[float, ...]:
    """A measured trial's timed steps (selections cached before the steps were kept have the median only)."""
    assert t.step_s is not None
    return t.steps or (t.step_s,)


def measurably_faster(fast: Sequence[float], slow: Sequence[float]) -> bool:
    """Whether the median of the step times ``fast`` is below that of ``slow`` by more than :data:`RESOLUTION`
    standard errors of the difference of the two medians (the noise of one short run is 5-15% on a shared CPU)."""
    margin = RESOLUTION * math.hypot(_median_error(fast), _median_error(slow))
    return statistics.median(fast) + margin < statistics.median(slow)


def _median_error(steps: Sequence[float]) -> float:
    """Standard error of the median of ``steps``: 1.25 sigma / sqrt(n), sigma from the median absolute deviation
    (robust to the one disturbed step); 0 with fewer than 3 steps (nothing to tell the spread from)."""
    if len(steps) < 3:
        return 0.0
    middle = statistics.median(steps)
    sigma = 1.4826 * statistics.median(abs(s - middle) for s in steps)
    return 1.2533 * sigma / math.sqrt(len(steps))
