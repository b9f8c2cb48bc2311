"""Data parallelism per layer: DDP, ZeRO-2 and ZeRO-3.

- ``zero3``: FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters gathered for forward and
  again for backward, gradients reduce-scattered.
- ``zero2``: ``fully_shard(reshard_after_forward=False)``: parameters stay gathered from forward
  to the end of backward; gradients and optimizer states are sharded.
- ``ddp``: whole parameters on every replica, gradients summed in buckets overlapped with backward
  by the :class:`~lightning_galvatron.runtime.gradient_sync.GradientReducer` (as DDP does; FSDP2's
  ``replicate`` was measured much slower). FSDP modules around such a layer ignore its parameters.

Names never change, sharded parameters are DTensors, and every kind checkpoints through DCP.

Gradient convention: the loss of each data shard is scaled by ``1 / input_dp`` (the mean over the
global batch) and gradients are **summed** over each block's own dp group, never averaged. A block
whose dp degree differs from its neighbours' (dp=4 here, dp=2 x tp=2 there) then still receives
exactly the gradient of the global-batch mean; averaging would scale each block differently.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_galvatron.plan import LayerStrategy
from lightning_galvatron.runtime.gradient_sync import GradientReducer


def apply_data_parallel(
    module: nn.Module | list[nn.Module],
    strategy: LayerStrategy,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reducer: GradientReducer,
    outside_blocks: bool = False,
) -> None:
    """Make ``module``'s parameters data-parallel over ``dp_mesh`` as ``strategy.dp_type`` says.

    Parameters that a nested FSDP module or ``reducer`` already holds are left to them, so the
    layers outside the blocks (``outside_blocks``) can be applied last, on the root.
    """
    modules = module if isinstance(module, list) else [module]
    if strategy.dp_type == "ddp":
        reducer.add(
            (p for m in modules for p in _unclaimed_parameters(m, reducer)),
            dp_mesh.get_group(),
            reduce_last=outside_blocks,
        )
        return
    ignored = {p for m in modules for p in m.parameters() if reducer.owns(p)}
    _to_mesh_device(modules, dp_mesh)
    fully_shard(
        module,
        mesh=dp_mesh,
        reshard_after_forward=strategy.dp_type == "zero3",
        mp_policy=mp_policy,
        shard_placement_fn=shard_placement,
        ignored_params=ignored or None,
    )
    for m in modules:
        use_sum_reduction(m)


def _to_mesh_device(modules: list[nn.Module], mesh: DeviceMesh) -> None:
    """FSDP2 shards only parameters already on the mesh's device (or on meta); a model built on the CPU moves to
    the GPU here, a block at a time (never whole), right before it is sharded."""
    if mesh.device_type == "cpu":
        return
    device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    for sub in [sub for m in modules for sub in m.modules() if any(t.device.type == "cpu" for t in _own_tensors(sub))]:
        sub._apply(lambda t: t.to(device) if t.device.type == "cpu" else t, recurse=False)  # placed ones stay


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _unclaimed_parameters(module: nn.Module, reducer: GradientReducer) -> list[nn.Parameter]:
    """``module``'s parameters that neither a nested FSDP module nor ``reducer`` holds yet."""
    claimed = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in claimed and not reducer.owns(p)]


def shard_placement(param: nn.Parameter) -> Shard | None:
    """Where FSDP2 shards a parameter: dim 0 (``None``), except dim 1 for a weight that tensor parallelism
    already split in strides along dim 0 (a fused q/k/v projection, ``nn.MultiheadAttention.in_proj_weight``).

    FSDP2 accepts sharding such a dimension again but then describes the tensor wrongly (its full
    tensor, hence every checkpoint, would be scrambled).
    """
    if isinstance(param, DTensor) and param.dim() > 1:
        if any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
            return Shard(1)
    return None


def use_sum_reduction(module: nn.Module) -> None:
    """Sum gradients over the dp group instead of averaging (see the module docstring)."""
    assert isinstance(module, FSDPModule)
    module.set_gradient_divide_factor(1.0)
    # gloo has no PREMUL_SUM: without this, a divide factor of 1.0 still takes that path and fails.
    module.set_force_sum_reduction_for_comms(True)
