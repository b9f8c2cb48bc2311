"""What the strategy's ``setup`` learns about the model before it plans: its blocks and each block's tensor-parallel
plan, with what Lightning holds (the trainer's loader, the step it runs) handed to the model side; and the floor
under ``plan="auto"``: a model whose blocks cannot be found trains as one unit.

The floor: where no block list can be found (no ``nn.ModuleList``/``nn.Sequential`` of same-class modules the model
calls), ``plan="auto"`` does not refuse the model DDP would train. It trains the whole model as one unit -- the
plan's ``vocab`` strategy over all of it, no blocks -- under the fastest of DDP, ZeRO-2 and ZeRO-3 whose model
states (weights, gradients, optimizer states; ZeRO-3 also holding the whole model gathered while it runs) fit the
memory budget, and the setup report says why it could not do more. Where the blocks were found but profiling or
searching the model failed (:class:`~lightning_galvatron.strategy.autoplan.AutomaticPlanFailed`: the model's code fails
when the profiler runs a block alone), the same choice is made for every block and the rest alike: a uniform plan of
data parallelism, nothing split, recomputed or pipelined. A given plan, or ``layers=``, keeps the refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_galvatron.model.discovery import BlockDiscoveryError, ModelStructure, find_blocks
from lightning_galvatron.model.outside_layers import OutsideLayers, trace_outside_layers
from lightning_galvatron.model.tensor_parallel_plans import (
    BlockTensorParallelPlan,
    block_tensor_parallel_plans,
    tensor_parallel_plan_or_reason,
)
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError
from lightning_galvatron.runtime.sync import agree_across_ranks
from lightning_galvatron.search.cost import optimizer_state_bytes, resolve_precision
from lightning_galvatron.strategy.autoplan import (
    AutomaticPlanFailed,
    AutoPlan,
    SearchSettings,
    default_memory_budget,
    plan_automatically,
)
from lightning_galvatron.strategy.data import example_batch, first_dataloader
from lightning_galvatron.strategy.prediction import Prediction
from lightning_galvatron.units import format_bytes

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "WholeModel",
    "automatic_plan",
    "block_plans",
    "find_structure",
    "traced_outside_layers",
    "tensor_parallel_plan_or_reason",
    "whole_model_plan",
]

#: Tried in this order, fastest first: the first whose model states fit is the plan.
_FLOOR = ("ddp", "zero2", "zero3")


@dataclass(frozen=True)
class WholeModel(ModelStructure):
    """A model without blocks the strategy could find, and why."""

    why: str = ""


def find_structure(module: nn.Module, layers: Any, plan_source: Any) -> ModelStructure:
    """The model's blocks (:func:`~lightning_galvatron.model.discovery.find_blocks`); with ``plan="auto"`` and no
    ``layers=``, a model without any is a :class:`WholeModel` (the floor) rather than an error."""
    try:
        return find_blocks(module, layers)
    except BlockDiscoveryError as error:
        if layers is not None or not (isinstance(plan_source, str) and plan_source == "auto"):
            raise
        return WholeModel(module, (), why=str(error))


def block_plans(structure: ModelStructure, step: str, trainer: Trainer) -> list[BlockTensorParallelPlan | str]:
    """Each block's tensor-parallel plan, or why it has none. A plan guessed from layer names is proven on the
    block first; where the block takes more than its hidden states, on the inputs of a real call, observed by running
    ``step`` on the first batch of the trainer's loader (taken only then)."""
    return block_tensor_parallel_plans(structure, step, lambda: example_batch(first_dataloader(trainer)))


def traced_outside_layers(module: nn.Module, structure: ModelStructure, step: str, trainer: Trainer) -> OutsideLayers:
    """Pipelines: which layers outside the blocks ``step`` runs before them and which after, observed once on the
    first batch of the trainer's loader (registration order does not tell); the same answer, or the same error, on
    every rank."""
    batch = example_batch(first_dataloader(trainer))
    return agree_across_ranks(
        lambda: trace_outside_layers(module, structure, step, batch), "which layers run before and after the blocks"
    )


def automatic_plan(
    module: nn.Module, structure: ModelStructure, example: Any, global_batch_size: int, **context: Any
) -> AutoPlan | tuple[ParallelPlan, Prediction]:
    """:func:`~lightning_galvatron.strategy.autoplan.plan_automatically`'s profile and search, or where they failed for
    another
    reason than no plan fitting, the floor's plan and prediction (:func:`whole_model_plan`, saying what failed)."""
    try:
        return plan_automatically(module, structure, example, global_batch_size=global_batch_size, **context)
    except AutomaticPlanFailed as failed:
        return whole_model_plan(module, structure, global_batch_size, why=str(failed), **context)


def whole_model_plan(
    module: nn.Module,
    structure: ModelStructure,
    global_batch_size: int,
    *,
    world_size: int,
    devices_per_node: int,
    device: torch.device,
    precision: str,
    settings: SearchSettings,
    optimizer: str,
    why: str | None = None,
    **_: Any,
) -> tuple[ParallelPlan, Prediction]:
    """The floor's plan, and what the setup report says of it: for a model without blocks, or (``why``: what failed)
    one whose blocks were found but could not be planned."""
    budget = settings.memory_budget_bytes or default_memory_budget(device, devices_per_node)
    kind = resolve_precision(precision)
    states = optimizer_state_bytes(optimizer, kind)
    parameters = sum(p.numel() for p in module.parameters())
    per_parameter = {
        "ddp": kind.param_bytes + kind.grad_bytes + states,
        "zero2": kind.param_bytes + (kind.grad_bytes + states) / world_size,
        "zero3": (kind.param_bytes + kind.grad_bytes + states) / world_size + kind.compute_bytes,
    }
    needed = {name: parameters * per_parameter[name] for name in _FLOOR}
    fits = [name for name in _FLOOR if needed[name] <= budget] if world_size > 1 else ["ddp"]
    why = why or (structure.why if isinstance(structure, WholeModel) else "the model has no blocks")
    if not fits:
        raise PlanError(
            f"{why}; under data parallelism alone its model states need {format_bytes(needed['zero3'])} per device "
            f"even under ZeRO-3, more than the memory budget of {format_bytes(budget)}"
        )
    choice = fits[0]
    everywhere = LayerStrategy(dp_type=choice)
    plan = ParallelPlan.uniform(world_size, len(structure.blocks), everywhere, global_batch_size=global_batch_size)
    states_needed = format_bytes(needed[choice])
    unit = "the whole model as one unit" if not structure.blocks else "every block and the rest of the model"
    note = (
        f"plan='auto' trains {unit} under {choice} ({states_needed} of model states per device; "
        f"activations not measured), since it could not do more: {why}"
    )
    prediction = Prediction(plan, f"searched over DDP, ZeRO-2 and ZeRO-3 for {unit}", budget, missing=note)
    return plan, prediction
