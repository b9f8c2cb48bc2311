"""Start every rank from the same weights, as DDP does.

Before a plan shards or replicates anything, rank 0's parameters and buffers are broadcast so that
a model initialised without a common seed still trains as one model. Tensors are flattened into
buckets per dtype to keep the number of collectives small.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

_BUCKET_BYTES = 64 * 2**20


def broadcast_module_states(module: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s values (meta tensors are skipped)."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for t in dict.fromkeys(tensors):  # tied weights once
        by_dtype[(t.dtype, t.device)].append(t)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= _BUCKET_BYTES:
                _broadcast_bucket(bucket, src)
                bucket, size = [], 0
        if bucket:
            _broadcast_bucket(bucket, src)


@torch.no_grad()
def _broadcast_bucket(tensors: list[torch.Tensor], src: int) -> None:
    flat = _flatten_dense_tensors([t.detach() for t in tensors])
    dist.broadcast(flat, src)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)
