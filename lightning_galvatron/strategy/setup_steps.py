"""The user's steps that the strategy runs in ``setup``, before Lightning's loop, see the module as the loop shows it.

In ``setup`` the strategy runs the LightningModule's steps before Lightning has created its optimizers: profiling
for ``plan="auto"``, the trials' copies of the module, the pipeline's trace of the step. Under DDP every
``training_step`` runs with the optimizers and schedulers in place, so a step may read them (logging
``self.lr_schedulers().get_last_lr()`` or ``self.optimizers().param_groups``); in ``setup`` it failed with
``'NoneType' object has no attribute 'get_last_lr'`` (a refusal, under a pipeline). While fitting, those steps now see
what ``configure_optimizers`` returns, as the first training step does; nothing steps them, and they are dropped
before the strategy creates the optimizers of the parallelised model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


@contextmanager
def configured_optimizers_in_place(strategy: Any, trainer: Trainer) -> Iterator[None]:
    """While fitting, ``strategy.optimizers`` and ``lr_scheduler_configs`` (what ``self.optimizers()`` and
    ``self.lr_schedulers()`` read) hold what the module's ``configure_optimizers`` returns; emptied after.

    A ``configure_optimizers`` that cannot run yet leaves them empty: Lightning calls it again after ``setup`` has
    parallelised the model, and raises its error there.
    """
    if trainer.state.fn != TrainerFn.FITTING or strategy.optimizers:
        yield
        return
    try:
        strategy.optimizers, strategy.lr_scheduler_configs = _init_optimizers_and_lr_schedulers(
            strategy.lightning_module
        )
    except Exception:  # noqa: BLE001 - raised by Lightning's own call after setup
        yield
        return
    try:
        yield
    finally:
        strategy.optimizers, strategy.lr_scheduler_configs = [], []


def configured_optimizers(module: Any) -> list[Optimizer]:
    """The optimizers the module's ``configure_optimizers`` returns (the search sizes the first one's states); none
    where it cannot run yet (then sized as Adam, the common worst case)."""
    try:
        optimizers, _, _ = _init_optimizers_and_lr_schedulers(module)
    except Exception:  # noqa: BLE001 - sized as Adam, the common worst case
        return []
    return list(optimizers)
