"""Logging from micro-batched and pipelined steps.

With micro-batches the user's step runs several times per Lightning step, and with a pipeline its
end (where the loss is computed and logged) runs on the last stage only. ``self.log`` calls are
therefore recorded while the step runs, averaged over the micro-batches (every micro-batch has the
same number of samples, so the mean of means is the mean), handed from the last stage to the
others, and replayed once on every rank inside Lightning's own step. Every rank then logs the
same values in the same order -- ``sync_dist`` collectives match, and ``ModelCheckpoint``,
``EarlyStopping`` and the progress bar agree everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class LogRecord:
    name: str
    values: list[float]
    kwargs: dict[str, Any]


@dataclass
class RecordedLogs:
    records: dict[str, LogRecord] = field(default_factory=dict)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("pass the options of self.log() by keyword under micro-batching")
        if isinstance(value, torch.Tensor):
            number = float(value.detach().float().mean())
        elif isinstance(value, (int, float)):
            number = float(value)
        else:
            raise TypeError(
                f"self.log({name!r}, {type(value).__name__}) cannot be averaged over micro-batches or pipeline stages; "
                "log a tensor or a number (for a torchmetrics metric: update it and log metric.compute())"
            )
        record = self.records.setdefault(name, LogRecord(name, [], kwargs))
        record.values.append(number)

    def averaged(self) -> list[tuple[str, float, dict[str, Any]]]:
        return [(r.name, sum(r.values) / len(r.values), r.kwargs) for r in self.records.values()]


@contextmanager
def recording_logs(module: nn.Module) -> Iterator[RecordedLogs]:
    """Capture ``module.log`` calls (``log_dict`` goes through ``log``) while the block runs."""
    recorded = RecordedLogs()
    module.log = recorded.log  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        del module.log


def replay_logs(module: nn.Module, logs: list[tuple[str, float, dict[str, Any]]], device: torch.device) -> None:
    for name, value, kwargs in logs:
        module.log(name, torch.tensor(value, device=device), **kwargs)
