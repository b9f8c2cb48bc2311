"""One Lightning step as micro-batches: the strategy's steps when the plan has a runner (micro-batches or a
pipeline). Lightning glue, kept apart from ``strategy.py`` (it calls the hooks Lightning would call around
backward: zeroing at an accumulation window's start, ``on_after_backward`` once per step).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer import call

from lightning_galvatron.metrics import StepMetrics
from lightning_galvatron.runtime.pipeline import join_micro_batches, loss_of
from lightning_galvatron.step_logs import recording_logs, replay_logs
from lightning_galvatron.token_means import arranged_for_token_means


def run_micro_batches(
    strategy: Any, hook: str, precision_context: Callable[[], AbstractContextManager], args: tuple, kwargs: dict
) -> Any:
    """One Lightning step as micro-batches through the runner (and the pipeline schedule).

    Returns the mean loss (training, validation, test) or the micro-batches' predictions joined
    along the batch (predict), as the last stage computed them, on every rank.
    """
    assert strategy._runner is not None and strategy._applied is not None and strategy.plan is not None
    module = strategy.lightning_module
    trainer = module.trainer
    batch, rest = args[0], args[1:]
    if hook != "predict_step":  # predictions keep the loader's order
        batch = arranged_for_token_means(batch, strategy._applied, strategy.plan.micro_batches)
    user_step = getattr(module, hook)
    train = hook == "training_step"
    if train:
        _zero_grad_at_window_start(strategy.optimizers, trainer, rest[0] if rest else 0)

    def step(micro_batch: Any) -> Any:
        with precision_context():
            return user_step(micro_batch, *rest, **kwargs)

    scale = 1.0 / (strategy._applied.input_shards * strategy.plan.micro_batches * trainer.accumulate_grad_batches)
    gradients = strategy._applied.gradients
    metrics = StepMetrics.of(module)
    pipeline = strategy._runner.partition is not None
    with (
        recording_logs(module) as logs,
        strategy._step_context(),
        gradients.deferred(),
        metrics.running(module, pipeline) if hook != "predict_step" else nullcontext(),
    ):  # loss_parallel covers backward too
        outputs = strategy._runner.run(batch, step, loss_scale=scale, train=train)
    if train and not gradients.is_deferred:  # once, after the last micro-batch (unless Lightning accumulates)
        gradients.reduce()
    if hook == "predict_step":
        joined = join_micro_batches(outputs) if outputs else None  # the last stage's (empty elsewhere)
        return move_data_to_device(strategy._runner.broadcast_from_last_stage(joined), strategy.root_device)
    losses = [float(loss.detach()) for loss in map(loss_of, outputs) if loss is not None]
    summary = (sum(losses) / len(losses) if losses else None, logs.averaged(), metrics.summary())
    loss, records, metrics_summary = strategy._runner.broadcast_from_last_stage(summary)
    metrics.finish(metrics_summary)  # before the logs: a logged Metric's on-step value
    replay_logs(module, records, strategy.root_device)
    if train:
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
    return None if loss is None else torch.tensor(loss, device=strategy.root_device)


def step_args_for_token_means(args: tuple, applied: Any) -> tuple:
    """A step's arguments without micro-batches: the shard's batch makes one loss (see :mod:`token_means`)."""
    return (arranged_for_token_means(args[0], applied, 1), *args[1:]) if args else args


def _zero_grad_at_window_start(optimizers: Any, trainer: Any, batch_idx: int) -> None:
    """What Lightning does before backward, at the first batch of each accumulation window."""
    if batch_idx % trainer.accumulate_grad_batches:
        return
    for optimizer in optimizers:
        call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
        call._call_lightning_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)
