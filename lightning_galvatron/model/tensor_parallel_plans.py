"""Tensor-parallel plans per block type: which submodule is split how, and which degrees are exact.

A :class:`BlockTensorParallelPlan` maps submodule names (relative to the block) to DTensor
``ParallelStyle`` objects, like torchtitan's plans, in two variants: plain tensor parallelism and
Megatron sequence parallelism. It also says which degrees are exact for the block (a degree must
divide the attention heads and the projection widths) and fixes attributes that hold global sizes
(e.g. GPT-2's fused-projection ``split_size``).

Plans come from, in order:

1. plans registered by the user with :func:`register_tensor_parallel_plan` (for their own blocks);
2. built-in plans for known families: Hugging Face GPT-2, BERT-style encoder layers (BERT, RoBERTa and
   others with ``attention.self.query/key/value``, ``attention.output.dense``, ``intermediate.dense``,
   ``output.dense``; with Megatron sequence parallelism) and PyTorch's ``nn.TransformerEncoderLayer`` /
   ``nn.TransformerDecoderLayer`` (``batch_first=True``; their ``nn.MultiheadAttention`` is split by
   :class:`~lightning_galvatron.runtime.tensor_parallel.ParallelMultiheadAttention`);
3. inference for blocks built from ``nn.Linear`` layers with the usual names (``q_proj``/``k_proj``/
   ``v_proj``/``out_proj``/``o_proj``, ``up_proj``/``gate_proj``/``down_proj``, ``fc1``/``fc2``, ...):
   this covers the example GPT, Llama-style decoders and many others.

A block with no plan is offered ``tp = 1`` only, and the strategy says so once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_galvatron.model.discovery import model_class
from lightning_galvatron.rules import degree_problem
from lightning_galvatron.runtime.tensor_parallel import (
    ColwiseConv1D,
    ParallelMultiheadAttention,
    RowwiseConv1D,
    multihead_attention_unsupported,
)

StylesFn = Callable[[bool], Mapping[str, ParallelStyle]]


@dataclass(frozen=True)
class BlockTensorParallelPlan:
    """How to split one block type.

    Attributes:
        styles: ``styles(sequence_parallel)`` -> submodule name -> ``ParallelStyle``.
        divisible: named sizes every degree must divide (attention heads, key/value heads, widths).
        megatron_sp: the plan has a Megatron sequence-parallel variant.
        ulysses: the block can run Ulysses sequence parallelism (it takes the hidden states as its
            only input and its attention calls ``F.scaled_dot_product_attention``).
        localize: fix attributes holding global sizes after splitting, ``localize(block, tp)``.
    """

    styles: StylesFn
    divisible: Mapping[str, int] = field(default_factory=dict)
    megatron_sp: bool = False
    ulysses: bool = False
    localize: Callable[[nn.Module, int], None] = field(default=lambda block, tp: None)

    def unsupported(self, tp: int, sp: str) -> str | None:
        """Why ``(tp, sp)`` cannot run exactly on this block, or ``None`` if it can.

        The block's half of the rules: which styles it has and which sizes they split (Megatron TP: every
        size in ``divisible``; Ulysses: only the heads, the weights stay whole). The arithmetic is
        :func:`~lightning_galvatron.rules.degree_problem`; the sequence a sequence-parallel degree must
        divide is the data's (:func:`~lightning_galvatron.rules.sequence_problem`).
        """
        if sp == "ulysses":
            if not self.ulysses:
                return "the block cannot run Ulysses (it takes more inputs than the hidden states)"
            return degree_problem(tp, self.heads)
        problem = degree_problem(tp, self.divisible)
        if problem is not None:
            return problem
        if sp == "megatron" and not self.megatron_sp:
            return "the block has no Megatron sequence-parallel plan"
        return None

    @property
    def heads(self) -> dict[str, int]:
        """The head counts among ``divisible`` (names that say "heads"); all of it if none does."""
        return {what: size for what, size in self.divisible.items() if "heads" in what} or dict(self.divisible)


_REGISTRY: dict[type, Callable[[nn.Module], BlockTensorParallelPlan]] = {}


def register_tensor_parallel_plan(
    block_class: type,
    styles: Mapping[str, ParallelStyle] | StylesFn,
    *,
    divisible: Callable[[nn.Module], Mapping[str, int]] | Mapping[str, int] | None = None,
    megatron_sp: bool = False,
    ulysses: bool = False,
    localize: Callable[[nn.Module, int], None] | None = None,
) -> None:
    """Declare how to split your own block class.

    Example::

        register_tensor_parallel_plan(
            MyBlock,
            {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(), "ff.w_in": ColwiseParallel(),
             "ff.w_out": RowwiseParallel()},
            divisible=lambda block: {"attention heads": block.attn.num_heads},
        )

    ``styles`` may also be a function of ``sequence_parallel: bool`` returning such a dict (then pass
    ``megatron_sp=True``). Attention code must reshape with ``-1`` heads (a rank holds ``heads / tp``).
    """
    styles_fn: StylesFn = styles if callable(styles) else (lambda sequence_parallel, s=dict(styles): s)

    def make(block: nn.Module) -> BlockTensorParallelPlan:
        sizes = divisible(block) if callable(divisible) else dict(divisible or {})
        return BlockTensorParallelPlan(styles_fn, dict(sizes), megatron_sp, ulysses, localize or (lambda b, tp: None))

    _REGISTRY[block_class] = make


def tensor_parallel_plan(block: nn.Module) -> BlockTensorParallelPlan | None:
    """The plan for ``block``'s type, or ``None`` if it can only run with ``tp = 1``."""
    cls = model_class(block)
    for registered, make in _REGISTRY.items():
        if issubclass(cls, registered):
            return make(block)
    if cls.__name__ == "GPT2Block" and cls.__module__.startswith("transformers."):
        return _hf_gpt2_plan(block)
    if isinstance(block, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return _torch_transformer_layer_plan(block)
    if _is_bert_style_layer(block):
        return _bert_style_plan(block)
    return _linear_plan(block)


# ------------------------------------------------------------------------------------ Hugging Face GPT-2
def _hf_gpt2_plan(block: nn.Module) -> BlockTensorParallelPlan:
    """GPT-2's ``Conv1D`` layers: fused q/k/v (three parts), output, and the MLP."""
    attn = block.attn

    def styles(sequence_parallel: bool) -> dict[str, ParallelStyle]:
        return {
            "attn.c_attn": ColwiseConv1D(parts=3),
            "attn.c_proj": RowwiseConv1D(),
            "mlp.c_fc": ColwiseConv1D(),
            "mlp.c_proj": RowwiseConv1D(),
        }

    def localize(module: nn.Module, tp: int) -> None:
        module.attn.split_size //= tp  # the fused projection now yields 3 x hidden/tp features
        module.attn.num_heads //= tp

    sizes = {"attention heads": attn.num_heads, "MLP width": block.mlp.c_fc.weight.shape[1]}
    return BlockTensorParallelPlan(styles, sizes, localize=localize)


# ------------------------------------------------------------------------------------ BERT-style encoder layers
_BERT_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                 "intermediate.dense", "output.dense")


