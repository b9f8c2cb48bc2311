"""Ulysses sequence parallelism: split the sequence everywhere except inside attention.

Between and inside a block each of the ``g`` ranks holds ``seq / g`` positions with whole weights.
Attention needs every position, so around the attention kernel an all-to-all trades the split:
queries, keys and values go from "all heads, my positions" to "my heads, all positions", attention
runs, and a second all-to-all trades back. The kernel is found without touching the model's code:
while the block runs, a ``TorchFunctionMode`` intercepts ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_galvatron.model.discovery import model_class


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dim 0 goes to rank ``i``; the inverse (its own backward) is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, heads, seq/g, d]`` (all heads, local positions) -> ``[b, heads/g, seq, d]``."""
    g = dist.get_world_size(group)
    b, heads, local_seq, d = x.shape
    if heads % g:
        raise ValueError(f"Ulysses degree {g} does not divide the {heads} attention heads of this block")
    chunks = x.reshape(b, g, heads // g, local_seq, d).permute(1, 0, 2, 3, 4)
    received = _AllToAll.apply(chunks, group)  # [source rank = sequence chunk, b, heads/g, seq/g, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // g, g * local_seq, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, heads/g, seq, d]`` -> ``[b, heads, seq/g, d]``: the inverse of :func:`sequence_to_heads`."""
    g = dist.get_world_size(group)
    b, local_heads, seq, d = x.shape
    chunks = x.reshape(b, local_heads, g, seq // g, d).permute(2, 0, 1, 3, 4)
    received = _AllToAll.apply(chunks, group)  # [source rank = head group, b, heads/g, seq/g, d]
    return received.permute(1, 0, 2, 3, 4).reshape(b, g * local_heads, seq // g, d)


class _UlyssesAttention(TorchFunctionMode):
    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        names = ("query", "key", "value", "attn_mask")
        values = {**dict(zip(names, args)), **kwargs}
        if values.get("attn_mask") is not None:
            raise NotImplementedError(
                "Ulysses sequence parallelism supports attention without an explicit mask (use is_causal=True)"
            )
        q, k, v = (sequence_to_heads(values.pop(name), self.group) for name in names[:3])
        values.pop("attn_mask", None)
        return heads_to_sequence(func(q, k, v, **values), self.group)


_GROUPS: weakref.WeakKeyDictionary[nn.Module, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def ulysses_group(block: nn.Module) -> dist.ProcessGroup | None:
    """The group ``block``'s sequence is split over, if it runs Ulysses."""
    return _GROUPS.get(block)


def apply_ulysses(block: nn.Module, group: dist.ProcessGroup) -> None:
    """Run ``block`` with its sequence split over ``group`` (weights stay whole)."""
    forward = block.forward
    _GROUPS[block] = group

    def ulysses_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        mode = _UlyssesAttention(group)
        with mode:
            out = forward(*args, **kwargs)
        if mode.calls == 0:
            raise RuntimeError(
                f"{model_class(block).__name__} ran without calling F.scaled_dot_product_attention, so Ulysses sequence "
                "parallelism cannot split its attention; choose sp='megatron' or 'none' for this block"
            )
        return out

    block.forward = ulysses_forward  # type: ignore[method-assign]
