"""Tensor-parallel plans per block type: which submodule is split how, and which degrees are exact.

A :class:`BlockTensorParallelPlan` maps submodule names (relative to the block) to DTensor
``ParallelStyle`` objects, like torchtitan's plans, in two variants: plain tensor parallelism and
Megatron sequence parallelism. It also says which degrees are exact for the block (a degree must
divide the attention heads and the projection widths), whether the block can run Ulysses, which of
its inputs are per position (split with the sequence under Ulysses) and fixes attributes that hold
global sizes (e.g. GPT-2's fused-projection ``split_size``).

Plans come from, in order:

1. plans registered with :func:`register_tensor_parallel_plan`: the user's, and the built-in plans of
   known families (:mod:`lightning_galvatron.model.families`: Hugging Face GPT-2, GPT-NeoX, Llama, Qwen2,
   Qwen3, Mistral, Gemma, Gemma-3, Granite, Helium, SmolLM3, Cohere, Phi, Phi-3, OPT, Falcon, BLOOM, GPT-J,
   GPTBigCode, MPT, CodeGen, BART, T5, LitGPT, ``nn.Transformer*``),
   registered through the same function by qualified class name (nothing is imported for them); a
   registration for a class wins over one for its base classes, a user's over a built-in one;
2. BERT-style encoder layers found by their structure (BERT, RoBERTa and others with
   ``attention.self.query/key/value``, ``attention.output.dense``, ``intermediate.dense``, ``output.dense``);
3. inference for blocks built from ``nn.Linear`` layers with the usual names (``q_proj``/``k_proj``/
   ``v_proj``/``out_proj``/``o_proj``, ``up_proj``/``gate_proj``/``down_proj``, ``fc1``/``fc2``, ...):
   this covers the example GPT and many others whose attention reshapes with ``-1`` heads. What a sub-layer
   holds between its split projections must apply to each head alike (a norm one head wide), and its forward
   must not read a global head count or width (``self.num_heads``): otherwise the block is refused with why.

A block with no plan is offered ``tp = 1`` only, and the strategy says why once.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_galvatron.model.discovery import ModelStructure, model_class
from lightning_galvatron.model.plan_registry import PlanFactory, add_plan, find_plan, library_release

# The runtime defines the plan type it executes; families fill it in (model/ -> runtime/).
from lightning_galvatron.runtime.structure import HF_POSITION_INPUTS
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, StylesFn

__all__ = [
    "HF_POSITION_INPUTS",
    "BlockTensorParallelPlan",
    "block_tensor_parallel_plans",
    "register_tensor_parallel_plan",
    "tensor_parallel_plan",
    "tensor_parallel_plan_or_reason",
    "tp_collectives_per_forward",
]


_BUILTINS_LOADED = False


def _load_builtin_families() -> None:
    """Register the built-in family plans once, before any user registration can be overridden by them."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        import lightning_galvatron.model.families  # noqa: F401 - registers through register_tensor_parallel_plan


def register_tensor_parallel_plan(
    block_class: type | str,
    styles: Mapping[str, ParallelStyle] | StylesFn | None = None,
    *,
    plan: PlanFactory | None = None,
    divisible: Callable[[nn.Module], Mapping[str, int]] | Mapping[str, int] | None = None,
    megatron_sp: bool = False,
    ulysses: bool = False,
    localize: Callable[[nn.Module, int], None] | None = None,
    folded_inputs: Mapping[str | int, int] | None = None,
    shared_inputs: Sequence[str | int] = (),
) -> None:
    """Declare how to split a block class (the class, or its qualified name ``"package.module.Class"``).

    Example::

        register_tensor_parallel_plan(
            MyBlock,
            {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(), "ff.w_in": ColwiseParallel(),
             "ff.w_out": RowwiseParallel()},
            divisible=lambda block: {"attention heads": block.attn.num_heads},
        )

    ``styles`` may also be a function of ``sequence_parallel: bool`` returning such a dict (then pass
    ``megatron_sp=True``). Attention code must reshape with ``-1`` heads (a rank holds ``heads / tp``), or
    ``localize(block, tp)`` must fix the attributes it reads. For plans that depend on the block's
    configuration, pass ``plan=``: a function of the block returning a :class:`BlockTensorParallelPlan`, or a
    string saying why blocks like this one cannot be split (they are then planned with ``tp = 1``).

    Block inputs other than the hidden states (names, or positions of positional arguments) move with their
    samples between blocks of different layouts when their first dimension is the samples of a shard;
    ``folded_inputs`` names those whose first dimension is the samples times a factor (``{"alibi": heads}``),
    ``shared_inputs`` those that are the same for every sample whatever their shape (never moved).
    """
    _load_builtin_families()
    if (styles is None) == (plan is None):
        raise ValueError("register_tensor_parallel_plan needs either styles or plan=")
    if plan is None:
        styles_fn: StylesFn = styles if callable(styles) else (lambda sequence_parallel, s=dict(styles): s)

        def plan(block: nn.Module) -> BlockTensorParallelPlan:
            sizes = divisible(block) if callable(divisible) else dict(divisible or {})
            return BlockTensorParallelPlan(
                styles_fn,
                dict(sizes),
                megatron_sp,
                ulysses,
                localize or (lambda b, tp: None),
                folded_inputs=dict(folded_inputs or {}),
                shared_inputs=frozenset(shared_inputs),
            )

    add_plan(block_class, plan)


