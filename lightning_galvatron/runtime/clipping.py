"""Gradient clipping by the global norm of a model whose parameters live on many meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails once parameters are
DTensors on different meshes, and per pipeline stage it would clip by a partial norm. Here the
norm is reduced per mesh (where DTensor knows the placements), the per-mesh norms are combined as
plain tensors, and across pipeline stages the result is reduced over the stage group.

Clipping by value is elementwise, so it is exact on each rank's shards; but
``torch.nn.utils.clip_grad_value_`` clamps all gradients in one foreach call, which refuses a mix of
DTensors and plain tensors (or DTensors on different meshes): here it clamps the local shards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_galvatron.runtime.mesh import collective_device, local_tensor


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pipeline_group: dist.ProcessGroup | None = None,
    norm_excluded: frozenset[int] | set[int] = frozenset(),
) -> torch.Tensor:
    """Scale gradients in place so that their global ``norm_type``-norm is at most ``max_norm``.

    ``norm_excluded`` holds ids of parameters whose gradient another pipeline stage already counts
    (a weight shared by the first and last stage); they are clipped but not counted twice.
    Returns the global norm before clipping (a plain tensor, equal on every rank).
    """
    groups: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norm_type = float(norm_type)
    norms = []
    for params in groups.values():
        counted = [p.grad for p in params if p.grad is not None and id(p) not in norm_excluded]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    # Every rank must join the pipeline reduction, even one without gradients.
    stacked = (
        torch.stack([n.float() for n in norms])
        if norms
        else torch.zeros(1, device=collective_device(pipeline_group) if pipeline_group is not None else None)
    )
    if norm_type == float("inf"):
        total = stacked.max()
        if pipeline_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pipeline_group)
    else:
        total = stacked.pow(norm_type).sum()
        if pipeline_group is not None:
            dist.all_reduce(total, group=pipeline_group)
        total = total.pow(1.0 / norm_type)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def clip_grad_value_(parameters: Iterable[torch.nn.Parameter], clip_value: float) -> None:
    """Clamp every gradient in place to ``[-clip_value, clip_value]``, shard by shard."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                local_tensor(p.grad).clamp_(min=-float(clip_value), max=float(clip_value))
