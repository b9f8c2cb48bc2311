"""What measured selection may spend (``GalvatronStrategy(trials=...)``), what runs a trial and what it measured, and
the random state kept around the trials. Lightning-free (the trials themselves run in
:mod:`lightning_galvatron.strategy.trials`)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from lightning_galvatron.plan import ParallelPlan
    from lightning_galvatron.search.calibration import Observation


@dataclass(frozen=True)
class TrialSettings:
    """How much measured selection may spend (``GalvatronStrategy(trials=...)``).

    Attributes:
        budget_s: wall-clock seconds for all trials together: the search's best plan is always tried, the next
            candidates are started while the budget lasts (the last may end after it).
        warmup_steps, timed_steps: untimed and timed training steps per trial.
        max_candidates: plans tried at most (the search's best, the best of other kinds, the uniform plans).
        measure_memory: measure each trial's peak memory per rank (a plan over the budget is not chosen).
    """

    budget_s: float = 20.0
    warmup_steps: int = 1
    timed_steps: int = 3
    max_candidates: int = 8
    measure_memory: bool = True

    def __post_init__(self) -> None:
        if (
            isinstance(self.budget_s, bool)
            or not isinstance(self.budget_s, (int, float))
            or not 0 < self.budget_s < math.inf
        ):
            raise ValueError(f"trials budget_s must be a positive number of seconds, got {self.budget_s!r}")
        for name, least in (("warmup_steps", 0), ("timed_steps", 1), ("max_candidates", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"trials {name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.measure_memory, bool):
            raise ValueError(f"trials measure_memory must be True or False, got {self.measure_memory!r}")

    @classmethod
    def of(cls, value: bool | float | Mapping[str, Any] | TrialSettings | None) -> TrialSettings | None:
        """``True``: the defaults; ``False``/``None``: no trials; a number: the budget in seconds; a dict: fields."""
        if value is True:
            return cls()
        if value is False or value is None:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, (int, float)):
            return cls(budget_s=value)
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise ValueError(f"unknown trials settings {sorted(unknown)}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(
            f"trials must be True, False, a budget in seconds or a dict of {sorted(f.name for f in fields(cls))}, "
            f"got {value!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Measurement:
    """What a trial measured, the same on every rank."""

    step_s: float | None  # the median timed step (each the slowest rank's); None: the trial failed
    peak_bytes: int | None  # the largest peak over the ranks; None: not measured
    seconds: float  # the whole trial: copying, applying the plan, all its steps
    error: str | None = None
    stopped_early: bool = False  # a timed step was so slow that the plan could not win; memory not measured
    steps: tuple[float, ...] = ()  # every timed step (each the slowest rank's)


class CandidateRunner(Protocol):
    """What measured selection needs of the side that trains candidates
    (:class:`lightning_galvatron.strategy.trials.TrialRunner` under the strategy): the device, and a trial of one
    plan."""

    device: torch.device

    def run(
        self, plan: ParallelPlan, settings: TrialSettings, observe: bool = True, stop_above: float | None = None
    ) -> tuple[Measurement, list[Observation]]:
        """Train ``plan`` for a few steps (collective: every rank, the same plans in the same order); its measurement
        (the same on every rank) and, on rank 0 when ``observe``, what the runtime profiler saw on every rank."""
        ...


class TrialUnavailable(RuntimeError):
    """Trials cannot run for this module or data (the message says why); the search's plan is used."""


@contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore torch's (CPU and CUDA), numpy's and Python's random states on exit."""
    import numpy as np

    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


__all__ = ["CandidateRunner", "Measurement", "TrialSettings", "TrialUnavailable", "preserved_rng"]