def _is_bert_style_layer(block: nn.Module) -> bool:
    """A Hugging Face BERT-family encoder layer (BERT, RoBERTa, ELECTRA, ...) without cross-attention."""
    modules = dict(block.named_modules())
    return (
        all(isinstance(modules.get(name), nn.Linear) for name in _BERT_LINEARS)
        and isinstance(modules.get("attention.output.LayerNorm"), nn.LayerNorm)
        and isinstance(modules.get("output.LayerNorm"), nn.LayerNorm)
        and "crossattention" not in modules
        and sum(isinstance(m, nn.Linear) for m in modules.values()) == len(_BERT_LINEARS)
    )


def _bert_style_plan(block: nn.Module) -> BlockTensorParallelPlan:
    """Post-norm encoder layer: q/k/v and the MLP's first layer split by columns, the two output
    projections by rows. With Megatron-SP the two LayerNorms (after each residual add) run on
    sequence shards, their outputs stay local tensors (they feed the next residual add as well as the
    next sub-layer), and the attention and the MLP gather the sequence on entry."""
    attention = block.attention.self

    def styles(sequence_parallel: bool) -> dict[str, ParallelStyle]:
        def rowwise() -> ParallelStyle:
            return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()

        out: dict[str, ParallelStyle] = {
            "attention.self.query": ColwiseParallel(),
            "attention.self.key": ColwiseParallel(),
            "attention.self.value": ColwiseParallel(),
            "attention.output.dense": rowwise(),
            "intermediate.dense": ColwiseParallel(),
            "output.dense": rowwise(),
        }
        if sequence_parallel:
            for sub_layer in ("attention.self", "intermediate"):
                out[sub_layer] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
                out[norm] = SequenceParallel(use_local_output=True)
        return out

    def localize(module: nn.Module, tp: int) -> None:
        module.attention.self.num_attention_heads //= tp  # the attention code itself reshapes with -1 heads
        module.attention.self.all_head_size //= tp

    sizes = {"attention heads": attention.num_attention_heads, "MLP width": block.intermediate.dense.out_features}
    return BlockTensorParallelPlan(styles, sizes, megatron_sp=True, localize=localize)


