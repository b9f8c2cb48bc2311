"""Logging from micro-batched and pipelined steps.

With micro-batches the user's step runs several times per Lightning step, and with a pipeline its
end (where the loss is computed and logged) runs on the last stage only. ``self.log`` calls are
therefore recorded while the step runs, averaged over the micro-batches (every micro-batch has the
same number of samples, so the mean of means is the mean), handed from the last stage to the
others, and replayed once on every rank inside Lightning's own step. Every rank then logs the
same values in the same order -- ``sync_dist`` collectives match, and ``ModelCheckpoint``,
``EarlyStopping`` and the progress bar agree everywhere. A logged torchmetrics ``Metric`` is replayed as
itself, found by its name in the module on every rank (:mod:`lightning_galvatron.strategy.metrics` gives it the
step's value and syncs it).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import Metric


@dataclass(frozen=True)
class LoggedMetric:
    """A ``Metric`` logged in the step: its name in the module (the same on every rank)."""

    path: str


@dataclass
class LogRecord:
    name: str
    values: list[float]
    kwargs: dict[str, Any]
    metric: LoggedMetric | None = None  # a Metric is logged as itself, once per step


@dataclass
class RecordedLogs:
    records: dict[str, LogRecord] = field(default_factory=dict)
    metric_paths: dict[int, str] = field(default_factory=dict)  # id(metric) -> its name in the module

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:  # options given by position: by name, as replay_logs passes them
            options = inspect.signature(LightningModule.log).bind(None, name, value, *args, **kwargs).arguments
            kwargs = {key: option for key, option in options.items() if key not in ("self", "name", "value")}
        if isinstance(value, Metric):
            if id(value) not in self.metric_paths:
                raise TypeError(
                    f"self.log({name!r}, {type(value).__name__}): the metric must be an attribute of the "
                    "LightningModule (e.g. self.val_acc = MulticlassAccuracy(...)) to be logged on every rank"
                )
            self.records[name] = LogRecord(name, [], kwargs, LoggedMetric(self.metric_paths[id(value)]))
            return
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

    def averaged(self) -> list[tuple[str, float | LoggedMetric, dict[str, Any]]]:
        return [
            (r.name, r.metric if r.metric is not None else sum(r.values) / len(r.values), r.kwargs)
            for r in self.records.values()
        ]


@contextmanager
def recording_logs(module: nn.Module) -> Iterator[RecordedLogs]:
    """Capture ``module.log`` calls (``log_dict`` goes through ``log``) while the block runs."""
    recorded = RecordedLogs(metric_paths={id(m): name for name, m in module.named_modules() if isinstance(m, Metric)})
    module.log = recorded.log  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        del module.log


def replay_logs(
    module: nn.Module, logs: list[tuple[str, float | LoggedMetric, dict[str, Any]]], device: torch.device
) -> None:
    for name, value, kwargs in logs:
        if isinstance(value, LoggedMetric):
            module.log(name, module.get_submodule(value.path), **kwargs)
        else:
            module.log(name, torch.tensor(value, device=device), **kwargs)
