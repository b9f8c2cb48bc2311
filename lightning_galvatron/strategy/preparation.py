"""Putting a model under a plan, the same for both of Lightning's front doors.

``GalvatronStrategy`` (the Trainer's) and ``GalvatronFabricStrategy`` (Fabric's) differ in when they learn the model,
the batch and the optimizers, not in what they do with them: a given plan is loaded the same way, an automatic plan
is explained the same way, rank 0's weights are broadcast, the plan is applied by the runtime with the precision's
FSDP policy, the split model is placed on the device before its gradient hooks exist, and every optimizer step tells
the gradient reducer that its sums were consumed. One copy here, so the two front doors train the same step.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.model.tensor_parallel_plans import tensor_parallel_plan_or_reason
from lightning_galvatron.plan import ParallelPlan, load_plan
from lightning_galvatron.runtime.apply import AppliedPlan, apply_plan
from lightning_galvatron.runtime.mesh import MeshCache
from lightning_galvatron.runtime.precision import boundary_dtype, mixed_precision_policy
from lightning_galvatron.runtime.step import STEP_METHODS
from lightning_galvatron.runtime.structure import OutsideLayers
from lightning_galvatron.runtime.sync import broadcast_module_states
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan


def load_given_plan(
    source: ParallelPlan | Mapping[str, Any] | str | os.PathLike, world_size: int, global_batch_size: int | None
) -> ParallelPlan:
    """A plan given to the strategy (object, dict or file), checked against the world size; ``global_batch_size``
    (the strategy's argument) wins over the plan's."""
    plan = load_plan(source, world_size=world_size)
    return plan if global_batch_size is None else plan.replace(global_batch_size=global_batch_size)


def explain_automatic_planning(structure: ModelStructure, world_size: int) -> None:
    """Rank 0 says, before profiling, what the automatic plan cannot use for this model and cluster."""
    for block_type, example_block in {type(b).__name__: b for b in structure.blocks}.items():
        reason = tensor_parallel_plan_or_reason(example_block)
        if isinstance(reason, str):
            rank_zero_info(f"Galvatron: {block_type} blocks are planned with tp=1: {reason}")
    if world_size == 1:
        rank_zero_info(
            "Galvatron: one device: nothing communicates, so no hardware profile is measured; the plan chooses "
            "recomputation and micro-batches to fit the memory budget"
        )


def place_on_device(model: nn.Module, device: torch.device) -> None:
    """Where the split model trains: meta weights materialised, everything moved to the device (``apply_plan`` calls
    this before it hooks the gradients: moving DTensor parameters later swaps them and drops the hooks)."""
    with _parameters_kept():
        _materialize_distributed_module(model, device)
        model.to(device)


def place_restored(model: nn.Module, device: torch.device) -> None:
    """Where a model whose weights are loaded right after trains (a plan switched while training): its meta tensors
    allocated on the device, uninitialised (``reset_parameters`` would draw random numbers and ``to_empty`` would
    drop the values of the other tensors), the others moved."""
    with _parameters_kept():
        model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))


@contextmanager
def _parameters_kept() -> Iterator[None]:
    """Module conversions swap new values into the parameter objects instead of making new ones: the runtime already
    holds them (a new ``Parameter`` in place of a meta one left a ddp layer's gradients unsummed)."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


def prepare(
    model: nn.Module,
    structure: ModelStructure,
    plan: ParallelPlan,
    meshes: MeshCache,
    precision: str,
    device: torch.device,
    *,
    tp_plans: Sequence[BlockTensorParallelPlan | str],
    broadcast_initial_weights: bool = True,
    entry_methods: Sequence[str] = (),
    parallel_loss: bool = False,
    outside_layers: OutsideLayers | None = None,
    compile_options: Mapping[str, Any] | None = None,
    place: Callable[[nn.Module, torch.device], None] = place_on_device,
) -> AppliedPlan:
    """Apply ``plan`` to ``model`` (already converted to ``precision`` by Lightning's plugin) in place, on every rank.

    Rank 0's weights first (as DDP starts, so that ranks need no common seed), then the runtime's
    :func:`~lightning_galvatron.runtime.apply.apply_plan` with the precision's FSDP policy and pipeline dtype; the
    split model is placed on ``device`` (by ``place``) before the gradient hooks are installed.
    """
    if broadcast_initial_weights and dist.get_world_size() > 1:
        broadcast_module_states(model)
    return apply_plan(
        model,
        structure,
        plan,
        meshes,
        mixed_precision_policy(precision),
        entry_methods=entry_methods,
        parallel_loss=parallel_loss,
        boundary_dtype=boundary_dtype(precision),
        outside_layers=outside_layers,
        tp_plans=tp_plans,
        compile_options=compile_options,
        place=functools.partial(place, device=device),
    )


def overridden_step_methods(module: nn.Module) -> list[str]:
    """The step methods (:data:`~lightning_galvatron.runtime.step.STEP_METHODS`) ``module`` overrides: the entry
    methods ``apply_plan`` gathers the root's parameters around."""
    return [name for name in STEP_METHODS if is_overridden(name, module)]


def count_optimizer_steps(applied: AppliedPlan, optimizers: Iterable[torch.optim.Optimizer]) -> list[Any]:
    """Tell the gradient reducer after each step of these optimizers that the summed gradients were consumed (a
    second backward pass before a step would sum them twice: refused until then). Returns the hooks' handles."""
    return [
        optimizer.register_step_post_hook(lambda *_: applied.gradients.optimizer_stepped()) for optimizer in optimizers
    ]
