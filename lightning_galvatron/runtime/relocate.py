"""Relocation: move activations between blocks whose layouts differ.

Between blocks, an activation ``X`` of shape ``[batch, seq, ...]`` (one micro-batch of a stage) is a
set of plain local tensors: in an :class:`~lightning_galvatron.layout.ActivationLayout` with ``dp`` data shards and a group of
``tp`` ranks, rank ``r`` holds the batch rows of its dp shard and -- when the block shards the
sequence (Megatron-SP, Ulysses) -- only its group rank's part of the sequence; otherwise the
``tp`` ranks of a group hold identical copies.

When consecutive blocks lay ``X`` out differently, every rank needs the rectangle of
``(batch, seq)`` of the next layout. :func:`exchange_plan` decides, for each rectangle, which rank
sends which piece: a rank that already holds a piece uses its own copy, otherwise one holder
(chosen to spread the load) sends it. The pieces travel in one ``all_to_all`` over the stage; when
nothing crosses ranks (e.g. a tensor-parallel group splitting into data-parallel ranks), no
collective runs at all.

Gradient convention (that of Megatron tensor parallelism): every copy of a replicated activation
carries the full gradient of the global loss with respect to it. The backward of a relocation is
therefore the relocation of the gradient from the new layout back to the old one; it is the exact
adjoint of the map from the full activation to its per-rank views, and every copy receives the
same gradient, which is what DTensor assumes for replicated tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_galvatron.layout import ActivationLayout, Region


@dataclass(frozen=True)
class Transfer:
    source: int  # stage positions
    target: int
    region: Region


def exchange_plan(source: ActivationLayout, target: ActivationLayout, batch: int, seq: int) -> list[Transfer]:
    """Pieces to move so that every rank holds its ``target`` region, given the ``source`` regions."""
    n = source.stage_size
    holders: dict[Region, list[int]] = {}
    for position in range(n):
        holders.setdefault(source.region(position, batch, seq), []).append(position)
    transfers = []
    for position in range(n):
        wanted = target.region(position, batch, seq)
        for piece, owners in holders.items():
            overlap = _intersect(wanted, piece)
            if overlap is None:
                continue
            sender = position if position in owners else owners[position % len(owners)]
            transfers.append(Transfer(sender, position, overlap))
    return transfers


def _intersect(a: Region, b: Region) -> Region | None:
    rows = (max(a[0][0], b[0][0]), min(a[0][1], b[0][1]))
    cols = (max(a[1][0], b[1][0]), min(a[1][1], b[1][1]))
    if rows[0] >= rows[1] or cols[0] >= cols[1]:
        return None
    return rows, cols


def _piece(tensor: torch.Tensor, region: Region, origin: Region) -> torch.Tensor:
    (b0, b1), (s0, s1) = region
    return tensor[b0 - origin[0][0] : b1 - origin[0][0], s0 - origin[1][0] : s1 - origin[1][0]]


def relocate_tensor(
    x: torch.Tensor,
    source: ActivationLayout,
    target: ActivationLayout,
    batch: int,
    position: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The local tensor of the ``target`` layout, given this rank's tensor ``x`` in the ``source`` layout.

    ``batch`` is the stage's micro-batch size, ``position`` this rank's index in the stage and
    ``group`` the stage's process group (used only when pieces cross ranks).
    """
    seq = source.global_seq(x.shape[1])
    plan = exchange_plan(source, target, batch, seq)
    mine, wanted = source.region(position, batch, seq), target.region(position, batch, seq)
    out = x.new_empty((wanted[0][1] - wanted[0][0], wanted[1][1] - wanted[1][0], *x.shape[2:]))
    crossing = [t for t in plan if t.source != t.target]
    sends = [t for t in crossing if t.source == position]
    receives = [t for t in crossing if t.target == position]
    for t in plan:
        if t.source == t.target == position:
            _piece(out, t.region, wanted).copy_(_piece(x, t.region, mine))
    if not crossing:
        return out
    n = source.stage_size
    row = math.prod(x.shape[2:])  # elements per (batch, position)
    send_sizes = [0] * n
    recv_sizes = [0] * n
    for t in sends:
        send_sizes[t.target] += _area(t.region) * row
    for t in receives:
        recv_sizes[t.source] += _area(t.region) * row
    send_buffer = torch.cat(
        [_piece(x, t.region, mine).reshape(-1) for t in sorted(sends, key=lambda t: t.target)]
        or [x.new_empty(0)]
    )
    recv_buffer = x.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv_buffer, send_buffer, recv_sizes, send_sizes, group=group)
    offset = 0
    for t in sorted(receives, key=lambda t: t.source):
        size = _area(t.region) * row
        target_view = _piece(out, t.region, wanted)
        target_view.copy_(recv_buffer[offset : offset + size].view(target_view.shape))
        offset += size
    return out


def _area(region: Region) -> int:
    return (region[0][1] - region[0][0]) * (region[1][1] - region[1][0])


class Relocate(torch.autograd.Function):
    """Autograd-aware relocation; backward relocates the gradient the other way."""

    @staticmethod
    def forward(ctx, x, source, target, batch, position, group):
        ctx.args = (source, target, batch, position, group)
        return relocate_tensor(x, source, target, batch, position, group)

    @staticmethod
    def backward(ctx, grad):
        source, target, batch, position, group = ctx.args
        return relocate_tensor(grad.contiguous(), target, source, batch, position, group), None, None, None, None, None


def relocate(
    x: torch.Tensor,
    source: ActivationLayout,
    target: ActivationLayout,
    batch: int,
    position: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    if source == target:
        return x
    return Relocate.apply(x.contiguous(), source, target, batch, position, group)
