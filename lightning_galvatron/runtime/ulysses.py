"""Ulysses sequence parallelism: split the sequence everywhere except inside attention.

Between and inside a block each of the ``g`` ranks holds ``seq / g`` positions with whole weights.
Attention needs every position, so around the attention kernel an all-to-all trades the split:
queries, keys and values go from "all heads, my positions" to "my heads, all positions", attention
runs, and a second all-to-all trades back. The kernel is found without touching the model's code:
while the block runs, a ``TorchFunctionMode`` intercepts ``F.scaled_dot_product_attention``.

What else a block receives must fit that split:

- inputs with one entry per position (rotary ``(cos, sin)``, position ids, cache positions; which ones
  the block's tensor-parallel plan says, Hugging Face names by default) arrive whole and are cut to
  this rank's positions before the block runs;
- an attention mask arrives whole (``[batch, 1 or heads, queries, keys]`` over the whole sequence) and
  reaches the kernel whole, where queries and keys are whole again (its heads cut to this rank's);
- keys and values over another sequence (cross-attention to an encoder's output, which every rank
  holds whole) are cut to this rank's heads instead of exchanged, and the encoder output's gradient
  (this rank's heads' part) is summed over the group;
- key/value heads that the degree does not divide (grouped or multi-query attention) are repeated
  to the query heads first.

What cannot be made exact stops with an error: a mask built inside the block from its local
positions, an encoder output exactly as long as this rank's part of the sequence (cross- and
self-attention could not be told apart).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_galvatron.runtime.structure import HF_POSITION_INPUTS, model_class
from lightning_galvatron.runtime.tensor_parallel import _CopyToGroup


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dim 0 goes to rank ``i``; the inverse (its own backward) is the same exchange."""

    if TYPE_CHECKING:  # torch leaves ``Function.apply`` untyped

        @classmethod
        def apply(cls, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor: ...

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
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


def _local_heads(x: torch.Tensor, g: int, rank: int) -> torch.Tensor:
    """This rank's part of dim -3 (heads), or ``x`` itself where that dimension broadcasts."""
    heads = x.shape[-3]
    return x if heads == 1 else x.narrow(-3, rank * heads // g, heads // g)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to ``heads`` query heads (query head ``i`` uses key/value head
    ``i // (heads / kv)``)."""
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _UlyssesAttention(TorchFunctionMode):
    def __init__(self, group: dist.ProcessGroup, memory_lengths: set[int]) -> None:
        super().__init__()
        self.group = group
        self.g = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.memory_lengths = memory_lengths
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        values = {**dict(zip(_SDPA_ARGUMENTS, args)), **kwargs}
        q, k, v = values.pop("query"), values.pop("key"), values.pop("value")
        mask = values.pop("attn_mask", None)
        g, rank, heads, local = self.g, self.rank, q.shape[-3], q.shape[-2]
        cross = k.shape[-2] != local  # keys over a whole other sequence (an encoder's output)
        if not cross and local in self.memory_lengths:
            raise RuntimeError(
                f"Ulysses cannot tell this block's cross-attention from its self-attention: the encoder output is "
                f"{local} positions long, as long as this rank's part of the sequence; use another degree or sp='none'"
            )
        if k.shape[-3] % g or (cross and k.shape[-3] not in (heads, 1)):
            k, v = _repeat_heads(k, heads), _repeat_heads(v, heads)
            values.pop("enable_gqa", None)
        q = sequence_to_heads(q, self.group)
        if cross:
            k, v = _local_heads(k, g, rank), _local_heads(v, g, rank)
        else:
            k, v = sequence_to_heads(k, self.group), sequence_to_heads(v, self.group)
        if mask is not None:
            mask = self._whole_mask(mask, heads, q.shape[-2], k.shape[-2])
        return heads_to_sequence(func(q, k, v, mask, **values), self.group)

    def _whole_mask(self, mask: torch.Tensor, heads: int, queries: int, keys: int) -> torch.Tensor:
        if mask.shape[-1] != keys or mask.shape[-2] not in (1, queries):
            raise RuntimeError(
                f"Ulysses needs the attention mask over the whole sequence ({queries} queries x {keys} keys), got "
                f"one of shape {tuple(mask.shape)}: the block built or cut it from its local positions. Pass the "
                "mask to the "
                "block whole (as Hugging Face models do), or use sp='none' or 'megatron' for this block"
            )
        if mask.dim() >= 3 and mask.shape[-3] not in (1, heads):
            raise RuntimeError(f"an attention mask of shape {tuple(mask.shape)} does not match {heads} heads")
        return _local_heads(mask, self.g, self.rank) if mask.dim() >= 3 else mask


_GROUPS: weakref.WeakKeyDictionary[nn.Module, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def ulysses_group(block: nn.Module) -> dist.ProcessGroup | None:
    """The group ``block``'s sequence is split over, if it runs Ulysses."""
    return _GROUPS.get(block)


def _signature(block: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model_class(block).forward)
    except (TypeError, ValueError):
        return None


def _cut(value: Any, dim: int, local: int, g: int, rank: int, name: str | int) -> Any:
    """This rank's positions of a per-position input (tensors, or tuples of them like ``(cos, sin)``)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, dim, local, g, rank, name) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    size = value.shape[dim]
    if size in (1, local) and size != local * g:
        return value  # broadcast over positions, or already this rank's part
    if size != local * g:
        raise RuntimeError(
            f"block input {name!r} has {size} entries along dimension {dim}, neither the sequence length "
            f"{local * g} nor this rank's {local} positions; say which inputs are per position in the block's "
            "tensor-parallel plan"
        )
    return value.narrow(dim, rank * local, local)


def apply_ulysses(
    block: nn.Module, group: dist.ProcessGroup, position_inputs: Mapping[str | int, int] | None = None
) -> None:
    """Run ``block`` with its sequence split over ``group`` (weights stay whole).

    ``position_inputs`` names the inputs with one entry per sequence position (names, or indices of
    positional arguments) and their position dimension; by default Hugging Face's names.
    """
    positions = dict(HF_POSITION_INPUTS if position_inputs is None else position_inputs)
    forward = block.forward
    _GROUPS[block] = group
    signature = _signature(block)
    g, rank = dist.get_world_size(group), dist.get_rank(group)

    def ulysses_forward(*args: Any, **kwargs: Any) -> Any:
        hidden = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("hidden_states"))
        assert hidden is not None  # a block's first positional tensor, else its hidden_states=
        local, width = hidden.shape[1], hidden.shape[-1]
        if local < 2:
            raise RuntimeError(
                f"Ulysses degree {g} leaves each rank {local} position of the sequence: attention code takes a single "
                "query position for a decoding step (no causal mask); use a degree of at most half the sequence"
            )
        names = _argument_names(signature, len(args))
        args = tuple(
            _cut(a, positions[key], local, g, rank, key)
            if a is not hidden and (key := _key(i, names, positions)) is not None
            else a
            for i, a in enumerate(args)
        )
        kwargs = {
            k: _cut(v, positions[k], local, g, rank, k) if k in positions and v is not hidden else v
            for k, v in kwargs.items()
        }

        def is_memory(t: Any) -> bool:  # an encoder's output: whole on every rank of the group
            return (
                isinstance(t, torch.Tensor)
                and t is not hidden
                and t.dim() == 3
                and t.is_floating_point()
                and t.shape[-1] == width
            )

        # Each rank's cross-attention uses its heads of the memory's keys and values, so its gradient for the
        # memory is its heads' part: summed over the group, every rank holds the whole (as for any replicated input).
        args = tuple(_CopyToGroup.apply(a, group) if is_memory(a) and a.requires_grad else a for a in args)
        kwargs = {k: _CopyToGroup.apply(v, group) if is_memory(v) and v.requires_grad else v for k, v in kwargs.items()}
        memory = {t.shape[1] for t in (*args, *kwargs.values()) if is_memory(t)}
        mode = _UlyssesAttention(group, memory)
        with mode:
            out = forward(*args, **kwargs)
        if mode.calls == 0:
            raise RuntimeError(
                f"{model_class(block).__name__} ran without calling F.scaled_dot_product_attention, so Ulysses "
                "sequence parallelism cannot split its attention; choose sp='megatron' or 'none' for this block"
            )
        return out

    block.forward = ulysses_forward


def _argument_names(signature: inspect.Signature | None, count: int) -> list[str | None]:
    if signature is None:
        return [None] * count
    params = [
        p.name
        for p in list(signature.parameters.values())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return (params + [None] * count)[:count]


def _key(index: int, names: list[str | None], positions: Mapping[str | int, int]) -> str | int | None:
    """The key under which positional argument ``index`` is declared per position, if it is."""
    if index in positions:
        return index
    name = names[index]
    return name if name in positions else None
