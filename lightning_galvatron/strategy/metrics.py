"""torchmetrics ``Metric`` objects under a plan: updated where the outputs are, synced as under DDP.

Under DDP each rank updates its metrics with the outputs of its own samples; ``self.log(name, metric)`` logs, on
step, the value of the step's call (``metric(preds, target)``, synced over the world with ``dist_sync_on_step``)
and, on epoch, ``compute()``: an all-gather of every rank's states over the world. Under a plan several ranks share
one data shard -- the tensor-parallel ranks of a stage compute the same outputs, and with a pipeline only the last
stage runs the step to its end -- and a step may run as several micro-batches. So:

- ``compute()`` still all-gathers over the world, as torchmetrics does, but reduces the states of one rank per data
  shard, taken on the last stage (:class:`OneRankPerDataShard`, the metrics' ``dist_sync_fn``): no sample counts
  twice, and stages that never saw the outputs count not at all;
- a step run as micro-batches calls a metric once per micro-batch; :class:`StepMetrics` gives its on-step value
  over the whole step (a copy of the metric updated alongside it, as ``forward`` does for one call), synced at
  the step's end, where every rank takes part, when ``dist_sync_on_step``; with a pipeline the last stage hands
  the value and the metric's update count to the other stages, so every rank logs the same.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.plan.layout import Layout
from lightning_galvatron.runtime.stage import PipelineUsageError

_pipeline_running = False  # inside a pipeline schedule only some ranks run a step's code: no world collective


class OneRankPerDataShard:
    """A metric's ``dist_sync_fn``: all-gather over the world, keep the states of one rank per data shard."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks

    def __call__(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        if _pipeline_running:
            raise PipelineUsageError(
                "a torchmetrics Metric was computed (and synced over all ranks) inside a step run by a pipeline, "
                "where only the last stage reaches the end of the step: log the Metric object itself "
                "(self.log(name, metric)) or compute it in on_train_epoch_end / on_validation_epoch_end"
            )
        gathered = gather_all_tensors(tensor, group)
        return [gathered[rank] for rank in self.ranks]


def sync_metrics_over_data_shards(module: nn.Module, plan: ParallelPlan) -> None:
    """Make the module's metrics reduce one state per data shard of ``plan`` (torchmetrics' default where every rank
    is its own shard). A metric given its own ``dist_sync_fn`` or ``process_group`` is left alone."""
    layout = Layout.of(plan, plan.vocab)  # the input layout: its dp groups are the data shards
    ranks = [layout.rank(plan.pp - 1, shard, 0) for shard in range(layout.dp)]
    sync = OneRankPerDataShard(ranks) if layout.dp < plan.world_size else None
    for metric in module.modules():
        if not isinstance(metric, Metric) or metric.process_group is not None:
            continue
        if metric.dist_sync_fn is None or isinstance(metric.dist_sync_fn, OneRankPerDataShard):
            metric.dist_sync_fn = sync


@contextmanager
def metric_states_kept(module: nn.Module) -> Iterator[None]:
    """Steps run on the module outside Lightning's loop (profiling, tracing for a pipeline) leave its metrics as they
    were: DDP's first epoch counts only its own samples. States go back to wherever the module moved meanwhile."""
    saved = [
        (metric, metric._copy_state_dict(), metric._update_count, metric._forward_cache, metric._computed)
        for metric in module.modules()
        if isinstance(metric, Metric)
    ]
    try:
        yield
    finally:
        for metric, states, count, forward_cache, computed in saved:
            for attr, value in states.items():
                setattr(metric, attr, move_data_to_device(value, metric.device))
            metric._update_count, metric._forward_cache, metric._computed = count, forward_cache, computed


class StepMetrics:
    """The module's metrics over one Lightning step run as micro-batches (see the module docstring)."""

    _of: weakref.WeakKeyDictionary[nn.Module, StepMetrics] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._copies: dict[str, Metric] = {}  # per metric: updated with the step's calls only

    @classmethod
    def of(cls, module: nn.Module) -> StepMetrics:
        """The module's (its step copies are made once)."""
        if module not in cls._of:
            cls._of[module] = cls()
        return cls._of[module]

    @contextmanager
    def running(self, module: nn.Module, pipeline: bool) -> Iterator[None]:
        """While the micro-batches run: every call of a metric also updates its step copy; nothing syncs."""
        global _pipeline_running
        self._metrics = {name: m for name, m in module.named_modules() if isinstance(m, Metric) and m._defaults}
        self._counts = {name: m._update_count for name, m in self._metrics.items()}
        self._sync_on_step = {name: m.dist_sync_on_step for name, m in self._metrics.items()}
        hooks = []
        for name, metric in self._metrics.items():
            if name not in self._copies:
                self._copies[name] = copy.deepcopy(metric)
            self._copies[name].reset()
            self._copies[name].dist_sync_fn = metric.dist_sync_fn  # the plan's, which may have changed
            metric.dist_sync_on_step = False  # synced once, over the whole step, after it
            hooks.append(metric.register_forward_hook(self._also_update(name), with_kwargs=True))
        _pipeline_running = pipeline
        try:
            yield
        finally:
            _pipeline_running = False
            for handle in hooks:
                handle.remove()
            for name, metric in self._metrics.items():
                metric.dist_sync_on_step = self._sync_on_step[name]

    def _also_update(self, name: str) -> Any:
        def hook(metric: Metric, args: tuple, kwargs: dict, output: Any) -> None:
            self._copies[name].update(*args, **kwargs)

        return hook

    def summary(self) -> dict[str, tuple[int, bool, Any]]:
        """What the step did to each metric it updated: ``(update count, called, on-step value)``; the value is
        ``None`` where it is synced over the ranks (:meth:`finish`, on every rank). Meaningful on the last stage."""
        out = {}
        for name, metric in self._metrics.items():
            if metric._update_count == self._counts[name]:
                continue
            called = self._copies[name]._update_count > 0
            value = None
            if called and not self._sync_on_step[name]:
                value = move_data_to_device(_value(self._copies[name], sync=False), "cpu")
            out[name] = (metric._update_count, called, value)
        return out

    def finish(self, summary: dict[str, tuple[int, bool, Any]]) -> None:
        """Every rank: the step's update counts and on-step values (``summary``, the last stage's); values to sync
        are computed here, on every rank in the same order (ranks off the last stage take part with empty states)."""
        for name, metric in self._metrics.items():
            if name not in summary:
                continue
            count, called, value = summary[name]
            if metric._update_count != count:  # another stage ran the step's end
                metric._update_count, metric._computed = count, None
            if not called:
                continue
            step_copy = self._copies[name]
            if value is None:
                step_copy._update_count = max(step_copy._update_count, 1)  # empty off the last stage: no warning
                value = _value(step_copy, sync=True)
            metric._forward_cache = move_data_to_device(value, metric.device)


def _value(metric: Metric, sync: bool) -> Any:
    """``metric.compute()``, synced over the ranks or not (``forward`` computes its value so)."""
    metric._to_sync = sync
    try:
        return metric.compute()
    finally:
        metric._to_sync, metric._computed = metric.sync_on_compute, None
