"""One step under a plan: what training, the trials and the dry run run alike.

Measured selection chooses a plan by timing its step, and the dry run proves the collective order of its step; both
hold only while their step is the one that trains. So the step has one owner, free of Lightning's Trainer (it takes
the user's step as a callable): the strategy's micro-batches (:mod:`lightning_galvatron.strategy.micro_batches`) add
Lightning's hooks and logs around :func:`run_batch`; a trial (:mod:`lightning_galvatron.strategy.trials`) and a
simulated rank (:mod:`lightning_galvatron.dryrun.rank`) run :func:`train_step`, which adds what Lightning's loop does
around it (zeroing, clipping, the optimizer step).

- **The batch** (:func:`run_batch`): with one micro-batch and no pipeline, the user's step and backward; otherwise
  the plan's runner over the micro-batches (and the pipeline schedule), data-parallel gradients summed once after the
  last micro-batch (deferred, unless the caller accumulates batches itself).
- **The loss scale** (:func:`loss_scale`): gradients are summed over data shards, micro-batches and accumulated
  batches, so each loss is scaled to its share of their mean.
- **The loss reported** (:func:`mean_loss`, :func:`from_last_stage`): the micro-batches' mean, computed on the last
  pipeline stage and handed to the others.
- **Clipping** (:func:`clip_gradients`): by the global norm over every mesh of a rank's parameters and over the
  pipeline stages (:class:`NormScope`), or by value on each rank's shards; Lightning's precision plugin calls it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar, cast

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_galvatron.runtime.apply import AppliedPlan
from lightning_galvatron.runtime.clipping import clip_grad_norm_, clip_grad_value_
from lightning_galvatron.runtime.pipeline import StepFn, loss_of

#: The LightningModule methods a step enters the model through (FSDP gathers the root's parameters around each one
#: the module overrides: ``apply_plan``'s ``entry_methods``).
STEP_METHODS: Final = ("training_step", "validation_step", "test_step", "predict_step")

T = TypeVar("T")


def loss_scale(applied: AppliedPlan, accumulation: int = 1) -> float:
    """What each micro-batch's loss is multiplied by before backward: gradients are summed over the input layout's
    data shards, the plan's micro-batches and ``accumulation`` batches, so each loss counts for its share of the mean.
    """
    return 1.0 / (applied.input_shards * applied.plan.micro_batches * accumulation)


def run_batch(applied: AppliedPlan, batch: Any, step: StepFn, *, train: bool, accumulation: int = 1) -> list[Any]:
    """Run ``step`` (the user's step on one micro-batch) on this rank's ``batch`` under ``applied``; with ``train``,
    backward too, the loss scaled by :func:`loss_scale`.

    The data-parallel gradients are summed once, after the last micro-batch, unless the caller defers them itself
    (Lightning accumulating batches: then the last batch of the window sums them). Returns the step's output per
    micro-batch, on the last pipeline stage (an empty list on the others).
    """
    if applied.runner is None:  # one micro-batch, no pipeline: the gradient hooks sum during backward
        output = step(batch)
        if train:
            loss = loss_of(output)
            if loss is None:
                raise ValueError("the training step returned no loss (a tensor, or a dict with a 'loss' tensor)")
            (loss * loss_scale(applied, accumulation)).backward()
        return [output]
    gradients = applied.gradients
    with gradients.deferred():
        outputs = applied.runner.run(batch, step, loss_scale=loss_scale(applied, accumulation), train=train)
    if train and not gradients.is_deferred:
        gradients.reduce()
    return outputs


def mean_loss(outputs: Sequence[Any]) -> float | None:
    """The mean of the micro-batches' losses (``None`` where there are none: a stage before the last)."""
    losses = [float(loss.detach()) for loss in map(loss_of, outputs) if loss is not None]
    return sum(losses) / len(losses) if losses else None


def from_last_stage(applied: AppliedPlan, value: T) -> T:
    """The last pipeline stage's ``value`` on every stage (collective over the pipeline group; else ``value``)."""
    return cast("T", applied.runner.broadcast_from_last_stage(value)) if applied.runner is not None else value


def train_step(
    applied: AppliedPlan,
    optimizers: Sequence[Optimizer],
    batch: Any,
    step: StepFn,
    *,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    after_backward: Callable[[], None] | None = None,
    clip: Callable[[Optimizer], None] | None = None,
) -> None:
    """One optimizer step as ``GalvatronStrategy`` trains it under Lightning (without accumulation): gradients zeroed,
    :func:`run_batch` inside ``context`` (e.g. ``loss_parallel``, which backward needs too), with a runner the mean
    loss handed from the last stage, then ``after_backward()``, ``clip(optimizer)`` (Lightning's
    ``configure_gradient_clipping``) and the step of every optimizer.
    """
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    with context():
        outputs = run_batch(applied, batch, step, train=True)
    if applied.runner is not None:  # as the strategy's micro-batches report the loss (one collective)
        from_last_stage(applied, mean_loss(outputs))
    if after_backward is not None:
        after_backward()
    for optimizer in optimizers:
        if clip is not None:
            clip(optimizer)
        optimizer.step()


# ---------------------------------------------------------------------------------------------- clipping
@dataclass(frozen=True)
class NormScope:
    """Over what the global gradient norm of a plan is taken on this rank: each mesh's norm (DTensor reduces over its
    placements), the stage's norms summed over ``pipeline_group``, less the weights another stage already counts
    (``counted_elsewhere``: ids of the last stage's copies of weights tied to the first stage's)."""

    pipeline_group: dist.ProcessGroup | None = None
    counted_elsewhere: frozenset[int] = frozenset()

    @classmethod
    def of(cls, applied: AppliedPlan) -> NormScope:
        partition = applied.partition
        if partition is None or not partition.is_last or partition.is_first:
            return cls(applied.pipeline_group)
        return cls(applied.pipeline_group, frozenset(id(p) for p in partition.tied))


def clip_gradients(
    parameters: Iterable[nn.Parameter], clip_val: float, algorithm: Literal["norm", "value"], scope: NormScope
) -> None:
    """Clip as training clips (``gradient_clip_val``, ``gradient_clip_algorithm``): by the global norm over ``scope``,
    or by value on each rank's shards (elementwise, so exact on shards). Collective over the plan's meshes and
    pipeline group when clipping by norm."""
    if algorithm == "norm":
        clip_grad_norm_(
            parameters, clip_val, pipeline_group=scope.pipeline_group, norm_excluded=scope.counted_elsewhere
        )
    else:
        clip_grad_value_(parameters, clip_val)


def optimizer_parameters(optimizer: Optimizer) -> list[nn.Parameter]:
    """The parameters an optimizer steps (what Lightning clips for it)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


__all__ = [
    "STEP_METHODS",
    "NormScope",
    "clip_gradients",
    "from_last_stage",
    "loss_scale",
    "mean_loss",
    "optimizer_parameters",
    "run_batch",
    "train_step",
]
