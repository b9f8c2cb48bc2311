"""One Lightning step as micro-batches: the strategy's steps when the plan has a runner (micro-batches or a
pipeline). Lightning glue around the runtime's step (:func:`~lightning_galvatron.runtime.step.run_batch`, which the
trials and the dry run run too): the hooks Lightning would call around backward (zeroing at an accumulation window's
start, ``on_after_backward`` once per step), ``self.log`` calls recorded per micro-batch and replayed, torchmetrics,
and the batch arranged for losses that are token means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer import call
from torch.optim import Optimizer

from lightning_galvatron.runtime.apply import AppliedPlan
from lightning_galvatron.runtime.pipeline import join_micro_batches
from lightning_galvatron.runtime.step import from_last_stage, mean_loss, run_batch
from lightning_galvatron.strategy.metrics import StepMetrics
from lightning_galvatron.strategy.step_logs import recording_logs, replay_logs
from lightning_galvatron.strategy.token_means import arranged_for_token_means


def run_micro_batches(
    applied: AppliedPlan,
    module: LightningModule,
    hook: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    optimizers: Sequence[Optimizer],
    device: torch.device,
    precision_context: Callable[[], AbstractContextManager[Any]],
    loss_context: Callable[[], AbstractContextManager[Any]],
) -> Any:
    """The Lightning step ``hook`` (``"training_step"``, ...) of ``module`` on the batch of ``args`` as micro-batches
    through ``applied``'s runner (and the pipeline schedule).

    ``precision_context`` is entered around each micro-batch's step, ``loss_context`` (``loss_parallel`` with
    vocabulary parallelism) around the whole, backward included. Returns the mean loss (training, validation, test)
    or the micro-batches' predictions joined along the batch (predict), as the last stage computed them, on every
    rank, on ``device``.
    """
    assert applied.runner is not None
    trainer = module.trainer
    batch, rest = args[0], args[1:]
    if hook != "predict_step":  # predictions keep the loader's order
        batch = arranged_for_token_means(batch, applied, applied.plan.micro_batches)
    user_step = getattr(module, hook)
    train = hook == "training_step"
    if train:
        _zero_grad_at_window_start(optimizers, trainer, rest[0] if rest else 0)

    def step(micro_batch: Any) -> Any:
        with precision_context():
            return user_step(micro_batch, *rest, **kwargs)

    metrics = StepMetrics.of(module)
    with (
        recording_logs(module) as logs,
        loss_context(),
        metrics.running(module, applied.partition is not None) if hook != "predict_step" else nullcontext(),
    ):
        outputs = run_batch(applied, batch, step, train=train, accumulation=trainer.accumulate_grad_batches)
    if hook == "predict_step":
        joined = join_micro_batches(outputs) if outputs else None  # the last stage's (empty elsewhere)
        return move_data_to_device(from_last_stage(applied, joined), device)
    loss, records, metrics_summary = from_last_stage(applied, (mean_loss(outputs), logs.averaged(), metrics.summary()))
    metrics.finish(metrics_summary)  # before the logs: a logged Metric's on-step value
    replay_logs(module, records, device)
    if train:
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
    return None if loss is None else torch.tensor(loss, device=device)


def step_args_for_token_means(args: tuple[Any, ...], applied: AppliedPlan) -> tuple[Any, ...]:
    """A step's arguments without micro-batches: the shard's batch makes one loss (see :mod:`token_means`)."""
    return (arranged_for_token_means(args[0], applied, 1), *args[1:]) if args else args


def _zero_grad_at_window_start(optimizers: Sequence[Optimizer], trainer: Trainer, batch_idx: int) -> None:
    """What Lightning does before backward, at the first batch of each accumulation window."""
    if batch_idx % trainer.accumulate_grad_batches:
        return
    for optimizer in optimizers:
        call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
        call._call_lightning_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)