def tensor_parallel_plan_or_reason(block: nn.Module) -> BlockTensorParallelPlan | str:
    """The plan for ``block``'s type, or why it has none."""
    _load_builtin_families()
    make = find_plan(model_class(block).__mro__)
    if make is not None:
        return _registered_plan(make, block)
    from lightning_galvatron.model.families.bert import bert_style_plan, is_bert_style_layer

    if is_bert_style_layer(block):
        return bert_style_plan(block)
    plan = _linear_plan(block)
    if plan is None:
        return (
            f"no tensor-parallel plan is known for {model_class(block).__name__} (declare one with "
            "lightning_galvatron.register_tensor_parallel_plan)"
        )
    if isinstance(plan, str):
        return f"the tensor-parallel plan inferred for {model_class(block).__name__} cannot run: {plan}"
    return plan


def _registered_plan(make: PlanFactory, block: nn.Module) -> BlockTensorParallelPlan | str:
    """A registered plan for ``block``, or why it has none -- also where the plan function fails on a block laid out
    otherwise than it expects (a library release that renamed its layers): the block is then planned with
    ``tp = 1`` and the reason reported, instead of the error ending the user's setup."""
    try:
        return make(block)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as error:
        return (
            f"the tensor-parallel plan registered for {model_class(block).__name__} does not fit this block in "
            f"{library_release(block)} ({type(error).__name__}: {error}); declare one with "
            "lightning_galvatron.register_tensor_parallel_plan"
        )


def block_tensor_parallel_plans(structure: ModelStructure) -> list[BlockTensorParallelPlan | str]:
    """The plan (or why there is none) of every block, in order: what the glue hands to the runtime."""
    return [tensor_parallel_plan_or_reason(block) for block in structure.blocks]


def tp_collectives_per_forward(plan: BlockTensorParallelPlan | None) -> int:
    """All-reduces per forward of a block under Megatron TP, as the cost model prices them: one per row-parallel
    layer of its ``plan``; a Megatron block's 2 where there is no plan or it names none."""
    return (plan.row_parallel_layers() if plan is not None else 0) or 2


def tensor_parallel_plan(block: nn.Module) -> BlockTensorParallelPlan | None:
    """The plan for ``block``'s type, or ``None`` if it can only run with ``tp = 1``."""
    plan = tensor_parallel_plan_or_reason(block)
    return plan if isinstance(plan, BlockTensorParallelPlan) else None


# ------------------------------------------------------------------------------------ nn.Linear blocks
COLUMN_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "query",
        "key",
        "value",
        "wq",
        "wk",
        "wv",
        "up_proj",
        "gate_proj",
        "fc1",
        "w1",
        "w3",
        "fc_in",
        "c_fc",
        "wi",
        "wi_0",
        "wi_1",
    }
)
_ATTENTION_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"})
ROW_NAMES = frozenset({"out_proj", "o_proj", "down_proj", "fc2", "w2", "wo", "fc_out", "c_proj"})
_HEAD_ATTRIBUTES = ("num_heads", "n_head", "num_attention_heads", "n_heads")
_KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")


