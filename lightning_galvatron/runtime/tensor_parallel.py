"""Tensor parallelism inside one block, with DTensor.

``nn.Linear`` layers use PyTorch's own ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` styles through ``parallelize_module``. Hugging Face's ``Conv1D`` (GPT-2: a
linear layer with a transposed weight, and a fused query/key/value projection) has no built-in
style; :class:`ColwiseConv1D` and :class:`RowwiseConv1D` keep its weights as DTensors (so sharding,
FSDP2 and checkpoints work as for any parameter) and compute on the local shards with the two
Megatron collectives: identity forward / all-reduce backward in front of a column-parallel layer,
all-reduce forward / identity backward behind a row-parallel one. A fused projection of ``k``
equal parts (``q, k, v``) is sharded with ``_StridedShard`` so that each rank holds its slice of
every part, which is what the attention code downstream splits. The fused bias stays whole on every
rank (FSDP2 cannot shard a dimension that is already strided-sharded): each rank adds its slices and
its gradient is summed over the group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; sums the input gradient over the tensor-parallel group in backward."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sums partial outputs over the tensor-parallel group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None


def _distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    param = getattr(module, name)
    if param is None:
        return
    sharded = nn.Parameter(distribute_tensor(param.data, mesh, [placement]), requires_grad=param.requires_grad)
    module.register_parameter(name, sharded)


def _conv1d_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.reshape(-1, x.shape[-1]) @ weight
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[-1])


class ColwiseConv1D(ParallelStyle):
    """Split a ``Conv1D`` (weight ``[in, out]``) along its outputs; ``parts`` > 1 for fused projections."""

    def __init__(self, parts: int = 1) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        parts, tp, tp_rank = self.parts, device_mesh.size(), device_mesh.get_local_rank()
        weight_placement = Shard(1) if parts == 1 else _StridedShard(1, split_factor=parts)
        _distribute_parameter(module, "weight", device_mesh, weight_placement)
        if parts == 1:
            _distribute_parameter(module, "bias", device_mesh, Shard(0))

        def local_bias() -> torch.Tensor | None:
            if module.bias is None:
                return None
            if parts == 1:
                return module.bias.to_local()
            return _CopyToGroup.apply(module.bias, group).view(parts, tp, -1)[:, tp_rank].reshape(-1)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return _conv1d_forward(_CopyToGroup.apply(x, group), module.weight.to_local(), local_bias())

        module.forward = forward  # type: ignore[method-assign]
        return module


class RowwiseConv1D(ParallelStyle):
    """Split a ``Conv1D`` along its inputs; the partial outputs are summed, then the bias is added."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        _distribute_parameter(module, "weight", device_mesh, Shard(0))
        _distribute_parameter(module, "bias", device_mesh, Replicate())

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = _ReduceFromGroup.apply(_conv1d_forward(x, module.weight.to_local(), None), group)
            return out + module.bias.to_local() if module.bias is not None else out

        module.forward = forward  # type: ignore[method-assign]
        return module


def apply_tensor_parallel(block: nn.Module, styles: Mapping[str, ParallelStyle], tp_mesh: DeviceMesh) -> None:
    """Split ``block``'s submodules over ``tp_mesh`` as ``styles`` (submodule name -> style) say."""
    parallelize_module(block, tp_mesh, dict(styles))
