"""Predicted against measured, once training runs: the first steps of the running plan on rank 0.

The training loop adds its own work to every step (logging, callbacks, the progress bar) that neither the
cost model nor a trial counts, so the comparison is a sanity check, not a calibration: a measured step far
from the prediction says the model is off on this machine, and a runner-up of the trials that measured faster
in its trial than the running plan takes now says the choice was closer than what separates a trial from
training here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from lightning_galvatron.search.report import plan_summary


class StepClock:
    """Times training steps (start to start) and reports once, after ``skip`` + ``steps`` steps.

    Args:
        predicted_s: the running plan's predicted step time (the calibrated one when there is one).
        trial_s: its step time measured in its trial, if it had one.
        runner_up: ``(name, plan, seconds)`` of the fastest other fitting plan of the trials.
        report: where the line goes (rank 0's output).
    """

    def __init__(
        self,
        predicted_s: float | None,
        trial_s: float | None,
        runner_up: tuple[str, object, float] | None,
        report: Callable[[str], None],
        skip: int = 2,
        steps: int = 5,
    ) -> None:
        self.predicted_s = predicted_s
        self.trial_s = trial_s
        self.runner_up = runner_up
        self.report = report
        self.skip, self.steps = skip, steps
        self._starts: list[float] = []
        self.measured_s: float | None = None

    def step_started(self) -> None:
        if self.measured_s is not None:
            return
        self._starts.append(time.perf_counter())
        if len(self._starts) == self.skip + self.steps + 1:
            durations = [b - a for a, b in zip(self._starts[self.skip :], self._starts[self.skip + 1 :])]
            self.measured_s = statistics.median(durations)
            self.report(self.message())

    def message(self) -> str:
        assert self.measured_s is not None
        measured = self.measured_s
        first, last = self.skip + 1, self.skip + self.steps
        line = f"Galvatron: training steps {first}-{last} took {measured * 1e3:.1f} ms each (median, rank 0)"
        parts = []
        if self.predicted_s is not None:
            parts.append(f"predicted {self.predicted_s * 1e3:.1f} ms ({_ratio(measured, self.predicted_s)})")
        if self.trial_s is not None:
            parts.append(f"its trial measured {self.trial_s * 1e3:.1f} ms")
        if parts:
            line += "; " + ", ".join(parts)
        if self.runner_up is not None and self.runner_up[2] < measured:
            name, plan, seconds = self.runner_up
            line += (
                f"\nGalvatron: the runner-up of the trials, {name} ({plan_summary(plan)}), measured {seconds * 1e3:.1f} ms "
                "per step in its trial, less than this plan takes now (trials leave out the training loop's own work -- "
                "logging, callbacks -- and a busy machine disturbs them; to measure again, delete the cached selection "
                "or give trials= more timed steps)"
            )
        return line


def _ratio(measured: float, predicted: float) -> str:
    return f"measured {measured / predicted:.2f}x" if predicted > 0 else "-"


__all__ = ["StepClock"]
