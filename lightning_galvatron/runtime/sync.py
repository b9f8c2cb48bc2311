"""Agreement between ranks before a plan is applied.

Before a plan shards or replicates anything, rank 0's parameters and buffers are broadcast so that
a model initialised without a common seed still trains as one model (tensors are flattened into
buckets per dtype to keep the number of collectives small). Decisions every rank makes from its
own data (which layers run before the blocks) are compared, so that all ranks go on with the same
answer or stop with the same error, never some waiting for the others forever.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_galvatron.plan import PlanError
from lightning_galvatron.runtime.mesh import collective_device, values_travel

_BUCKET_BYTES = 64 * 2**20
T = TypeVar("T")


def agree_across_ranks(decide: Callable[[], T], what: str) -> T:
    """Run ``decide`` on every rank; return its result if all ranks found the same, else raise the same
    :class:`PlanError` everywhere (the first rank's error, or the disagreement)."""
    try:
        outcome: tuple[T | None, str | None] = (decide(), None)
    except Exception as error:  # noqa: BLE001 - every rank must reach the collective below
        outcome = (None, str(error) if isinstance(error, PlanError) else f"{type(error).__name__}: {error}")
    outcomes: list[tuple[T | None, str | None]] = [(None, None)] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    errors = [error for _, error in outcomes if error is not None]
    if errors:
        raise PlanError(outcome[1] or errors[0])  # this rank's own error if it has one
    results = [result for result, _ in outcomes]
    if any(result != results[0] for result in results):
        raise PlanError(f"the ranks disagree on {what}: {results}")
    return cast(T, results[0])  # every rank's decide() returned: no error was gathered


def values_differing_within_groups(group: int, value: float) -> dict[int, list[tuple[int, float]]]:
    """Each rank's ``value`` and the index of its ``group`` (ranks that should agree on it), gathered over the world:
    for every group whose ranks disagree, its ranks' ``(rank, value)``. Every rank gets the same answer, so all raise
    together or none. Collective; empty on the dry run's fake backend (no values travel between its ranks).

    Values travel as float64: exact for integers up to 2**53 (a 48-bit digest, a count).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values_travel():
        return {}
    mine = torch.tensor([group, value], dtype=torch.float64, device=collective_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    members: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for rank, (index, received) in enumerate(t.tolist() for t in gathered):
        members[int(index)].append((rank, received))
    return {index: ranks for index, ranks in members.items() if len({v for _, v in ranks}) > 1}


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
    # Through the collective's device: the model is still where it was built (the CPU) and NCCL takes GPU tensors.
    flat = _flatten_dense_tensors([t.detach() for t in tensors]).to(collective_device())
    dist.broadcast(flat, src)
    for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


def destroy_process_group() -> None:
    """Destroy the default process group if there is one (registered at exit by the strategy that made it): without
    this, gloo processes sometimes abort (SIGABRT) while tearing down at exit."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
