"""Relocation: move activations between blocks whose layouts differ.

Between blocks, an activation ``X`` of shape ``[batch, seq, ...]`` (one micro-batch of a stage) is a
set of plain local tensors: in an :class:`~lightning_galvatron.plan.layout.ActivationLayout` with ``dp``
data shards and a group of ``tp`` ranks, rank ``r`` holds the batch rows of its dp shard and -- when the block shards
the sequence (Megatron-SP, Ulysses) -- only its group rank's part of the sequence; otherwise the
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

:func:`relocate_inputs` and :func:`relocate_output` are the hooks that do this on the blocks: every
input of a block reaches its layout (the hidden states along batch and sequence, other per-sample
inputs along the batch, tuples of them part by part), and each block list's last output returns to the vocabulary
layout. An input that stays where it is while samples move must be the same on every rank of the stage: the first
step compares a digest of each over the stage and refuses one that differs (rows per sample in a shape not
recognised), which would otherwise be applied to other samples. Before per-sample inputs are exchanged, the ranks of
the stage agree that all of them hold those inputs, for sequences of one length (:func:`_agree_on_per_sample_inputs`):
once per forward, not once per block (each agreement is a host synchronisation on a GPU).
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_galvatron.plan import PlanError
from lightning_galvatron.plan.layout import ActivationLayout, Region
from lightning_galvatron.runtime.mesh import reduce_over_ranks, values_travel
from lightning_galvatron.runtime.recompute import is_recomputing
from lightning_galvatron.runtime.structure import model_class


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
        [_piece(x, t.region, mine).reshape(-1) for t in sorted(sends, key=lambda t: t.target)] or [x.new_empty(0)]
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

    if TYPE_CHECKING:  # torch leaves ``Function.apply`` untyped

        @classmethod
        def apply(
            cls,
            x: torch.Tensor,
            source: ActivationLayout,
            target: ActivationLayout,
            batch: int,
            position: int,
            group: dist.ProcessGroup | None,
        ) -> torch.Tensor: ...

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        source: ActivationLayout,
        target: ActivationLayout,
        batch: int,
        position: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.args = (source, target, batch, position, group)
        return relocate_tensor(x, source, target, batch, position, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
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


# ---------------------------------------------------------------------------------------------- hooks on the blocks
@dataclass
class MicroBatch:
    """The stage's micro-batch size of the forward in flight (learned from the first block's input), and the
    signature of block inputs (:func:`_inputs_signature`) every rank of the stage was found to share in it."""

    size: int = 0
    agreed: tuple[Any, ...] | None = None

    def start(self, size: int) -> None:
        """A forward begins (a micro-batch, a pipeline chunk): its inputs come from a new batch, not yet compared."""
        self.size, self.agreed = size, None


class BlockOutputs:
    """What each block returned besides its hidden states, for the next block (weakly held).

    Some models hand a block's other outputs to the next block (T5's position bias, with the mask added,
    per sample): those are in the previous block's layout, not in the embedding's like inputs made
    outside the blocks, and are moved from there.
    """

    def __init__(self) -> None:
        self._outputs: dict[int, list[weakref.ref[torch.Tensor]]] = {}

    def record(self, block: nn.Module, index: int) -> RemovableHandle:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            extra = output[1:] if isinstance(output, (tuple, list)) else ()
            self._outputs[index] = [weakref.ref(t) for t in extra if isinstance(t, torch.Tensor)]

        return block.register_forward_hook(hook)

    def of(self, index: int) -> Callable[[torch.Tensor], bool]:
        """A test: was this tensor an output of block ``index`` in its latest call? (The same tensor, or an alias of
        it: FSDP2 hands a block the inputs that need gradients through an autograd function of its own.)"""
        return lambda value: any(_same_tensor(ref(), value) for ref in self._outputs.get(index, ()))


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    if a is None or a is b:
        return a is b
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def relocate_inputs(
    block: nn.Module,
    source: ActivationLayout,
    target: ActivationLayout,
    micro_batch: MicroBatch,
    position: int,
    group: dist.ProcessGroup,
    first: bool,
    extras_source: ActivationLayout,
    carried: Callable[[torch.Tensor], bool] | None = None,
    folded: Mapping[str | int, int] | None = None,
    positions: Mapping[str | int, int] | None = None,
    shared: frozenset[str | int] = frozenset(),
) -> list[RemovableHandle]:
    """Forward pre-hook: bring the block's inputs to the ``target`` layout.

    The hidden states (first tensor argument) move from ``source`` (the previous block's layout) along
    batch and sequence; other tensors whose first dimension is the local batch (masks, position
    tables, memory) move from ``extras_source`` (the vocabulary layout) along the batch only -- or from
    the previous block's layout when ``carried(tensor)`` says the previous block returned them.
    ``folded`` names inputs whose first dimension is the batch times a factor (an ALiBi bias per head);
    ``positions`` those with one entry per position, batch-major (position ids); ``shared`` those the same for
    every sample, whatever their first dimension (an ALiBi bias ``[heads, 1, keys]``), which never move.
    Registered before recomputation so that recompute replays from already relocated inputs.
    """
    # Other inputs (masks, positions, an encoder's memory) are made outside the blocks and handed to every
    # block as they are: they always come from the vocabulary layout, whatever the previous block's was.
    batch_only_source = ActivationLayout(extras_source.layout)
    batch_only_target = ActivationLayout(target.layout)
    batch_only_previous = ActivationLayout(source.layout)
    folded = dict(folded or {})
    positions = dict(positions or {})
    unmoved_checked = [False]

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if is_recomputing(module):
            return None
        hidden_index, hidden = next(((i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)), (None, None))
        if hidden is None:
            hidden = kwargs.get("hidden_states")
        if hidden is None:
            raise RuntimeError(f"{type(module).__name__} was called without a hidden-states tensor to relocate")
        if first:
            micro_batch.start(hidden.shape[0] * source.layout.dp)  # the input layout's shards are even
        extras_batch = micro_batch.size // extras_source.layout.dp
        previous_batch = micro_batch.size // source.layout.dp
        seq = source.global_seq(hidden.shape[1])
        slots: list[tuple[str | int, Any]] = [
            *((i, a) for i, a in enumerate(args) if i != hidden_index),
            *kwargs.items(),
        ]
        slots = [(name, v) for name, v in slots if not (hidden_index is None and name == "hidden_states")]
        from_previous = {
            name for name, v in slots if carried is not None and isinstance(v, torch.Tensor) and carried(v)
        }
        if batch_only_previous != batch_only_target:
            # A tensor the previous block returned for every sample at once ([1, ...], T5's position bias without a
            # mask) is used by other samples here: its gradient must flow back per sample, so it travels per sample.
            slots = [
                (
                    name,
                    v.expand(previous_batch, *v.shape[1:])
                    if name in from_previous and v.requires_grad and v.shape[0] == 1 < previous_batch
                    else v,
                )
                for name, v in slots
            ]
            args = tuple(dict(slots).get(i, a) for i, a in enumerate(args))
            kwargs = {k: dict(slots).get(k, v) for k, v in kwargs.items()}
        moves = {name: batch_only_previous if name in from_previous else batch_only_source for name, _ in slots}

        def sample_rows(name: str | int, value: Any) -> bool:
            return name not in shared and _is_per_sample(
                name,
                _unfolded(value, folded.get(name)),
                previous_batch if name in from_previous else extras_batch,
                seq,
                module,
                batch_major=name in positions,
            )

        per_sample = {  # only where something moves: an input that stays where it is needs no reading
            name
            for name, v in slots
            if moves[name] != batch_only_target and any(sample_rows(name, p) for p in _parts(v))
        }
        crossing = _extras_cross_ranks(batch_only_source, batch_only_target, micro_batch.size)
        if crossing or from_previous & per_sample:
            # Every block's decisions follow from the signature, so ranks found to share it need not agree again in
            # this forward while it stays the same. Within a forward it changes only as the model's code does (an
            # input a block returns to the next), alike on every rank; each new forward agrees anew (new samples).
            signature = _inputs_signature(slots, from_previous, seq, micro_batch.size)
            if signature != micro_batch.agreed:
                present = [name in per_sample for name, _ in slots]
                shared_by_all = _agree_on_per_sample_inputs(module, present, seq, group, signature)
                micro_batch.agreed = signature if shared_by_all else None
        if crossing and not unmoved_checked[0]:
            unmoved_checked[0] = True
            unmoved = [
                (name, p)
                for name, v in slots
                if name not in from_previous
                for p in _parts(v)
                if isinstance(p, torch.Tensor) and not (name in per_sample and sample_rows(name, p))
            ]
            _check_unmoved_inputs_agree(module, unmoved, group)

        def move_rows(name: str | int, value: torch.Tensor) -> torch.Tensor:
            moved = relocate(
                _unfolded(value, folded.get(name)), moves[name], batch_only_target, micro_batch.size, position, group
            )
            return moved.flatten(0, 1) if name in folded else moved

        def move(name: str | int, value: Any) -> Any:
            if name == "hidden":
                return relocate(value, source, target, micro_batch.size, position, group)
            if name not in per_sample:
                return value
            if isinstance(value, (tuple, list)):  # rotary (cos, sin) per sample: each part that has its rows
                return type(value)(move_rows(name, p) if sample_rows(name, p) else p for p in value)
            return move_rows(name, value)

        new_args = tuple(move("hidden" if i == hidden_index else i, a) for i, a in enumerate(args))
        new_kwargs = {
            k: move("hidden" if hidden_index is None and k == "hidden_states" else k, v) for k, v in kwargs.items()
        }
        return new_args, new_kwargs

    return [block.register_forward_pre_hook(hook, with_kwargs=True)]


def _parts(value: Any) -> tuple[Any, ...]:
    """A block input's tensors: the parts of a tuple or list (rotary ``(cos, sin)``), else the input itself."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _check_unmoved_inputs_agree(
    block: nn.Module, unmoved: list[tuple[str | int, torch.Tensor]], group: dist.ProcessGroup
) -> None:
    """The inputs that stay where they are while the samples move between ranks must be the same on every rank of
    the stage (a causal mask, positions shared by all samples): one that differs holds something per sample in a
    shape the runtime did not recognise, and each rank would apply its own to other samples -- a silently wrong
    result. Checked once per block (a digest of each tensor's bytes, compared over the stage). Collective."""
    if not values_travel(group):
        return
    digests = [tensor_digest(t) for _, t in unmoved]
    lowest = reduce_over_ranks([*digests, *(-d for d in digests)], dist.ReduceOp.MIN, group)
    n = len(digests)
    differ = [
        name if isinstance(name, str) else f"positional argument {name}"
        for i, (name, _) in enumerate(unmoved)
        if lowest[i] != -lowest[n + i]
    ]
    if differ:
        raise PlanError(
            f"{model_class(block).__name__} received input(s) {', '.join(sorted(set(differ)))} that differ between "
            "ranks but do not hold one row per sample (first dimension the samples of a shard, or declared per "
            "sample): the plan moves the samples between ranks before this block, and these inputs could not follow "
            "them. Declare them with lightning_galvatron.register_tensor_parallel_plan(<block class>, ..., "
            "folded_inputs={<input>: <rows per sample>}) (or shared_inputs=[...] for inputs the same for every "
            "sample), or keep these blocks in the embedding's layout"
        )


