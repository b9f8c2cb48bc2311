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
   GPTBigCode, MPT, CodeGen, BART, Whisper, T5, GPT-Neo, LitGPT, ``nn.Transformer*``; the attention of Mixtral,
   Qwen2-MoE and OLMoE with their experts whole),
   registered through the same function by qualified class name (nothing is imported for them); a
   registration for a class wins over one for its base classes, a user's over a built-in one;
2. BERT-style encoder layers found by their structure (BERT, RoBERTa and others with
   ``attention.self.query/key/value``, ``attention.output.dense``, ``intermediate.dense``, ``output.dense``);
3. inference for blocks built from ``nn.Linear`` layers with the usual names (``q_proj``/``k_proj``/
   ``v_proj``/``out_proj``/``o_proj``, a fused ``c_attn``/``qkv``, ``up_proj``/``gate_proj``/``down_proj``,
   ``w1``/``w2``/``w3``, ``c_fc``/``c_proj``, ``fc1``/``fc2`` also on the block itself, ...): the example GPT,
   nanoGPT- and minGPT-style blocks, a Llama written from scratch, Hugging Face layers without a plan of their
   own. Head counts and widths an attention's forward reads from its own attributes (``self.n_head``,
   ``self.n_embd``, ``self.num_heads``, ...) are divided by the degree; an attention that reads its width from its
   input (nanoGPT's ``B, T, C = x.size()``) receives this rank's part of it (``NarrowedInput``); what a sub-layer
   holds between its split projections must apply to each head alike (a norm one head wide). The guess is then
   proven on the block (:mod:`~lightning_galvatron.model.tensor_parallel_proof`: every rank's split forward
   simulated in one process against the whole block, trying a fused q/k/v laid out ``[q | k | v]`` and head by
   head, without and then with the narrowed input), and so is its Megatron-SP variant; a guess that is wrong or
   cannot be proven is refused with why (a wrong Megatron-SP variant alone: that variant).

A block with no plan is offered ``tp = 1`` only, and the strategy says why once.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_galvatron.model.discovery import ModelStructure, model_class
from lightning_galvatron.model.plan_registry import PlanFactory, add_plan, find_plan, library_release

# The runtime defines the plan type it executes; families fill it in (model/ -> runtime/).
from lightning_galvatron.runtime.structure import HF_POSITION_INPUTS
from lightning_galvatron.runtime.tensor_parallel import (
    BlockTensorParallelPlan,
    ColwiseFused,
    GatherSequence,
    PerHeadWeights,
    StylesFn,
)

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
    """The plan for ``block``'s type, or why it has none. A plan inferred from layer names is used only once it is
    proven on the block (:mod:`~lightning_galvatron.model.tensor_parallel_proof`)."""
    _load_builtin_families()
    make = find_plan(model_class(block).__mro__)
    if make is not None:
        return _registered_plan(make, block)
    from lightning_galvatron.model.families.bert import bert_style_plan, is_bert_style_layer

    if is_bert_style_layer(block):
        return bert_style_plan(block)
    plans = _linear_plan(block)
    if plans is None:
        return (
            f"no tensor-parallel plan is known for {model_class(block).__name__} (declare one with "
            "lightning_galvatron.register_tensor_parallel_plan)"
        )
    if isinstance(plans, str):
        return f"the tensor-parallel plan inferred for {model_class(block).__name__} cannot run: {plans}"
    return _proven(block, plans)


#: What the proof found per kind of block (see :func:`_signature`): the index of the plan proven and why its Megatron-SP
#: variant is not (``None``: it is, or there is none), or why no plan was.
_PROOFS: dict[tuple, tuple[int, str | None] | str] = {}
#: While :func:`block_tensor_parallel_plans` runs with an example step: how to get the inputs of real block calls.
_EXAMPLES: list[Callable[[], dict[type, tuple[tuple, dict]]]] = []


def _proven(block: nn.Module, plans: list[BlockTensorParallelPlan]) -> BlockTensorParallelPlan | str:
    """The first of ``plans`` that splits ``block`` exactly, or why none is used; proven once per kind of block. Its
    Megatron-SP variant is proven too, and left out with why where it is wrong."""
    from lightning_galvatron.model.tensor_parallel_proof import ANOTHER_FUNCTION, Unprovable, proof_degrees, prove_split

    key = _signature(block)
    name = model_class(block).__name__
    if key not in _PROOFS:
        try:
            call = None if _takes_only_hidden_states(block) else _example_call(block)
            problems = []
            for plan in plans:
                problem = prove_split(block, plan, proof_degrees(plan), call)
                if problem is None:
                    _PROOFS[key] = (len(problems), _sequence_parallel_problem(block, plan, call))
                    break
                problems.append(problem)
            else:
                closest = next((p for p in problems if ANOTHER_FUNCTION in p), problems[0])  # one that ran
                _PROOFS[key] = (
                    f"the tensor-parallel plan inferred for {name} from its nn.Linear layers is wrong for it: "
                    f"{closest} (declare a plan with lightning_galvatron.register_tensor_parallel_plan)"
                )
        except Unprovable as why:  # not remembered: real inputs may come later
            return (
                f"the tensor-parallel plan inferred for {name} from its nn.Linear layers cannot be proven on it: "
                f"{why} (declare a plan with lightning_galvatron.register_tensor_parallel_plan)"
            )
    found = _PROOFS[key]
    if isinstance(found, str):
        return found
    index, sequence_parallel_problem = found
    if sequence_parallel_problem is None:
        return plans[index]
    return dataclasses.replace(
        plans[index],
        megatron_sp=False,
        why_not_megatron_sp=f"the Megatron-SP variant of the plan inferred for {name} is wrong for it: "
        f"{sequence_parallel_problem} (register a plan for it)",
    )


def _sequence_parallel_problem(
    block: nn.Module, plan: BlockTensorParallelPlan, call: tuple[tuple, dict] | None
) -> str | None:
    """Why ``plan``'s Megatron-SP variant does not compute what ``block`` computes, or ``None`` (also without one)."""
    from lightning_galvatron.model.tensor_parallel_proof import Unprovable, proof_degrees, prove_split

    if not plan.megatron_sp:
        return None
    try:
        return prove_split(block, plan, proof_degrees(plan), call, sequence_parallel=True)
    except Unprovable as why:
        return f"it cannot be proven ({why})"


def _signature(block: nn.Module) -> tuple:
    """What the proof's verdict depends on: the classes of the block and its modules, its weights' shapes and its
    modules' plain settings (head counts; not whether they train)."""
    settings = tuple(
        (name, key, value)
        for name, m in block.named_modules()
        for key, value in sorted(vars(m).items())
        if key != "training" and isinstance(value, (int, float, bool, str, type(None)))
    )
    shapes = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
    classes = tuple((name, model_class(m)) for name, m in block.named_modules())
    return classes, shapes, settings


def _example_call(block: nn.Module) -> tuple[tuple, dict]:
    from lightning_galvatron.model.tensor_parallel_proof import Unprovable

    calls = _EXAMPLES[-1]() if _EXAMPLES else {}
    call = calls.get(model_class(block))
    if call is None:
        raise Unprovable(
            "its forward takes more than its hidden states, and no call of it was observed to take them from"
        )
    return call


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


def block_tensor_parallel_plans(
    structure: ModelStructure, step: str | None = None, batch: Callable[[], Any] | None = None
) -> list[BlockTensorParallelPlan | str]:
    """The plan (or why there is none) of every block, in order: what the glue hands to the runtime.

    With the name of a LightningModule step and ``batch`` (a function returning an example batch), inferred plans of
    blocks that take more than their hidden states are proven on the inputs of a real call, observed once by running
    the step on one sample up to the blocks (only if such a block needs it).
    """
    if step is None or batch is None:
        return [tensor_parallel_plan_or_reason(block) for block in structure.blocks]
    from lightning_galvatron.model.tensor_parallel_proof import Unprovable, example_calls

    observed: list[dict[type, tuple[tuple, dict]]] = []

    def calls() -> dict[type, tuple[tuple, dict]]:
        if not observed:
            try:
                observed.append(example_calls(structure.root, structure.blocks, step, batch()))
            except Unprovable:
                raise
            except Exception as error:
                raise Unprovable(f"running {step} on an example failed ({type(error).__name__}: {error})") from error
        return observed[0]

    _EXAMPLES.append(calls)
    try:
        return [tensor_parallel_plan_or_reason(block) for block in structure.blocks]
    finally:
        _EXAMPLES.pop()


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
        "c_fc2",
        "fc_1",
        "fc_2",
        "wi",
        "wi_0",
        "wi_1",
    }
)
_ATTENTION_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"})
#: Query, key and value projections fused in one ``nn.Linear`` (nanoGPT's and minGPT's ``c_attn``, ``qkv``).
FUSED_NAMES = frozenset({"c_attn", "qkv", "qkv_proj", "Wqkv", "wqkv", "to_qkv"})
ROW_NAMES = frozenset({"out_proj", "o_proj", "down_proj", "fc2", "w2", "wo", "fc_out", "c_proj", "proj"})
_HEAD_ATTRIBUTES = ("num_heads", "n_head", "num_attention_heads", "n_heads", "n_local_heads")
_KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_local_kv_heads")


