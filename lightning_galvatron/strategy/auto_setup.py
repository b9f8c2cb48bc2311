"""``plan="auto"`` from ``Trainer.fit`` to the first step, as one recipe: :func:`resolve_automatic_plan`.

The strategy hands over a :class:`PlanningContext` -- what planning needs from it, read-only -- instead of itself;
the trials (:mod:`lightning_galvatron.strategy.trials`) and re-planning while training
(:mod:`lightning_galvatron.strategy.replan`)
read the same context. Each step lives in its owner module; this one only says in which order they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.runtime.apply import check_runtime_support
from lightning_galvatron.runtime.mesh import MeshCache
from lightning_galvatron.runtime.structure import OutsideLayers
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan
from lightning_galvatron.selection import Selection, TrialSettings
from lightning_galvatron.strategy.autoplan import SearchSettings, optimizer_kind
from lightning_galvatron.strategy.data import example_batch, first_dataloader, loader_batch_size
from lightning_galvatron.strategy.model_setup import automatic_plan, whole_model_plan
from lightning_galvatron.strategy.precision import precision_flag
from lightning_galvatron.strategy.prediction import Prediction, searched_prediction
from lightning_galvatron.strategy.preparation import explain_automatic_planning
from lightning_galvatron.strategy.trials import StepClock, select_in_trials

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.plugins.precision import Precision
    from torch.optim import Optimizer


@dataclass(frozen=True)
class PlanningContext:
    """What planning the model needs from ``GalvatronStrategy`` in ``setup``: made by the strategy, read here, by the
    trials and by re-planning."""

    module: LightningModule  # the user's: profiled, and copied for the trials; never changed here
    trainer: Trainer
    structure: ModelStructure  # the blocks found (a WholeModel: none)
    tp_plans: Sequence[BlockTensorParallelPlan | str]  # each block's tensor-parallel plan, or why it has none
    layers: str | Sequence[str] | None  # the strategy's ``layers=``: the trials find the blocks of their copies
    meshes: MeshCache
    precision_plugin: Precision
    device: torch.device
    world_size: int
    devices_per_node: int
    global_rank: int
    search: SearchSettings
    trials: TrialSettings | None  # None: ``trials=False``
    optimizers: Sequence[Optimizer]  # the module's (the search sizes the first one's states)
    global_batch_size: int | None  # the strategy's ``global_batch_size=``
    vocab_parallel_loss: bool
    sharded_checkpoints: bool  # ``save_distributed_checkpoint``: a pipeline can be saved only so
    trace_outside_layers: Callable[[], OutsideLayers]  # collective: the step traced once on a real batch (pipelines)
    progress: Callable[[str], None]  # tells the rank monitor where this rank is

    @property
    def fitting(self) -> bool:
        return bool(self.trainer.state.fn == TrainerFn.FITTING)

    @property
    def precision(self) -> str:
        return precision_flag(self.precision_plugin)

    def check(self, plan: ParallelPlan) -> None:
        """Raise for a plan the runtime cannot execute on this model."""
        check_runtime_support(plan, self.structure, self.tp_plans)

    def cost_model_arguments(self) -> dict[str, Any]:
        """What profiling, searching and pricing a plan need to know of the cluster and the training."""
        return {
            "world_size": self.world_size,
            "devices_per_node": self.devices_per_node,
            "device": self.device,
            "precision": self.precision,
            "settings": self.search,
            "optimizer": optimizer_kind(self.optimizers[0] if self.optimizers else None),
        }


def resolve_automatic_plan(context: PlanningContext) -> tuple[ParallelPlan, Prediction, Selection | None]:
    """What happens between ``Trainer.fit`` and the first step under ``plan="auto"``, in order: the plan that trains,
    its prediction, and what the trials decided (``None``: no trials). Collective: every rank, the same plan.

    1. the example batch and the global batch, from the training DataLoader;
    2. a model without blocks trains as one unit (the floor:
       :func:`~lightning_galvatron.strategy.model_setup.whole_model_plan`);
    3. profile the model and the cluster (every rank), search the plan (rank 0) and broadcast it
       (:func:`~lightning_galvatron.strategy.autoplan.plan_automatically`; where that fails otherwise than by no
       plan fitting, the floor);
    4. when fitting, the trials (measured selection,
       :func:`~lightning_galvatron.strategy.trials.select_in_trials`): candidate plans train a few steps on copies
       of the model, the cost model calibrated from those steps searches again and its plan is tried too, and the
       fastest measured plan that fits is chosen;
    5. the prediction for the plan that trains
       (:func:`~lightning_galvatron.strategy.prediction.searched_prediction`), priced with the trials' calibration
       where they fitted one;
    6. when fitting, rank 0 compares the first training steps with it
       (:class:`~lightning_galvatron.strategy.trials.StepClock`).

    The strategy's ``setup`` then prints the report, applies the plan and starts re-planning
    (``docs/architecture.md`` lists the whole sequence).
    """
    module, structure, arguments = context.module, context.structure, context.cost_model_arguments()
    # 1. the batches
    loader = first_dataloader(context.trainer)
    per_device = _profiled_batch_size(module, loader)
    example = move_data_to_device(example_batch(loader), context.device)
    global_batch = context.global_batch_size or per_device * context.world_size
    # 2. no blocks: the floor
    if not structure.blocks:
        return (*whole_model_plan(module, structure, global_batch, **arguments), None)
    # 3. profile and search
    explain_automatic_planning(structure, context.world_size)
    manual_optimizers = 0 if module.automatic_optimization else max(len(context.optimizers), 1)
    auto = automatic_plan(module, structure, example, global_batch, manual_optimizers=manual_optimizers, **arguments)
    if isinstance(auto, tuple):  # the floor: profiling or searching failed
        return (*auto, None)
    # 4. the trials, the calibrated search's plan among them
    selection = select_in_trials(context, auto, loader) if context.trials is not None and context.fitting else None
    plan = auto.plan if selection is None else selection.plan
    context.check(plan)  # before the plan is printed or applied
    if plan.global_batch_size != global_batch:
        rank_zero_info(
            f"Galvatron: the search changed the global batch size from {global_batch} to "
            f"{plan.global_batch_size} (search_batch_size=True)"
        )
    # 5. the prediction
    calibration = selection.calibration if selection is not None else None
    prediction = searched_prediction(
        auto, plan, optimizer=arguments["optimizer"], precision=arguments["precision"], calibration=calibration
    )
    # 6. the first training steps compared with it
    if context.fitting and context.global_rank == 0:
        context.trainer.callbacks.append(StepClock.for_plan(auto, selection))
    return plan, prediction, selection


def _profiled_batch_size(module: LightningModule, loader: object) -> int:
    """The loader's per-device batch size, or the error that says why the model cannot be profiled."""
    if any(p.is_meta for p in module.parameters()):
        raise PlanError(
            'plan="auto" profiles the model by running it, but its parameters are on the meta device '
            "(empty_init / configure_model); create it with real weights, or pass a plan (e.g. one from "
            "`lightning-galvatron search`)"
        )
    per_device = loader_batch_size(loader)
    if per_device is None:
        raise PlanError(
            'plan="auto" needs a DataLoader with a batch_size to profile with and to size the global batch; '
            "pass a plan, or global_batch_size= with a DataLoader that has batch_size"
        )
    return per_device


__all__ = ["PlanningContext", "resolve_automatic_plan"]
