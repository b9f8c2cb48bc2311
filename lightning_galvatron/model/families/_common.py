"""What the family plans share: a builder from the roles of a block's layers, and small readers.

A family plan names, per block type, the column-parallel projections (split by output features, with
the style that fits their layout), the row-parallel ones (split by input features), the norms on the
residual stream, and the sub-layers whose hidden states Megatron sequence parallelism gathers on
entry. :func:`megatron_plan` turns that into a :class:`BlockTensorParallelPlan` with both variants:
plain tensor parallelism, and Megatron-SP (norms on sequence shards, sub-layers gathering the
sequence, row-parallel outputs reduce-scattered back to sequence shards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_galvatron.model.plan_registry import library_release
from lightning_galvatron.runtime.structure import HF_POSITION_INPUTS, hidden_states_of, with_hidden_states
from lightning_galvatron.runtime.tensor_parallel import (
    BlockTensorParallelPlan,
    GatherSequence,
    PerHeadWeights,
    RowwiseFused,
    SplitPerHead,
    all_gather_heads,
    gather_sequence,
)


class Compose(ParallelStyle):
    """Several styles on one module, applied in order (e.g. gather the sequence and slice per-head inputs)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


class GatherWidth(ParallelStyle):
    """A module inside a split attention that mixes the whole width it receives (OLMo-2's ``q_norm``/``k_norm``: an
    RMSNorm over all heads' queries or keys at once): each rank gathers every rank's part of its input (the last
    dimension, in rank order: the column-parallel layer before it gives each rank a contiguous part), runs the module
    whole, and keeps its own part of the output. Every rank computes the module on the same whole width and the
    slice's backward gathers the output's gradient from every rank, so the module's weights stay whole with the same
    gradient on every rank of the group (as a norm's under plain tensor parallelism)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def gather(mod: nn.Module, args: tuple) -> tuple:
            return (all_gather_heads(args[0], device_mesh, args[0].dim() - 1), *args[1:])

        def keep_part(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            whole = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return whole.redistribute(device_mesh, [Shard(output.dim() - 1)]).to_local()

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(keep_part)
        return module


class NarrowedInput(ParallelStyle):
    """An attention that reads its width from its input (nanoGPT's ``B, T, C = x.size()``, then ``C // self.n_head``
    per head and ``.view(B, T, C)`` before its output projection) receives this rank's part of the width of its hidden
    states, and its column-parallel layers (``columns``, names in it) the whole hidden states: every size it takes from
    its input is then this rank's, as its heads are. The part it receives is detached: only its shape may matter,
    which the proof (:mod:`~lightning_galvatron.model.tensor_parallel_proof`) checks before an inferred plan with it
    is used. With ``sequence_parallel`` (Megatron-SP) the sequence is gathered first."""

    def __init__(self, columns: Sequence[str], sequence_parallel: bool = False) -> None:
        super().__init__()
        self.columns, self.sequence_parallel = tuple(columns), sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        gather = (lambda x: gather_sequence(x, device_mesh)) if self.sequence_parallel else None
        narrow_input(module, self.columns, device_mesh.size(), device_mesh.get_local_rank(), gather)
        return module


def narrow_input(
    module: nn.Module,
    columns: Sequence[str],
    tp: int,
    rank: int,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[Any]:
    """:class:`NarrowedInput`'s hooks on ``module`` as rank ``rank`` of ``tp`` (the proof installs them too); returns
    their handles."""
    whole: list[torch.Tensor] = []

    def narrowed(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        _, x = hidden_states_of(args, kwargs)
        x = gather(x) if gather is not None else x
        whole[:] = [x]
        width = x.shape[-1] // tp
        return with_hidden_states(args, kwargs, x.detach().narrow(-1, rank * width, width))

    def whole_input(mod: nn.Module, args: tuple) -> tuple:
        return (whole[0], *args[1:]) if whole else args

    handles = [module.register_forward_pre_hook(narrowed, with_kwargs=True)]
    # Before the column layer's own input hooks (DTensor's): they see the whole hidden states.
    handles += [module.get_submodule(name).register_forward_pre_hook(whole_input, prepend=True) for name in columns]
    handles.append(module.register_forward_hook(lambda mod, args, output: whole.clear()))
    return handles


def megatron_plan(
    block: nn.Module,
    *,
    columns: Mapping[str, ParallelStyle | None],
    rows: Sequence[str],
    row_sections: Mapping[str, int] | None = None,
    norms: Sequence[str],
    gathers: Sequence[str],
    divisible: Mapping[str, int],
    sequence_dims: Mapping[str, int] | None = None,
    extra: Mapping[str, ParallelStyle] | None = None,
    sequence_extra: Mapping[str, ParallelStyle] | None = None,
    localize: Callable[[nn.Module, int], None] | None = None,
    ulysses: bool | str = False,
    megatron_sp: bool | str = True,
    position_inputs: Mapping[str | int, int] = HF_POSITION_INPUTS,
    folded_inputs: Mapping[str, int] | None = None,
    shared_inputs: Sequence[str] = (),
    ulysses_divisible: Mapping[str, int] | None = None,
    head_dim: int | None = None,
) -> BlockTensorParallelPlan | str:
    """A plan from the roles of ``block``'s layers, or why the block cannot be split.

    Args:
        columns: column-parallel layers and their style (``None``: ``ColwiseParallel``).
        rows: row-parallel layers (``nn.Linear`` or ``Conv1D``).
        row_sections: row-parallel layers whose inputs come in several equal sections, each split (CodeGen's heads,
            grouped in 4 partitions): name -> number of sections.
        norms: norms on the residual stream (on sequence shards under Megatron-SP).
        gathers: sub-layers (or column layers called directly by the block) whose hidden-states input
            Megatron-SP gathers; a column layer named here gathers itself.
        sequence_dims: the sequence dimension where it is not 1 (a block that flattens batch and sequence
            before its MLP, like OPT, shards dimension 0 there; any per-token order works).
        extra: other styles (per-head inputs, outputs to copy), applied after any other style of the same module.
        sequence_extra: styles applied under Megatron-SP only (weights kept whole that see only this rank's part
            of the sequence there: a mixture of experts run on sequence shards, see :mod:`.moe`).
        ulysses, megatron_sp: ``True``, or the reason the block cannot run it.
        head_dim: one head's width, where an attention holds weights that width between its projections (Qwen3's
            ``q_norm``/``k_norm``): they stay whole, their gradient summed over the group (:func:`per_head_styles`,
            which checks every split sub-layer of every plan).
    """
    problem = unexpected_layers(block, [name for name, style in columns.items() if style is None], rows)
    problem = problem or unexpected_layers(block, [*columns, *gathers, *(extra or {})], kinds=None)
    if problem:
        return problem
    dims = dict(sequence_dims or {})
    extra = dict(extra or {})
    styled = {*columns, *rows, *extra}
    for parent in sorted({name.rsplit(".", 1)[0] for name in columns if "." in name}):
        per_head = per_head_styles(block.get_submodule(parent), parent, head_dim, styled)
        if isinstance(per_head, str):
            return per_head
        extra = per_head | extra
    present = {name for name, _ in block.named_modules()}
    norms = [n for n in norms if n in present and not isinstance(block.get_submodule(n), nn.Identity)]

    def styles(sequence_parallel: bool) -> dict[str, ParallelStyle]:
        out: dict[str, ParallelStyle] = {}
        for name, style in columns.items():
            if sequence_parallel and name in gathers:
                assert style is None, f"{name}: a column layer that gathers itself must be a plain nn.Linear"
                out[name] = ColwiseParallel(input_layouts=Shard(dims.get(name, 1)))
            else:
                out[name] = style if style is not None else ColwiseParallel()
        for name in rows:
            conv1d = type(block.get_submodule(name)).__name__ == "Conv1D"
            sections = (row_sections or {}).get(name, 1)
            if conv1d or sections > 1:
                out[name] = RowwiseFused(sections, conv1d=conv1d, sequence_parallel=sequence_parallel)
            else:
                out[name] = (
                    RowwiseParallel(output_layouts=Shard(dims.get(name, 1))) if sequence_parallel else RowwiseParallel()
                )
        if sequence_parallel:
            for name in norms:
                out[name] = SequenceParallel(sequence_dim=dims.get(name, 1), use_local_output=True)
            for name in gathers:
                if name not in columns:
                    out[name] = GatherSequence()
        for name, style in {**extra, **((sequence_extra or {}) if sequence_parallel else {})}.items():
            out[name] = Compose(out[name], style) if name in out else style
        return out

    return BlockTensorParallelPlan(
        styles,
        dict(divisible),
        megatron_sp=megatron_sp is True,
        ulysses=ulysses is True,
        localize=localize or (lambda module, tp: None),
        ulysses_divisible=ulysses_divisible,
        position_inputs=dict(position_inputs),
        folded_inputs=dict(folded_inputs or {}),
        shared_inputs=frozenset(shared_inputs),
        **({"why_not_megatron_sp": megatron_sp} if isinstance(megatron_sp, str) else {}),
        **({"why_not_ulysses": ulysses} if isinstance(ulysses, str) else {}),
    )


#: What a plan splits by its features: ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2's transposed linear).
_SPLITTABLE = ("Linear", "Conv1D")


def unexpected_layers(
    block: nn.Module, *groups: Sequence[str], kinds: Sequence[str] | None = _SPLITTABLE
) -> str | None:
    """Why ``block`` does not hold the layers a family plan names (relative to the block) as the plan expects them:
    one missing, or (with ``kinds``) not a linear layer. A library release that renames or restructures a block
    then gets a reason and ``tp = 1`` rather than an error."""
    present = dict(block.named_modules())
    for name in (name for group in groups for name in group):
        module = present.get(name)
        if module is None:
            return (
                f"{type(block).__name__} has no {name!r}: the plan for it was written for another layout of this block "
                f"({library_release(block)}); declare one with lightning_galvatron.register_tensor_parallel_plan"
            )
        if kinds is not None and not any(cls.__name__ in kinds for cls in type(module).__mro__):
            return (
                f"{type(block).__name__}.{name} is a {type(module).__name__}, not a linear layer the plan can split "
                f"({library_release(block)})"
            )
    return None


def layout_of(block: nn.Module, layouts: Mapping[str, Mapping[str, str]]) -> Mapping[str, str] | str:
    """The first of ``layouts`` (each: role -> layer name) whose layers ``block`` holds as linear layers, or why
    none fits: for blocks whose library has shipped them with other layer names."""
    for names in layouts.values():
        if unexpected_layers(block, list(names.values())) is None:
            return names
    return (
        f"{type(block).__name__} matches none of the layouts its plan knows ({', '.join(layouts)}) in "
        f"{library_release(block)}; declare a plan with lightning_galvatron.register_tensor_parallel_plan"
    )


def hf_sdpa(module: nn.Module) -> bool | str:
    """``True`` if a Hugging Face block's attention calls ``F.scaled_dot_product_attention``, else why not."""
    config = next(
        (m.config for m in module.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")), None
    )
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == "sdpa":
        return True
    return (
        f"its attention implementation is {implementation!r}: Ulysses needs one that calls "
        "F.scaled_dot_product_attention (attn_implementation='sdpa', where the model has it)"
    )


def local_heads(module: nn.Module, tp: int, *names: str) -> None:
    """Divide the head counts (or widths) a module reads in its forward by the degree."""
    for name in names:
        setattr(module, name, getattr(module, name) // tp)


def localize_groups(attn: nn.Module, tp: int, heads: int, kv_heads: int) -> None:
    """Query heads per key/value head on this rank (read when keys are repeated for a mask)."""
    if hasattr(attn, "num_key_value_groups"):
        attn.num_key_value_groups = (heads // tp) // (1 if kv_heads == 1 else kv_heads // tp)


def per_head_styles(
    parent: nn.Module, prefix: str, head_dim: int | None, styled: set[str], heads: int | None = None
) -> dict[str, ParallelStyle] | str:
    """Styles for what a split sub-layer (an attention, an MLP) holds besides the modules the plan ``styled`` (its
    projections; names in the block), or why it cannot be split.

    Between its column- and row-parallel layers a rank sees only its heads (its part of the width). A module
    there whose every weight is one head wide (``q_norm``/``k_norm`` of Qwen3 and Gemma3) applies to each head
    alike: it stays whole, its gradient summed over the group (:class:`PerHeadWeights`). The attention's own 1-D
    weights with one entry per head (GPT-OSS's sinks; ``heads`` given) are split with the heads
    (:class:`SplitPerHead`). Any other weight there
    (a norm over all heads, as OLMo-2's; a per-head parameter) would see part of what it expects.
    """
    styles: dict[str, ParallelStyle] = {}
    for name, module in parent.named_modules():
        weights = list(module.parameters(recurse=False))
        where = f"{prefix}.{name}" if name else prefix
        if where in styled or not weights:
            continue
        if name and head_dim is not None and all(w.dim() == 1 and w.numel() == head_dim for w in weights):
            styles[where] = PerHeadWeights()
            continue
        if not name and heads is not None and all(w.dim() == 1 and w.numel() == heads for w in weights):
            styles[where] = SplitPerHead()
            continue
        shapes = ", ".join(str(tuple(w.shape)) for w in weights)
        return (
            f"{where} ({type(module).__name__}) holds weights of shape {shapes} between the projections that "
            f"tensor parallelism splits{'' if head_dim is None else f' (one head is {head_dim} wide)'}: each rank "
            "would apply it to its part of the heads only (declare a plan with "
            "lightning_galvatron.register_tensor_parallel_plan)"
        )
    return styles