def _parent(name: str) -> str:
    """The sub-layer holding the layer ``name`` (relative to the block): ``""`` for a layer of the block itself."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def _linear_plan(block: nn.Module) -> list[BlockTensorParallelPlan] | str | None:
    """The plans a block of ``nn.Linear`` layers with the usual names may take (several where a fused q/k/v
    projection may be laid out ``[q | k | v]`` or head by head), each still to be proven
    (:mod:`~lightning_galvatron.model.tensor_parallel_proof`); ``None`` where the names do not say, or why the
    layers' roles are clear but the block still cannot be split."""
    from lightning_galvatron.model.families._common import Compose, NarrowedInput, local_heads, per_head_styles

    columns, rows, fused, whole = [], [], [], []
    for name, module in block.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_NAMES:
            columns.append((name, module))
        elif leaf in FUSED_NAMES:
            columns.append((name, module))
            fused.append(name)
        elif leaf in ROW_NAMES:
            rows.append((name, module))
        elif "." not in name:
            whole.append(name)  # on the block, between its sub-layers: it sees whole hidden states and stays whole
        else:
            return None  # an unknown projection inside a sub-layer: splitting the rest would change the maths
    if not columns or not rows:
        return None
    if {_parent(n) for n, _ in columns} != {_parent(n) for n, _ in rows}:
        return None  # every group of column-parallel layers must end in a row-parallel one
    heads = _attention_heads(block)
    if heads is None:
        return None
    column_parents = {_parent(n) for n, _ in columns if "." in n}
    extra: dict[str, ParallelStyle] = {}
    local_sizes: dict[str, list[str]] = {}
    attentions: dict[str, list[str]] = {}  # attention sub-layer -> its column layers (names in it)
    for parent in sorted(column_parents):
        module = block.get_submodule(parent)
        read = _reads_global_sizes(module)
        if read and any(attribute.startswith("self.config.") for attribute in read.split(", ")):
            return f"{parent} reads {read} in forward, a size tensor parallelism divides by the degree"
        # Head counts and widths read in forward are divided by the degree; the proof shows whether that is all.
        local_sizes[parent] = [
            a.removeprefix("self.") for a in (read.split(", ") if read else []) if _local_size(module, a)
        ]
        head_dim = _head_dim(module, heads, columns, parent)
        if head_dim is not None and type(module).forward is not nn.Module.forward:
            attentions[parent] = [n[len(parent) + 1 :] for n, _ in columns if _parent(n) == parent]
        per_head = per_head_styles(
            module, parent, head_dim, {name for name, _ in columns + rows}, heads["attention heads"]
        )
        if isinstance(per_head, str):
            return per_head
        extra |= per_head
    layouts = _fused_layouts(block, fused, heads)
    if isinstance(layouts, str):
        return layouts
    widths = {f"{name} width": m.out_features for name, m in columns if name not in fused} | {
        f"{name} width": m.in_features for name, m in rows
    }
    norms = [name for name, m in block.named_children() if "norm" in type(m).__name__.lower() or name.startswith("ln")]
    single_input = _takes_only_hidden_states(block)
    # Megatron-SP gathers the sequence on entry to each sub-layer: it must be a module the block calls. The variant is
    # proven as the plain one is (on a real call's inputs where the block takes more than its hidden states).
    called = all(type(block.get_submodule(p)).forward is not nn.Module.forward for p in column_parents)
    megatron_sp = bool(norms) and all("." in n for n, _ in columns) and called and not whole
    # Under Megatron-SP, weights outside the split sub-layers and the norms (a mixture of experts kept whole) run on
    # each rank's positions: whole on every rank, their gradient summed over the group (PerHeadWeights' convention).
    on_positions = {
        name: PerHeadWeights()
        for name, module in block.named_modules()
        if name
        and any(True for _ in module.parameters(recurse=False))
        and not any(name == p or name.startswith(f"{p}.") for p in (*column_parents, *norms))
        and name not in {n for n, _ in columns + rows}
    }

    def localize(module: nn.Module, tp: int) -> None:
        for parent, attributes in local_sizes.items():
            local_heads(module.get_submodule(parent), tp, *attributes)

    inferred = f"the plan inferred for {model_class(block).__name__} from its nn.Linear layers"
    more_inputs = f"{inferred} runs it only on blocks whose forward takes nothing but the hidden states"
    why_not_megatron_sp = (
        f"{inferred} found no norm on the residual stream, a projection outside a sub-layer, a layer it keeps whole or "
        "a sub-layer the block does not call"
    )
    plans = []
    # An attention that reads its width from its input gets this rank's part of it (NarrowedInput): tried after the
    # plain plans, since the proof shows which one computes what the block computes.
    variants = [(layout, False) for layout in layouts] + [(layout, True) for layout in layouts if attentions]
    for layout, narrowed in variants:

        def styles(
            sequence_parallel: bool, layout: dict[str, ParallelStyle] = layout, narrowed: bool = narrowed
        ) -> dict[str, ParallelStyle]:
            out: dict[str, ParallelStyle] = {name: ColwiseParallel() for name, _ in columns} | layout
            for name, _ in rows:
                out[name] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
            if sequence_parallel:
                out |= on_positions
                for norm in norms:
                    out[norm] = SequenceParallel(use_local_output=True)  # plain tensors between the sub-layers
                for parent in {_parent(n) for n, _ in columns}:
                    out[parent] = GatherSequence()  # its hidden states: the first tensor or hidden_states=
            if narrowed:
                for parent, names in attentions.items():
                    out[parent] = NarrowedInput(names, sequence_parallel)
            for name, style in extra.items():
                out[name] = Compose(out[name], style) if name in out else style
            return out

        plans.append(
            BlockTensorParallelPlan(
                styles,
                heads | widths,
                megatron_sp=megatron_sp,
                ulysses=single_input,
                localize=localize,
                why_not_megatron_sp=f"{why_not_megatron_sp} (register a plan for it)",
                why_not_ulysses=f"{more_inputs} (register a plan for it)",
            )
        )
    return plans