def _linear_plan(block: nn.Module) -> BlockTensorParallelPlan | str | None:
    """The plan of a block of ``nn.Linear`` layers with the usual names; ``None`` where the names do not say,
    or why the layers' roles are clear but the block still cannot be split."""
    from lightning_galvatron.model.families._common import per_head_styles

    columns, rows, parents = [], [], set()
    for name, module in block.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_NAMES:
            columns.append((name, module))
        elif leaf in ROW_NAMES:
            rows.append((name, module))
        else:
            return None  # an unknown projection: splitting the rest would change the maths
        parents.add(name.rsplit(".", 1)[0] if "." in name else "")
    if not columns or not rows:
        return None
    if {n.rsplit(".", 1)[0] for n, _ in columns} != {n.rsplit(".", 1)[0] for n, _ in rows}:
        return None  # every group of column-parallel layers must end in a row-parallel one
    heads = _attention_heads(block)
    if heads is None:
        return None
    column_parents = {n.rsplit(".", 1)[0] for n, _ in columns if "." in n}
    extra: dict[str, ParallelStyle] = {}
    for parent in sorted(column_parents):
        module = block.get_submodule(parent)
        problem = _reads_global_sizes(module)
        if problem:
            return f"{parent} reads {problem} in forward, a size tensor parallelism divides by the degree"
        head_dim = _head_dim(module, heads["attention heads"], columns, parent)
        per_head = per_head_styles(
            module, parent, head_dim, {name for name, _ in columns + rows}, heads["attention heads"]
        )
        if isinstance(per_head, str):
            return per_head
        extra |= per_head
    widths = {f"{name} width": m.out_features for name, m in columns} | {
        f"{name} width": m.in_features for name, m in rows
    }
    norms = [name for name, m in block.named_children() if "norm" in type(m).__name__.lower() or name.startswith("ln")]
    single_input = _takes_only_hidden_states(block)
    megatron_sp = single_input and bool(norms) and all("." in n for n, _ in columns)

    def styles(sequence_parallel: bool) -> dict[str, ParallelStyle]:
        out: dict[str, ParallelStyle] = {name: ColwiseParallel() for name, _ in columns}
        for name, _ in rows:
            out[name] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        if sequence_parallel:
            for norm in norms:
                out[norm] = SequenceParallel()
            for parent in {n.rsplit(".", 1)[0] for n, _ in columns}:
                out[parent] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        return out | extra

    inferred = f"the plan inferred for {model_class(block).__name__} from its nn.Linear layers"
    more_inputs = f"{inferred} runs it only on blocks whose forward takes nothing but the hidden states"
    why_not_megatron_sp = (
        more_inputs
        if not single_input
        else f"{inferred} found no norm on the residual stream or a projection outside a sub-layer"
    )
    return BlockTensorParallelPlan(
        styles,
        heads | widths,
        megatron_sp=megatron_sp,
        ulysses=single_input,
        why_not_megatron_sp=f"{why_not_megatron_sp} (register a plan for it)",
        why_not_ulysses=f"{more_inputs} (register a plan for it)",
    )


def _attention_heads(block: nn.Module) -> dict[str, int] | None:
    for module in block.modules():
        for source in (module, getattr(module, "config", None)):
            heads = next(
                (getattr(source, a) for a in _HEAD_ATTRIBUTES if isinstance(getattr(source, a, None), int)), None
            )
            if heads:
                kv = next(
                    (getattr(source, a) for a in _KV_HEAD_ATTRIBUTES if isinstance(getattr(source, a, None), int)), None
                )
                return {"attention heads": heads} | ({"key/value heads": kv} if kv else {})
    return None


#: Global sizes an attention may read in forward: under tensor parallelism a rank holds 1/tp of them.
_GLOBAL_SIZES = re.compile(
    r"self\.(?:config\.)?(num_heads|num_attention_heads|n_head|n_heads|num_key_value_heads|n_kv_heads|num_kv_heads|"
    r"hidden_size|embed_dim|all_head_size)\b"
)


def _reads_global_sizes(module: nn.Module) -> str | None:
    """``self.<size>`` where ``module``'s forward reads a head count or width (StableLM's attention reshapes with
    ``self.num_heads``): an inferred plan has nothing to divide it with."""
    try:
        source = inspect.getsource(model_class(module).forward)
    except (OSError, TypeError):
        return None
    found = sorted({m.group(0) for m in _GLOBAL_SIZES.finditer(source)})
    return ", ".join(found) or None


def _head_dim(module: nn.Module, heads: int, columns: list[tuple[str, nn.Linear]], parent: str) -> int | None:
    """One head's width in an attention: its ``head_dim``, else its widest column layer over the heads; ``None`` in
    a sub-layer without query/key/value projections (an MLP has no heads)."""
    own = [(n.rsplit(".", 1)[-1], m) for n, m in columns if n.rsplit(".", 1)[0] == parent]
    if not any(leaf in _ATTENTION_NAMES for leaf, _ in own):
        return None
    if isinstance(getattr(module, "head_dim", None), int):
        return module.head_dim
    widths = [m.out_features for _, m in own]
    return max(widths) // heads if widths and max(widths) % heads == 0 else None


def _takes_only_hidden_states(block: nn.Module) -> bool:
    try:
        parameters = list(inspect.signature(model_class(block).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [
        p for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(parameters) == 1 and len(required) == 1
