"""Measured selection: the cost model proposes, short real runs decide.

After the search (:func:`~lightning_galvatron.strategy.autoplan.plan_automatically`), in ``setup``:

1. rank 0 takes the search's best plan, the best plan of each other kind and the uniform plans that fit
   (:func:`~lightning_galvatron.search.candidates.diverse_candidates`) and tells every rank;
2. every rank runs each candidate for a few steps on a copy of the model (``runner``, a
   :class:`~lightning_galvatron.selection.settings.CandidateRunner`:
   :class:`lightning_galvatron.strategy.trials.TrialRunner` under the strategy), in order, while rank 0 expects the next
   trial to end within the time budget;
3. rank 0 calibrates the cost model from what the runtime profiler saw in the trials
   (:func:`~lightning_galvatron.search.calibration.fit_calibration`) and searches again with it; a new plan is
   tried too, time permitting;
4. the fastest measured plan whose measured peak fits the budget is trained; rank 0's decision is broadcast.

The decision, the measurements and the calibration are stored in the profile cache's directory
(``selections/<key>.json``), keyed by the profile's content, the search's arguments and the trial settings,
so a second run with the same model, cluster and settings applies the plan at once. Random states are
restored after the trials, and the user's module is never touched: training the chosen plan afterwards is
exactly what training it from the start would be.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import evaluate, search
from lightning_galvatron.search.calibration import Calibration, Observation, fit_calibration
from lightning_galvatron.search.candidates import diverse_candidates, executed, unmeasured
from lightning_galvatron.search.overheads import profile_calibration
from lightning_galvatron.search.report import plan_summary, text_table
from lightning_galvatron.selection.resolution import simplest_within_resolution
from lightning_galvatron.selection.settings import CandidateRunner, Measurement, TrialSettings, preserved_rng
from lightning_galvatron.units import format_bytes

if TYPE_CHECKING:
    from lightning_galvatron.strategy.autoplan import AutoPlan

SELECTION_FORMAT = "lightning_galvatron.selection"
SELECTION_VERSION = 1


@dataclass(frozen=True)
class TrialRecord:
    """One candidate: how it was found, what the model predicted and what its trial measured."""

    name: str
    plan: ParallelPlan
    predicted_step_s: float
    predicted_peak_bytes: float
    step_s: float | None = None  # None: the trial failed (error)
    peak_bytes: int | None = None
    seconds: float = 0.0
    error: str | None = None
    calibrated_step_s: float | None = None  # the model calibrated from all trials
    stopped_early: bool = False  # far slower than the fastest tried before it: stopped, memory not measured
    steps: tuple[float, ...] = ()  # the timed steps whose median is step_s

    def fits(self, budget: int) -> bool:
        """Measured, and its measured peak within ``budget`` (a trial stopped early was not measured: assumed to
        fit, as it is chosen only where nothing measured is faster)."""
        return self.step_s is not None and (self.peak_bytes is None or self.peak_bytes <= budget)

    @property
    def measured_step_s(self) -> float:
        """``step_s`` of a trial known to have been measured (filtered by :meth:`fits` or ``step_s is not None``)."""
        assert self.step_s is not None, f"the trial of {self.name} measured no step time"
        return self.step_s

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["plan"] = self.plan.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialRecord:
        return cls(**{**data, "plan": ParallelPlan.from_dict(data["plan"]), "steps": tuple(data.get("steps", ()))})


@dataclass(frozen=True)
class Selection:
    """What measured selection decided, and why."""

    plan: ParallelPlan
    trials: tuple[TrialRecord, ...]
    memory_budget_bytes: int
    calibration: Calibration | None = None
    seconds: float = 0.0
    note: str = ""
    from_cache: bool = False
    cache_file: str | None = None
    #: What the runtime profiler saw in the trials (rank 0 only; not cached): what the calibration was fitted to.
    observations: tuple[Observation, ...] = ()

    @property
    def chosen(self) -> TrialRecord | None:
        return next((t for t in self.trials if t.plan == self.plan and t.step_s is not None), None)

    @property
    def runner_up(self) -> TrialRecord | None:
        """The fastest measured plan that fits, other than the chosen one."""
        others = [t for t in self.trials if t.plan != self.plan and t.fits(self.memory_budget_bytes)]
        return min(others, key=lambda t: t.measured_step_s) if others else None

    def report(self) -> str:
        source = (
            f"from the cache {self.cache_file}"
            if self.from_cache
            else f"{len(self.trials)} plans tried in {self.seconds:.1f} s"
        )
        lines = [f"Galvatron: measured selection ({source})"]
        rows = [("candidate", "plan", "predicted", "calibrated", "measured", "peak/rank", "")]
        for t in self.trials:
            status = (
                "chosen"
                if t.plan == self.plan
                else (
                    "failed"
                    if t.step_s is None
                    else "stopped"
                    if t.stopped_early
                    else ""
                    if t.fits(self.memory_budget_bytes)
                    else "does not fit"
                )
            )
            rows.append(
                (
                    t.name,
                    plan_summary(t.plan),
                    f"{t.predicted_step_s * 1e3:.1f} ms",
                    "-" if t.calibrated_step_s is None else f"{t.calibrated_step_s * 1e3:.1f} ms",
                    "-" if t.step_s is None else f"{t.step_s * 1e3:.1f} ms",
                    "-" if t.peak_bytes is None else format_bytes(t.peak_bytes),
                    status,
                )
            )
        lines.append(text_table(rows))
        for t in self.trials:
            if t.error:
                lines.append(f"{t.name} failed: {t.error}")
        if self.calibration is not None:
            lines.append(f"cost model calibrated from the trials: {self.calibration.describe()}")
        if self.note:
            lines.append(self.note)
        chosen = self.chosen
        if chosen is not None:
            searched = next((t for t in self.trials if t.name == "searched" and t.step_s is not None), None)
            versus = ""
            if searched is not None and searched is not chosen:
                versus = f", {searched.measured_step_s / chosen.measured_step_s:.2f}x the search's plan as measured"
            lines.append(f"chosen: {chosen.name}, {chosen.measured_step_s * 1e3:.1f} ms per step measured{versus}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SELECTION_FORMAT,
            "version": SELECTION_VERSION,
            "plan": self.plan.to_dict(),
            "trials": [t.to_dict() for t in self.trials],
            "memory_budget_bytes": self.memory_budget_bytes,
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "seconds": self.seconds,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **changes: Any) -> Selection:
        if data.get("format") != SELECTION_FORMAT or data.get("version") != SELECTION_VERSION:
            raise ValueError(f"not a lightning_galvatron selection of version {SELECTION_VERSION}")
        calibration = data.get("calibration")
        return cls(
            plan=ParallelPlan.from_dict(data["plan"]),
            trials=tuple(TrialRecord.from_dict(t) for t in data["trials"]),
            memory_budget_bytes=int(data["memory_budget_bytes"]),
            calibration=None if calibration is None else Calibration.from_dict(calibration),
            seconds=float(data.get("seconds", 0.0)),
            note=str(data.get("note", "")),
            **changes,
        )


# ---------------------------------------------------------------------------------------------- cache
class SelectionCache:
    """Selections on disk next to the profiles: ``<profile cache>/selections/<key>.json``, written atomically."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = Path(directory).expanduser()  # the profile cache's
        self.directory = self.root / "selections"

    @classmethod
    def of(cls, profile_cache: bool | str | os.PathLike[str] | None) -> SelectionCache | None:
        """The cache that goes with the strategy's ``profile_cache`` (none when profiles are not cached)."""
        from lightning_galvatron.profiler.cache import default_cache_dir

        if profile_cache is True:
            return cls(default_cache_dir())
        if profile_cache is False or profile_cache is None:
            return None
        return cls(profile_cache)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> Selection | None:
        from lightning_galvatron.profiler.cache import cached_file

        path = cached_file(self.root, f"selections/{key}.json")
        try:
            return Selection.from_dict(json.loads(path.read_text()), from_cache=True, cache_file=str(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError, TypeError, KeyError) as err:
            warnings.warn(f"ignoring the cached selection {path} ({err}); measuring again", stacklevel=2)
            return None

    def save(self, key: str, selection: Selection) -> Path | None:
        """Where it was written: here, or -- the directory not writable -- where the profiles went instead."""
        from lightning_galvatron.profiler.cache import write_to_cache

        return write_to_cache(self.root, f"selections/{key}.json", json.dumps(selection.to_dict(), indent=1) + "\n")


def unfit_selection(selection: Selection, searched: ParallelPlan, check: Callable[[ParallelPlan], None]) -> str | None:
    """Why a cached selection cannot train the live model -- a file edited, copied or written for another model
    under this key -- or ``None``. A cache is a hint: what does not fit is measured again, never refused."""
    plan = selection.plan
    if plan.world_size != searched.world_size:
        return f"its plan is for {plan.world_size} devices, not {searched.world_size}"
    if plan.num_layers != searched.num_layers:
        return f"its plan has {plan.num_layers} layer strategies but the model has {searched.num_layers} blocks"
    try:
        check(plan)
    except ValueError as err:
        return f"its plan cannot run on this model ({err})"
    return None


def selection_key(profile: Profile, search_arguments: Mapping[str, Any], settings: TrialSettings) -> str:
    """What a selection depends on: the profile's content, the search's arguments, the trial settings."""
    arguments = dict(search_arguments)
    calibration = arguments.get("calibration")
    arguments["calibration"] = calibration.to_dict() if isinstance(calibration, Calibration) else calibration
    arguments["disable"] = sorted(arguments.get("disable") or ())
    content = {
        "version": SELECTION_VERSION,
        "profile": hashlib.sha256(json.dumps(profile.to_dict(), sort_keys=True).encode()).hexdigest(),
        "search": arguments,
        "trials": settings.to_dict(),
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------- the selection
def select_by_measurement(
    auto: AutoPlan,
    runner: CandidateRunner,
    settings: TrialSettings,
    *,
    cache: SelectionCache | None,
    check: Callable[[ParallelPlan], None],
    report: Callable[[str], None],
    progress: Callable[[str], None] = lambda where: None,
) -> Selection:
    """Try the candidates of what ``plan="auto"`` searched and choose by measurement. Collective: every rank calls
    it and gets the same selection.

    Args:
        check: raises for a plan the runtime cannot execute on this model (such candidates are left out).
        report: prints on rank 0. progress: tells the rank monitor where this rank is.
    """
    started = time.perf_counter()
    rank = dist.get_rank()
    key = selection_key(auto.profile, auto.search_arguments, settings) if rank == 0 else ""  # rank 0's cache
    found: list[Any] = [None]
    if rank == 0 and cache is not None:
        cached = cache.load(key)
        problem = None if cached is None else unfit_selection(cached, auto.plan, check)
        if cached is not None and problem is not None:
            warnings.warn(
                f"ignoring the cached selection {cached.cache_file}: {problem}; measuring again and overwriting it",
                stacklevel=2,
            )
            cached = None
        found = [None if cached is None else (cached.to_dict(), cached.cache_file)]
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        data, file = found[0]
        return Selection.from_dict(data, from_cache=True, cache_file=file)

    with preserved_rng(runner.device):
        selection = _select(auto, runner, settings, check, report, progress, started)
    if rank == 0 and cache is not None and (path := cache.save(key, selection)) is not None:
        selection = dataclasses.replace(selection, cache_file=str(path))
    return selection


def _select(
    auto: AutoPlan,
    runner: CandidateRunner,
    settings: TrialSettings,
    check: Callable[[ParallelPlan], None],
    report: Callable[[str], None],
    progress: Callable[[str], None],
    started: float,
) -> Selection:
    rank = dist.get_rank()
    budget = auto.memory_budget_bytes
    proposals: list[Any] = [None]
    if rank == 0:
        assert auto.search_result is not None, "rank 0's AutoPlan carries the search's result"
        proposed = diverse_candidates(
            auto.profile, auto.search_result, auto.search_arguments, max_candidates=settings.max_candidates
        )
        executable = []
        for c in proposed:
            try:
                check(c.plan)
            except ValueError:
                continue
            executable.append((c.name, c.plan.to_dict(), c.estimate.step_time_s, c.estimate.peak_memory_bytes))
        proposals = [executable]
    dist.broadcast_object_list(proposals, src=0)
    # (name, plan, predicted step time, predicted peak) of each candidate, the same on every rank.
    candidates: list[tuple[str, ParallelPlan, float, float]] = [
        (name, ParallelPlan.from_dict(plan), step, peak) for name, plan, step, peak in proposals[0]
    ]

    records: list[TrialRecord] = []
    observations: list[Observation] = []

    def trial(index: int, name: str, plan: ParallelPlan, predicted_step: float, predicted_peak: float) -> None:
        progress(f"setup: trial {index} ({name})")
        fastest = min((t.measured_step_s for t in records if t.fits(budget)), default=None)
        stop_above = None if fastest is None else SLOWER_THAN_FASTEST * fastest
        measurement, seen = runner.run(plan, settings, stop_above=stop_above)
        # A trial stopped early is fitted too: its one step after the warm-up prices it 0-20% high, but without
        # it the mechanisms only slow plans use (ZeRO, tensor parallelism) kept the prior's terms against a
        # compute scale fitted to other plans, and were priced 25-45% too fast.
        observations.extend(seen)
        records.append(_record(name, plan, predicted_step, predicted_peak, measurement))
        report(
            _progress_line(
                f"{index}/{len(candidates)}" if index <= len(candidates) else str(index), records[-1], budget
            )
        )

    for index, (name, plan, step, peak) in enumerate(candidates, 1):
        # The next trial while the budget lasts.
        go = [index == 1 or _within_budget(started, settings.budget_s)]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            break
        trial(index, name, plan, step, peak)

    calibration, note = None, ""
    extra: list[Any] = [None]
    if rank == 0:
        calibration, extra[0], note = _calibrate_and_search(auto, observations, records, started, settings)
    dist.broadcast_object_list(extra, src=0)
    if extra[0] is not None:
        name, plan, step, peak = extra[0]
        trial(len(records) + 1, name, ParallelPlan.from_dict(plan), step, peak)
    _confirm_close_calls(records, runner, settings, budget, started, report, progress)

    decision: list[Any] = [None]
    if rank == 0:
        decision = [_decide(auto, records, calibration, budget, note, time.perf_counter() - started).to_dict()]
    dist.broadcast_object_list(decision, src=0)
    return Selection.from_dict(decision[0], observations=tuple(observations))


#: The fastest plan and its runner-up are measured again when the runner-up is within this factor of the fastest
#: (by measurement, or else by the cost model's price: :func:`close_call`).
CLOSE_CALL = 1.25
#: A close call's second trials time this many times the timed steps of the first.
CONFIRM_STEPS = 3
#: A trial whose timed step is this many times the fastest plan's so far stops: the plan cannot win.
SLOWER_THAN_FASTEST = 2.0
#: The calibrated search runs once this many plans were measured (fewer leave most of its terms unfitted).
CALIBRATE_FROM = 3


def close_call(records: list[TrialRecord], budget: int) -> list[TrialRecord]:
    """The fastest fitting plan and the one to measure again beside it, or ``[]``: the runner-up where it measured
    within :data:`CLOSE_CALL` of the fastest; else the plan the cost model priced closest to the fastest, where
    that is within :data:`CLOSE_CALL` of the fastest's price -- the measurement contradicts the model, and one
    disturbed trial can do that (docs/performance.md has a trial a third slower than the plan then trained)."""
    measured = sorted((t for t in records if t.fits(budget) and not t.stopped_early), key=lambda t: t.measured_step_s)
    if len(measured) < 2:
        return []
    fastest, others = measured[0], measured[1:]
    if others[0].measured_step_s <= CLOSE_CALL * fastest.measured_step_s:
        return [fastest, others[0]]
    priced = min(others, key=lambda t: t.predicted_step_s)
    return [fastest, priced] if priced.predicted_step_s <= CLOSE_CALL * fastest.predicted_step_s else []


def _confirm_close_calls(
    records: list[TrialRecord],
    runner: CandidateRunner,
    settings: TrialSettings,
    budget: int,
    started: float,
    report: Callable[[str], None],
    progress: Callable[[str], None],
) -> None:
    """For a :func:`close_call`, try both plans once more (time permitting) with :data:`CONFIRM_STEPS` times the
    timed steps and keep the median of each one's steps of both trials: a disturbance of one trial cannot decide
    alone, and plans a few percent apart need more steps than a step's noise on a shared machine. Repeated while the
    close call names a plan not measured again yet: the second trials reorder the plans, and a plan tried once must
    not win because the two it trailed were measured again and came out slower (docs/performance.md)."""
    confirmed: set[int] = set()  # indices into records: each plan is measured again at most once
    longer = dataclasses.replace(settings, timed_steps=CONFIRM_STEPS * settings.timed_steps)
    while True:
        # The same on every rank: every rank holds the same records.
        fresh = [i for i in map(records.index, close_call(records, budget)) if i not in confirmed]
        if not fresh:
            return
        go = [dist.get_rank() == 0 and _within_budget(started, settings.budget_s)]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            return
        for index in reversed(fresh):  # the runner-up first: the machine warms up over the trials
            confirmed.add(index)
            first = records[index]
            progress(f"setup: trial of {first.name} again")
            again, _ = runner.run(first.plan, longer, observe=False)
            if again.step_s is not None:
                peaks = [p for p in (first.peak_bytes, again.peak_bytes) if p is not None]
                steps = (*first.steps, *again.steps)
                records[index] = dataclasses.replace(
                    first,
                    step_s=statistics.median(steps),
                    steps=steps,
                    seconds=first.seconds + again.seconds,
                    peak_bytes=max(peaks) if peaks else None,
                )
            report(
                f"Galvatron: trial of {first.name} again: "
                f"{'failed' if again.step_s is None else f'{again.step_s * 1e3:.1f} ms per step'}"
            )


def _record(name: str, plan: ParallelPlan, step: float, peak: float, m: Measurement) -> TrialRecord:
    return TrialRecord(
        name,
        plan,
        step,
        peak,
        m.step_s,
        m.peak_bytes,
        m.seconds,
        m.error,
        stopped_early=m.stopped_early,
        steps=m.steps,
    )


def _within_budget(started: float, budget_s: float) -> bool:
    """Whether another trial may start: trials start while the budget lasts (the last one may end after it; a slow
    plan's trial stops early, see SLOWER_THAN_FASTEST)."""
    return time.perf_counter() - started < budget_s


def _calibrate_and_search(
    auto: AutoPlan,
    observations: list[Observation],
    records: list[TrialRecord],
    started: float,
    settings: TrialSettings,
) -> tuple[Calibration | None, tuple[str, dict[str, Any], float, float] | None, str]:
    """Rank 0: the calibration from the trials, the plan the calibrated search picks if it is new and there is time
    to try it (name, plan as a dict, uncalibrated step time and peak), and a note for the report."""
    arguments = dict(auto.search_arguments)
    if not observations:
        return None, None, ""
    measured = [t.plan for t in records if t.step_s is not None]
    if len(measured) < CALIBRATE_FROM:
        return None, None, ""
    # Only what the trials measured: the calibration prices anything else too cheaply (see unmeasured).
    arguments["disable"] = frozenset(arguments.get("disable") or ()) | unmeasured(measured)
    arguments.update(search_batch_size=False, global_batch_size=measured[0].global_batch_size)
    try:
        calibration = fit_calibration(
            auto.profile,
            observations,
            precision=arguments["precision"],
            optimizer=arguments["optimizer"],
            source="measured selection trials",
            prior=profile_calibration(auto.profile),  # what the trials cannot tell apart or did not run
        )
        result = search(auto.profile, **{**arguments, "calibration": calibration, "baselines": False})
    except ValueError as err:
        return None, None, f"the calibrated search failed: {err}"
    tried = {executed(t.plan) for t in records}
    if executed(result.plan) in tried:
        return calibration, None, "the calibrated search picks a plan already tried"
    if not _within_budget(started, settings.budget_s):
        return calibration, None, f"the calibrated search picks {plan_summary(result.plan)}, not tried: no time left"
    plan = result.plan
    uncalibrated = evaluate(auto.profile, plan, optimizer=arguments["optimizer"], precision=arguments["precision"])
    return (
        calibration,
        ("calibrated search", plan.to_dict(), uncalibrated.step_time_s, uncalibrated.peak_memory_bytes),
        "",
    )


def _decide(
    auto: AutoPlan,
    records: list[TrialRecord],
    calibration: Calibration | None,
    budget: int,
    note: str,
    seconds: float,
) -> Selection:
    """Rank 0: the fastest measured plan that fits; else the least memory measured; else the search's plan."""
    if calibration is not None:
        arguments = auto.search_arguments
        priced = []
        for t in records:
            try:
                estimate = evaluate(
                    auto.profile,
                    t.plan,
                    optimizer=arguments["optimizer"],
                    precision=arguments["precision"],
                    calibration=calibration,
                )
                priced.append(dataclasses.replace(t, calibrated_step_s=estimate.step_time_s))
            except ValueError:
                priced.append(t)
        records = priced
    fitting = [t for t in records if t.fits(budget)]
    measured = [t for t in records if t.step_s is not None]
    if fitting:
        fastest = min(fitting, key=lambda t: t.measured_step_s)
        chosen = simplest_within_resolution(fastest, fitting)
        plan = chosen.plan
        if chosen is not fastest:
            note = (note + "; " if note else "") + (
                f"{fastest.name} measured {fastest.measured_step_s * 1e3:.1f} ms per step, "
                f"{chosen.name} {chosen.measured_step_s * 1e3:.1f} ms: "
                "closer than the trials can tell apart, so the simpler plan is trained"
            )
    elif measured:
        least = min(measured, key=lambda t: t.peak_bytes if t.peak_bytes is not None else float("inf"))
        plan = least.plan
        note = (note + "; " if note else "") + (
            f"no tried plan's measured peak fits the budget of {format_bytes(budget)}: training the one that "
            "needed the least"
        )
    else:
        plan = auto.plan
        note = (note + "; " if note else "") + "every trial failed: training the search's plan"
    return Selection(plan, tuple(records), budget, calibration, seconds, note)


def _progress_line(index: str, t: TrialRecord, budget: int) -> str:
    head = f"Galvatron: trial {index} {t.name} ({plan_summary(t.plan)}): "
    if t.step_s is None:
        return head + f"failed ({t.error}) [{t.seconds:.1f} s]"
    if t.stopped_early:
        stopped = f"over {SLOWER_THAN_FASTEST:g}x the fastest: stopped"
        return head + f"{t.step_s * 1e3:.1f} ms per step, {stopped} [{t.seconds:.1f} s]"
    peak = (
        ""
        if t.peak_bytes is None
        else f", peak {format_bytes(t.peak_bytes)}" + ("" if t.peak_bytes <= budget else " (over the budget)")
    )
    return (
        head
        + f"{t.step_s * 1e3:.1f} ms per step (predicted {t.predicted_step_s * 1e3:.1f} ms){peak} [{t.seconds:.1f} s]"
    )


__all__ = ["Selection", "SelectionCache", "TrialRecord", "select_by_measurement", "selection_key"]
