"""Tensor parallelism inside one block, with DTensor.

``nn.Linear`` layers use PyTorch's own ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` styles through ``parallelize_module``. Hugging Face's ``Conv1D`` (GPT-2: a
linear layer with a transposed weight, and a fused query/key/value projection) has no built-in
style; :class:`ColwiseFused` and :class:`RowwiseFused` (``conv1d=True``) keep its weights as DTensors (so sharding,
FSDP2 and checkpoints work as for any parameter) and compute on the local shards with the two
Megatron collectives: identity forward / all-reduce backward in front of a column-parallel layer,
all-reduce forward / identity backward behind a row-parallel one. A fused projection of ``k``
equal parts (``q, k, v``) is sharded with ``_StridedShard`` so that each rank holds its slice of
every part, which is what the attention code downstream splits. The fused bias stays whole on every
rank (FSDP2 cannot shard a dimension that is already strided-sharded): each rank adds its slices and
its gradient is summed over the group.

PyTorch's ``nn.MultiheadAttention`` is split by :mod:`lightning_galvatron.runtime.multihead_attention`.

Fused projections of other layouts (:class:`ColwiseFused`) are described by their output sections
(``q, k, v`` of possibly different sizes), each split by heads or kept whole on every rank (the one
key/value head of multi-query attention). Equal sections all split are strided shards as above; any
other mix keeps the weight whole on every rank and uses this rank's rows, with the gradient summed
over the group (each rank's rows of split sections get gradient only from that rank, rows kept whole
from every rank): exact, but the weight is not divided by the degree. Weights inside a split attention that apply
to each head alike (a norm one head wide over the queries and keys, :class:`PerHeadWeights`) stay whole the same
way: each rank applies them to its heads, and their gradient is summed over the group.

Megatron sequence parallelism needs two more pieces: :class:`GatherSequence` gathers the sequence
of a sub-layer's hidden states (found as its first tensor argument or its ``hidden_states=``
keyword, so Hugging Face attention modules called by keyword work), and the row-parallel styles
reduce-scatter their partial outputs along the sequence. Activations stay plain local tensors in
between; every copy of a replicated activation carries the full gradient (the runtime's convention).

What to split in a block is a :class:`BlockTensorParallelPlan`: the runtime defines the type and
executes it; the model side (``model/tensor_parallel_plans.py`` and the families) builds one per block
type, and the glue resolves them per block and hands them to the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_galvatron.plan.rules import degree_problem
from lightning_galvatron.runtime.structure import HF_POSITION_INPUTS

# ---------------------------------------------------------------------------------------------- block plans
StylesFn = Callable[[bool], Mapping[str, ParallelStyle]]

NO_MEGATRON_SP = "the block has no Megatron sequence-parallel plan"
NO_ULYSSES = "the block cannot run Ulysses (its attention does not call F.scaled_dot_product_attention)"


@dataclass(frozen=True)
class BlockTensorParallelPlan:
    """How to split one block type.

    Attributes:
        styles: ``styles(sequence_parallel)`` -> submodule name -> ``ParallelStyle``.
        divisible: named sizes every tensor-parallel degree must divide (attention heads, key/value heads,
            widths).
        megatron_sp: the plan has a Megatron sequence-parallel variant.
        ulysses: the block can run Ulysses sequence parallelism (its attention calls
            ``F.scaled_dot_product_attention``; masks over all keys and per-position inputs are handled).
        localize: fix attributes holding global sizes after splitting, ``localize(block, tp)``.
        ulysses_divisible: named sizes every Ulysses degree must divide (the query heads; key/value heads
            that a degree does not divide are repeated); by default the attention heads of ``divisible``.
        position_inputs: block inputs (names, or positions of positional arguments) with one entry per
            sequence position, and the dimension of the positions (see :data:`HF_POSITION_INPUTS`).
        folded_inputs: block inputs whose first dimension is the batch times a factor (BLOOM's ALiBi bias
            is ``[batch x heads, 1, keys]``): name -> factor; they move with their samples as the rest.
        shared_inputs: block inputs that are the same for every sample (MPT's ALiBi bias ``[heads, 1, keys]``):
            never moved with the samples, whatever their first dimension.
        why_not_megatron_sp, why_not_ulysses: what to tell a user who asks for them.
    """

    styles: StylesFn
    divisible: Mapping[str, int] = field(default_factory=dict)
    megatron_sp: bool = False
    ulysses: bool = False
    localize: Callable[[nn.Module, int], None] = field(default=lambda block, tp: None)
    ulysses_divisible: Mapping[str, int] | None = None
    position_inputs: Mapping[str | int, int] = field(default_factory=lambda: dict(HF_POSITION_INPUTS))
    folded_inputs: Mapping[str | int, int] = field(default_factory=dict)
    shared_inputs: frozenset[str | int] = frozenset()
    why_not_megatron_sp: str = NO_MEGATRON_SP
    why_not_ulysses: str = NO_ULYSSES

    @property
    def ulysses_sizes(self) -> Mapping[str, int]:
        """Sizes a Ulysses degree must divide (besides the sequence length)."""
        if self.ulysses_divisible is not None:
            return self.ulysses_divisible
        heads = {k: v for k, v in self.divisible.items() if k == "attention heads"}
        return heads or dict(self.divisible)

    def row_parallel_layers(self) -> int:
        """All-reduces per forward under Megatron TP: one behind each row-parallel layer (PyTorch's
        ``RowwiseParallel``, or a style of ours whose ``reduces_output`` says so: an attention split whole ends
        in its output projection)."""
        return sum(
            isinstance(s, RowwiseParallel) or getattr(s, "reduces_output", False) for s in self.styles(False).values()
        )

    def unsupported(self, tp: int, sp: str) -> str | None:
        """Why ``(tp, sp)`` cannot run exactly on this block, or ``None`` if it can.

        The block's half of the rules of :mod:`lightning_galvatron.plan.rules`: which styles it has and which sizes
        they split; the arithmetic is :func:`~lightning_galvatron.plan.rules.degree_problem`. The sequence a
        sequence-parallel degree must divide is the data's (:func:`~lightning_galvatron.plan.rules.sequence_problem`).
        """
        if sp == "ulysses" and not self.ulysses:
            return self.why_not_ulysses
        problem = degree_problem(tp, self.ulysses_sizes if sp == "ulysses" else self.divisible)
        if problem is not None:
            return problem
        if sp == "megatron" and not self.megatron_sp:
            return self.why_not_megatron_sp
        return None


# ---------------------------------------------------------------------------------------------- Megatron collectives
class _CopyToGroup(torch.autograd.Function):
    """Identity forward; sums the input gradient over the tensor-parallel group in backward."""

    if TYPE_CHECKING:  # torch leaves ``Function.apply`` untyped

        @classmethod
        def apply(cls, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor: ...

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Sums partial outputs over the tensor-parallel group; identity backward."""

    if TYPE_CHECKING:  # torch leaves ``Function.apply`` untyped

        @classmethod
        def apply(cls, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor: ...

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
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


def _replicated_input(x: torch.Tensor) -> torch.Tensor:
    """A sub-layer input as the plain tensor every rank of the group holds in full."""
    return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local() if isinstance(x, DTensor) else x


def fused_rows(sections: Sequence[int], split: Sequence[bool], tp: int, tp_rank: int) -> list[int]:
    """Output features of a fused projection that rank ``tp_rank`` of ``tp`` computes: its part of every
    split section (contiguous heads), every feature of the sections kept whole."""
    rows: list[int] = []
    offset = 0
    for size, divided in zip(sections, split):
        if divided:
            if size % tp:
                raise ValueError(
                    f"tensor-parallel degree {tp} does not divide a fused projection section of {size} features"
                )
            part = size // tp
            rows += range(offset + tp_rank * part, offset + (tp_rank + 1) * part)
        else:
            rows += range(offset, offset + size)
        offset += size
    return rows


class ColwiseFused(ParallelStyle):
    """Split a fused projection (an ``nn.Linear``, or a Hugging Face ``Conv1D`` with ``conv1d=True``) along its
    output ``sections``; ``split[i]`` False keeps section ``i`` whole on every rank (see the module docstring).

    ``ColwiseFused((h, h, h))`` is GPT-2's fused q/k/v; ``ColwiseFused((h, d, d), (True, False, False))`` a
    multi-query projection; ``ColwiseFused((d,), (False,))`` a key or value projection kept whole.
    """

    def __init__(self, sections: Sequence[int], split: Sequence[bool] | None = None, conv1d: bool = False) -> None:
        super().__init__()
        self.sections = tuple(sections)
        self.split = tuple(split) if split is not None else (True,) * len(self.sections)
        self.conv1d = conv1d

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        tp, tp_rank = device_mesh.size(), device_mesh.get_local_rank()
        out_dim = 1 if self.conv1d else 0
        strided = all(self.split) and len(set(self.sections)) == 1
        rows = torch.tensor(
            fused_rows(self.sections, self.split, tp, tp_rank), device=cast(torch.Tensor, module.weight).device
        )
        if strided:
            parts = len(self.sections)
            placement = Shard(out_dim) if parts == 1 else _StridedShard(out_dim, split_factor=parts)
            _distribute_parameter(module, "weight", device_mesh, placement)
            if parts == 1:
                _distribute_parameter(module, "bias", device_mesh, Shard(0))

        def local_weight() -> torch.Tensor:
            if strided:
                return cast(DTensor, module.weight).to_local()
            return _CopyToGroup.apply(cast(torch.Tensor, module.weight), group).index_select(out_dim, rows)

        def local_bias() -> torch.Tensor | None:
            if module.bias is None:
                return None
            if strided and len(self.sections) == 1:
                return cast(DTensor, module.bias).to_local()
            # A fused bias stays whole (FSDP2 cannot shard a strided dimension): this rank's features, the
            # gradient summed over the group.
            return _CopyToGroup.apply(cast(torch.Tensor, module.bias), group).index_select(0, rows)

        def forward(x: torch.Tensor) -> torch.Tensor:
            x = _CopyToGroup.apply(_replicated_input(x), group)
            if self.conv1d:
                return _conv1d_forward(x, local_weight(), local_bias())
            return F.linear(x, local_weight(), local_bias())

        module.forward = forward
        return module


class PerHeadWeights(ParallelStyle):
    """A module whose weights apply alike to each head it receives (Qwen3's and Gemma3's ``q_norm``/``k_norm``:
    an RMSNorm over one head's width), inside a split attention: the weights stay whole on every rank, each rank
    applies them to its own heads, so each rank's gradient covers only its heads and is summed over the group."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        # Each behind the Megatron copy: identity forward, gradient summed over the group.
        _read_own_parameters_as(module, lambda p: _CopyToGroup.apply(p, group))
        return module


class SplitPerHead(ParallelStyle):
    """A module's own 1-D parameters with one entry per head (GPT-OSS's attention sinks) split with the heads: each
    rank holds its heads' entries (a DTensor sharded as the projections are, so ZeRO and checkpoints see it) and its
    forward reads them as plain local tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in [name for name, p in module._parameters.items() if p is not None]:
            _distribute_parameter(module, name, device_mesh, Shard(0))
        _read_own_parameters_as(module, lambda p: cast(DTensor, p).to_local())
        return module


def _read_own_parameters_as(module: nn.Module, view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make ``module``'s forward read each of its own parameters as ``view(parameter)``: the parameters present
    when it runs (FSDP2's unsharded ones during a step), swapped in for the call only; the module keeps its own."""
    forward = module.forward

    def viewed(*args: object, **kwargs: object) -> object:
        held = {name: p for name, p in module._parameters.items() if p is not None}
        try:
            for name, p in held.items():
                module._parameters[name] = view(p)  # type: ignore[assignment]  # a plain tensor, for this call
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(held)

    module.forward = viewed


class RowwiseFused(ParallelStyle):
    """Split a projection along its inputs where ``RowwiseParallel`` cannot: a Hugging Face ``Conv1D``
    (``conv1d=True``: a transposed weight), or inputs that come in ``sections`` equal parts each split over the
    group (CodeGen's heads, grouped in 4 partitions of which every rank holds its share: a strided shard). The
    partial outputs are summed (with ``sequence_parallel``, reduce-scattered along the sequence), then the bias,
    kept whole, is added."""

    reduces_output = True

    def __init__(self, sections: int = 1, *, conv1d: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sections, self.conv1d, self.sequence_parallel = sections, conv1d, sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        in_dim = 0 if self.conv1d else 1
        placement = Shard(in_dim) if self.sections == 1 else _StridedShard(in_dim, split_factor=self.sections)
        _distribute_parameter(module, "weight", device_mesh, placement)
        _distribute_parameter(module, "bias", device_mesh, Replicate())

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = cast(DTensor, module.weight).to_local()
            partial = _conv1d_forward(x, weight, None) if self.conv1d else F.linear(x, weight)
            if module.bias is None:
                bias = None
            elif self.sequence_parallel:  # each rank adds it to its own positions: the gradient is summed
                bias = _CopyToGroup.apply(cast(DTensor, module.bias).to_local(), group)
            else:
                bias = cast(DTensor, module.bias).to_local()
            out = (
                reduce_scatter_sequence(partial, device_mesh)
                if self.sequence_parallel
                else _ReduceFromGroup.apply(partial, group)
            )
            return out + bias if bias is not None else out

        module.forward = forward
        return module


def reduce_scatter_sequence(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum partial outputs over the group and keep this rank's part of the sequence (dim 1)."""
    summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
    return summed.redistribute(mesh, [Shard(1)]).to_local()


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence (dim 1) from every rank's part; the gradient of the result is the full one on every
    rank (the runtime's convention), so its backward keeps this rank's part."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()]).to_local()
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class GatherSequence(ParallelStyle):
    """Megatron-SP: a sub-layer (attention, MLP) receives its hidden states split along the sequence and
    computes on the whole sequence. The hidden states are its first tensor argument or ``hidden_states=``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            index = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
            if index is not None:
                args = (*args[:index], gather_sequence(args[index], device_mesh), *args[index + 1 :])
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                kwargs = {**kwargs, "hidden_states": gather_sequence(kwargs["hidden_states"], device_mesh)}
            else:
                raise RuntimeError(f"{type(mod).__name__} was called without hidden states to gather")
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class SliceHeads(ParallelStyle):
    """Per-head inputs of an attention module (an ALiBi bias, a relative position bias) made from all the
    heads outside it: this rank's heads, the gradient summed over the group (each rank uses its heads).

    ``inputs`` maps a keyword argument to ``slice(tensor, tp, tp_rank) -> local tensor``.
    """

    def __init__(self, inputs: Mapping[str, Callable[[torch.Tensor, int, int], torch.Tensor]]) -> None:
        super().__init__()
        self.inputs = dict(inputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        tp, tp_rank = device_mesh.size(), device_mesh.get_local_rank()

        def hook(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            kwargs = dict(kwargs)
            for name, local in self.inputs.items():
                value = kwargs.get(name)
                if isinstance(value, torch.Tensor):
                    kwargs[name] = local(_CopyToGroup.apply(value, group), tp, tp_rank)
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def head_slice(dim: int, heads: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """This rank's heads of a tensor with ``heads`` heads along ``dim`` (a dimension of 1 broadcasts)."""

    def local(x: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        if x.shape[dim] == 1:
            return x
        if x.shape[dim] != heads:
            raise ValueError(f"expected {heads} heads along dimension {dim}, got a tensor of shape {tuple(x.shape)}")
        part = heads // tp
        return x.narrow(dim, tp_rank * part, part)

    return local


def all_gather_heads(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Every rank's heads of ``x`` (split along ``dim``) joined; backward keeps this rank's part of the full
    gradient (every copy of the result carries it)."""
    return DTensor.from_local(x, mesh, [Shard(dim)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class CopyOutput(ParallelStyle):
    """Return a copy of the module's output: DTensor's local outputs are views that the model may not modify in
    place (Falcon adds its attention output to its MLP's with ``+=``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, args, output: output.clone())
        return module


class ColwiseEmbedding(ParallelStyle):
    """An ``nn.Embedding`` whose columns are heads (T5's relative position bias): each rank keeps and looks
    up its heads' columns."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Embedding)  # what this style splits
        _distribute_parameter(module, "weight", device_mesh, Shard(1))

        def forward(indices: torch.Tensor) -> torch.Tensor:
            return F.embedding(
                indices,
                cast(DTensor, module.weight).to_local(),
                module.padding_idx,
                module.max_norm,
                module.norm_type,
                module.scale_grad_by_freq,
                module.sparse,
            )

        module.forward = forward  # type: ignore[method-assign, assignment]
        return module


def apply_tensor_parallel(block: nn.Module, styles: Mapping[str, ParallelStyle], tp_mesh: DeviceMesh) -> None:
    """Split ``block``'s submodules over ``tp_mesh`` as ``styles`` (submodule name -> style) say."""
    parallelize_module(block, tp_mesh, dict(styles))