def tensor_digest(tensor: torch.Tensor) -> float:
    """48 bits of a hash of a tensor's shape and bytes, exact as a float64 (0 for a tensor without readable data:
    the dry run's fake tensors)."""
    if type(tensor) is not torch.Tensor or tensor.device.type == "meta":
        return 0.0
    data = tensor.detach().contiguous().cpu().reshape(-1)
    raw = data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
    digest = hashlib.blake2b(str(tuple(tensor.shape)).encode() + raw.numpy().tobytes(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


def _unfolded(value: Any, factor: int | None) -> Any:
    """``[batch x factor, ...]`` as ``[batch, factor, ...]`` (an input whose rows are per sample and head)."""
    if factor is None or not isinstance(value, torch.Tensor) or value.shape[0] % factor:
        return value
    return value.view(value.shape[0] // factor, factor, *value.shape[1:])


def _is_per_sample(
    name: str | int, value: Any, batch: int, seq: int, block: nn.Module, batch_major: bool = False
) -> bool:
    """Whether a block input other than the hidden states holds one row per sample (and so moves with them).

    Batch-major tensors do (masks ``[b, ...]``, position tables ``[b, s, ...]``, an encoder's memory); a
    ``[seq, seq]`` mask over positions does not -- unless its name says it pads samples, or the block's plan
    says it is a batch-major per-position input (``batch_major``: position ids ``[b or 1, s]``). With as many
    samples per shard as positions, a positional ``[seq, seq]`` input cannot be told apart otherwise: refuse.
    """
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != batch:
        return False
    if value.dim() == 2 and value.shape[1] == seq and batch == seq and "padding" not in str(name) and not batch_major:
        raise PlanError(
            f"{model_class(block).__name__} received a [{seq}, {seq}] input ({name!r}) while each data shard holds "
            f"{batch} samples of {seq} positions: it could be a mask over positions or one row per sample. Pass a "
            "per-sample mask by a keyword with 'padding' in its name, or use a batch per shard other than the "
            "sequence length"
        )
    return True


_CROSSING: dict[tuple[ActivationLayout, ActivationLayout, int], bool] = {}


def _extras_cross_ranks(source: ActivationLayout, target: ActivationLayout, batch: int) -> bool:
    key = (source, target, batch)
    if key not in _CROSSING:
        _CROSSING[key] = any(t.source != t.target for t in exchange_plan(source, target, batch, 1))
    return _CROSSING[key]


def _inputs_signature(
    slots: list[tuple[str | int, Any]], from_previous: set[str | int], seq: int, micro_batch_size: int
) -> tuple[Any, ...]:
    """What decides, for any block, which of its inputs hold rows per sample and how long its sequences are: the
    micro-batch size, the sequence length, and each input's name, origin (the previous block or outside the blocks)
    and the shapes of its tensors (``None`` for a part that is none). Ranks with the same signature take the same
    decisions, block after block. Left out is what differs between the blocks of one forward alike on every rank
    (the dtypes a ZeRO-3 block's mixed precision casts to, a cache object): those blocks need not agree again."""
    return (
        micro_batch_size,
        seq,
        tuple(
            (
                name,
                name in from_previous,
                tuple(tuple(p.shape) if isinstance(p, torch.Tensor) else None for p in _parts(value)),
            )
            for name, value in slots
        ),
    )


def _agree_on_per_sample_inputs(
    block: nn.Module, present: list[bool], seq: int, group: dist.ProcessGroup, signature: tuple[Any, ...]
) -> bool:
    """Ranks that exchange a block's per-sample inputs must all have them (else some would wait forever), for
    sequences of one length (samples of different lengths cannot be stacked into one batch). Returns whether every
    rank has this rank's ``signature`` (:func:`_inputs_signature`), in the same collective. Collective."""
    digest = float(int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=6).digest(), "big"))
    # The least of "has it" and of "lacks it" over the ranks: both 0 where some ranks have it and some do not.
    flags = reduce_over_ranks(
        [int(p) for p in present] + [1 - int(p) for p in present] + [seq, -seq, digest, -digest],
        dist.ReduceOp.MIN,
        group,
    )
    n = len(present)
    shortest, longest = int(flags[2 * n]), -int(flags[2 * n + 1])
    if values_travel(group) and shortest != longest:
        raise PlanError(
            f"{model_class(block).__name__} gathers samples from ranks whose batches have sequences of different "
            f"lengths ({shortest} to {longest} positions): each rank pads its batch to its own longest sample "
            "(dynamic padding, e.g. a collate_fn or DataCollatorWithPadding padding to the longest). Pad every batch "
            "to one fixed length (the tokenizer's padding='max_length' with max_length=, or a collate_fn padding to "
            "a fixed length), or use a plan whose blocks keep the embedding's data-parallel layout (no tensor or "
            "sequence parallelism in the blocks, or vocab tp equal to the blocks' tp)"
        )
    if any(flags[i] == 0 and flags[n + i] == 0 for i in range(n)):
        raise PlanError(
            f"the ranks of a stage passed different inputs to {model_class(block).__name__}: some a per-sample "
            "tensor (e.g. an attention mask), others None. Hugging Face models drop the attention mask of a batch "
            "without padding: pass the mask on every batch (or pad every batch), or keep these blocks in the "
            "embedding's data-parallel layout"
        )
    # Where values do not travel (the dry run's fake backend) the ranks run the same code on the same shapes: alike.
    return not values_travel(group) or flags[2 * n + 2] == -flags[2 * n + 3]


def relocate_output(
    block: nn.Module,
    source: ActivationLayout,
    target: ActivationLayout,
    micro_batch: MicroBatch,
    position: int,
    group: dist.ProcessGroup,
) -> RemovableHandle:
    """Forward hook on the last block: its hidden states back to the vocabulary layout."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return relocate(output, source, target, micro_batch.size, position, group)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            moved = relocate(output[0], source, target, micro_batch.size, position, group)
            return type(output)((moved, *output[1:]))
        raise RuntimeError(f"{type(module).__name__} returned {type(output).__name__}; expected the hidden states")

    return block.register_forward_hook(hook)