def _fused_layouts(block: nn.Module, fused: list[str], heads: dict[str, int]) -> list[dict[str, ParallelStyle]] | str:
    """The layouts a fused q/k/v projection may have, as styles: ``[q | k | v]`` (each rank its heads of each part)
    or head by head (each rank a contiguous run of whole heads' q, k and v); one empty layout where none is fused."""
    if not fused:
        return [{}]
    query_heads = heads["attention heads"]
    kv_heads = heads.get("key/value heads", query_heads)
    sections_of = {}
    for name in fused:
        width = block.get_submodule(name).out_features
        if width % (query_heads + 2 * kv_heads):
            return (
                f"{name} has {width} output features, not {query_heads} query and 2 x {kv_heads} key/value heads of "
                "one width (declare a plan with lightning_galvatron.register_tensor_parallel_plan)"
            )
        head = width // (query_heads + 2 * kv_heads)
        sections_of[name] = (query_heads * head, kv_heads * head, kv_heads * head)
    return [
        {name: ColwiseFused(sections) for name, sections in sections_of.items()},
        {name: ColwiseParallel() for name in sections_of},
    ]


def _local_size(module: nn.Module, attribute: str) -> bool:
    """Whether ``self.<size>`` that ``module``'s forward reads is an int of its own that localisation can divide."""
    name = attribute.removeprefix("self.")
    return "." not in name and isinstance(vars(module).get(name), int)


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
    r"n_local_heads|n_local_kv_heads|hidden_size|embed_dim|all_head_size|n_embd|split_size)\b"
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


def _head_dim(
    module: nn.Module, heads: dict[str, int], columns: list[tuple[str, nn.Linear]], parent: str
) -> int | None:
    """One head's width in an attention: its ``head_dim``, else its widest column layer over the heads (a fused q/k/v
    projection over all of its heads); ``None`` in a sub-layer without query/key/value projections (an MLP has no
    heads)."""
    own = [(n.rsplit(".", 1)[-1], m) for n, m in columns if _parent(n) == parent]
    if not any(leaf in _ATTENTION_NAMES or leaf in FUSED_NAMES for leaf, _ in own):
        return None
    if isinstance(getattr(module, "head_dim", None), int):
        return module.head_dim
    query_heads = heads["attention heads"]
    fused = [m.out_features for leaf, m in own if leaf in FUSED_NAMES]
    if fused:
        parts = query_heads + 2 * heads.get("key/value heads", query_heads)
        return fused[0] // parts if fused[0] % parts == 0 else None
    widths = [m.out_features for _, m in own]
    return max(widths) // query_heads if widths and max(widths) % query_heads == 0 else None


def _takes_only_hidden_states(block: nn.Module) -> bool:
    try:
        parameters = list(inspect.signature(model_class(block).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [
        p for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(parameters) == 1 and len(required) == 1