# ------------------------------------------------------------------------------------ torch.nn Transformer layers
def _torch_transformer_layer_plan(block: nn.Module) -> BlockTensorParallelPlan | None:
    """``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``: attention(s) split by heads, the
    feed-forward ``linear1`` by columns and ``linear2`` by rows (no sequence parallelism).

    Only ``batch_first=True`` layers: between blocks the runtime moves activations along their first
    dimension as the batch.
    """
    attentions = ["self_attn"] + (["multihead_attn"] if isinstance(block, nn.TransformerDecoderLayer) else [])
    if not all(getattr(block, name).batch_first for name in attentions):
        return None
    if any(multihead_attention_unsupported(getattr(block, name)) for name in attentions):
        return None

    def styles(sequence_parallel: bool) -> dict[str, ParallelStyle]:
        out: dict[str, ParallelStyle] = {name: ParallelMultiheadAttention() for name in attentions}
        out["linear1"] = ColwiseParallel()
        out["linear2"] = RowwiseParallel()
        return out

    sizes = {"attention heads": block.self_attn.num_heads, "feed-forward width": block.linear1.out_features}
    if "multihead_attn" in attentions:
        sizes["cross-attention heads"] = block.multihead_attn.num_heads
    return BlockTensorParallelPlan(styles, sizes)


# ------------------------------------------------------------------------------------ nn.Linear blocks
COLUMN_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "up_proj", "gate_proj", "fc1", "w1",
     "w3", "fc_in", "c_fc", "wi", "wi_0", "wi_1"}
)
ROW_NAMES = frozenset({"out_proj", "o_proj", "down_proj", "fc2", "w2", "wo", "fc_out", "c_proj"})
_HEAD_ATTRIBUTES = ("num_heads", "n_head", "num_attention_heads", "n_heads")
_KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")


def _linear_plan(block: nn.Module) -> BlockTensorParallelPlan | None:
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
    widths = {f"{name} width": m.out_features for name, m in columns} | {f"{name} width": m.in_features for name, m in rows}
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
        return out

    return BlockTensorParallelPlan(styles, heads | widths, megatron_sp=megatron_sp, ulysses=single_input)


def _attention_heads(block: nn.Module) -> dict[str, int] | None:
    for module in block.modules():
        for source in (module, getattr(module, "config", None)):
            heads = next((getattr(source, a) for a in _HEAD_ATTRIBUTES if isinstance(getattr(source, a, None), int)), None)
            if heads:
                kv = next((getattr(source, a) for a in _KV_HEAD_ATTRIBUTES if isinstance(getattr(source, a, None), int)), None)
                return {"attention heads": heads} | ({"key/value heads": kv} if kv else {})
    return None


def _takes_only_hidden_states(block: nn.Module) -> bool:
    try:
        parameters = list(inspect.signature(model_class(block).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [p for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(parameters) == 1 and len(required) == 1
