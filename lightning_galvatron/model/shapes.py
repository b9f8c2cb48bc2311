"""The shape of a model built on the meta device, for the analytic estimator
(:mod:`lightning_galvatron.producers.analytic`).

:func:`architecture_of_module` reads what the estimator needs from a module without running it (on
the meta device nothing is allocated): the blocks (:func:`~lightning_galvatron.model.discovery.find_blocks`,
one or more lists), per block type its parameters, the parameters of its matrix multiplications,
hidden size, attention heads (and key/value heads), FFN width, attention calls and what tensor
parallelism the runtime has for it (:func:`~lightning_galvatron.model.tensor_parallel_plans.tensor_parallel_plan`),
and the embedding/head outside the blocks.

:func:`hf_model_on_meta` builds any ``transformers`` model from its config on the meta device with
few blocks per list (each list a different small count, which tells the lists apart); the real
counts are put back by :func:`architecture_of_module`. Building a 7B model whole takes seconds even on
the meta device; a few blocks take a fraction of that.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_galvatron.model.discovery import ModelStructure, find_blocks, model_class
from lightning_galvatron.model.tensor_parallel_plans import (
    _attention_heads,
    tensor_parallel_plan,
    tp_collectives_per_forward,
)
from lightning_galvatron.producers.analytic import ArchitectureShape, BlockShape, VocabShape

#: Config attributes that count blocks in ``transformers`` models (decoder-only, encoder-only, T5, BART, ...).
HF_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")


def hf_model_on_meta(config: Mapping[str, Any]) -> tuple[nn.Module, dict[int, int]]:
    """A ``transformers`` model from a ``config.json`` dict on the meta device, with few blocks.

    Returns the model and ``{built block count: real block count}`` for its block lists.
    """
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"a config of model_type {config.get('model_type')!r} needs `transformers` to be read "
            "(pip install transformers), or pass --model MODULE:CLASS"
        ) from None
    data = dict(config)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError("the config has no 'model_type'")
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        data.pop(key, None)
    cfg = transformers.AutoConfig.for_model(model_type, **data)
    aliases = getattr(cfg, "attribute_map", {}) or {}
    canonical = dict.fromkeys(aliases.get(k, k) for k in HF_LAYER_KEYS if isinstance(getattr(cfg, k, None), int))
    counts: dict[int, int] = {}
    small = 2
    for key in canonical:
        real = int(getattr(cfg, key))
        if real >= 2:
            setattr(cfg, key, small)
            counts[small] = real
            small += 1
    architectures = list(getattr(cfg, "architectures", None) or [])
    model_cls = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        model = model_cls(cfg) if model_cls is not None else transformers.AutoModel.from_config(cfg)
    return model, counts


def architecture_of_module(
    module: nn.Module,
    layers: str | Sequence[str] | None = None,
    name: str | None = None,
    block_counts: Mapping[int, int] | None = None,
    default_seq_length: int | None = None,
) -> ArchitectureShape:
    """The :class:`ArchitectureShape` of ``module`` (any device; meta is enough).

    ``block_counts`` maps the length of a block list as built to the model's real length (see
    :func:`hf_model_on_meta`); such lists must hold blocks of one shape.
    """
    structure = find_blocks(module, layers)
    embedding, head, tied = _vocabulary(structure)
    hidden = _hidden_size(structure, embedding)
    types: dict[tuple, int] = {}
    shapes: list[BlockShape] = []
    blocks: list[int] = []
    for block_list in structure.block_lists:
        members = block_list.blocks
        kinds = []
        for block in members:
            key = _signature(block)
            if key not in types:
                types[key] = len(shapes)
                shapes.append(block_shape(block, hidden))
            kinds.append(types[key])
        real = (block_counts or {}).get(len(members), len(members))
        if real != len(members):
            if len(set(kinds[1:])) > 1:
                raise ValueError(
                    f"{block_list.path} holds blocks of several shapes; build the model with all its blocks"
                )
            # The first block may differ from the rest (T5's first block holds the relative position table).
            kinds = kinds[:1] + kinds[-1:] * (real - 1)
        blocks.extend(kinds)

    before, after = _outside_parameters(structure)
    vocab = VocabShape(
        vocab_size=embedding.num_embeddings if embedding is not None else 1,
        embedding_parameters=before,
        head_parameters=after,
        head_outputs=head.out_features if head is not None else _last_width(structure, hidden),
        tied=tied,
        vocab_parallel=embedding is not None,
    )
    return ArchitectureShape(
        name=name or type(module).__name__,
        layer_types=tuple(shapes),
        blocks=tuple(blocks),
        vocab=vocab,
        hidden_size=hidden,
        block_lists=len(structure.block_lists),
        default_seq_length=default_seq_length,
    )


def block_shape(block: nn.Module, hidden: int) -> BlockShape:
    """One block's :class:`BlockShape` (see the module docstring)."""
    params = dict(block.named_parameters())
    embeddings = {id(m.weight) for m in block.modules() if isinstance(m, nn.Embedding)}  # e.g. T5's relative bias
    matmul = sum(p.numel() for p in params.values() if p.dim() >= 2 and id(p) not in embeddings)
    attentions = [m for m in block.modules() if isinstance(m, nn.MultiheadAttention)]
    heads_found = _attention_heads(block)
    heads = heads_found["attention heads"] if heads_found else (attentions[0].num_heads if attentions else 1)
    kv_heads = (heads_found or {}).get("key/value heads", heads)
    width = attentions[0].embed_dim if attentions else _query_width(block, hidden)
    widths = [int(s) for m in block.modules() if isinstance(m, nn.Linear) for s in (m.in_features, m.out_features)]
    widths += [int(s) for m in block.modules() if type(m).__name__ == "Conv1D" for s in m.weight.shape]
    ffn = max(widths, default=hidden)
    gated = (
        sum(isinstance(m, nn.Linear) and m.out_features == ffn and m.in_features != ffn for m in block.modules()) >= 2
    )
    plan = tensor_parallel_plan(block)
    return BlockShape(
        name=model_class(block).__name__,
        parameters=sum(p.numel() for p in params.values()),
        matmul_parameters=matmul,
        hidden_size=hidden,
        num_heads=heads,
        head_dim=max(width // heads, 1),
        num_key_value_heads=kv_heads,
        ffn_hidden_size=ffn,
        gated_mlp=gated,
        attention_calls=max(_attention_calls(block), 1),
        supports_tensor_parallel=plan is not None,
        supports_megatron_sp=plan is not None and plan.megatron_sp,
        supports_ulysses=plan is not None and plan.ulysses,
        tp_collectives_per_forward=tp_collectives_per_forward(plan),
        tensor_parallel_divisors=tuple(plan.divisible.values()) if plan is not None else (),
        ulysses_divisors=tuple(plan.ulysses_sizes.values()) if plan is not None else (),
    )


def _signature(block: nn.Module) -> tuple:
    return (model_class(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))


def _attention_calls(block: nn.Module) -> int:
    """Innermost modules whose class names an attention (self-attention, cross-attention)."""
    attention = [m for m in block.modules() if "attention" in type(m).__name__.lower()]
    return sum(not any(c is not m and "attention" in type(c).__name__.lower() for c in m.modules()) for m in attention)


_QUERY_NAMES = ("q_proj", "query", "wq", "q")


def _query_width(block: nn.Module, hidden: int) -> int:
    for name, m in block.named_modules():
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in _QUERY_NAMES:
            return m.out_features
    return hidden


def _vocabulary(structure: ModelStructure) -> tuple[nn.Embedding | None, nn.Linear | None, bool]:
    """The token embedding (the table with most rows outside the blocks) and the head producing one
    output per row of it, if any (a classifier has none)."""
    in_blocks = {id(m) for b in structure.blocks for m in b.modules()}
    outside = [m for m in structure.root.modules() if id(m) not in in_blocks]
    embeddings = [m for m in outside if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None, None, False
    embedding = max(embeddings, key=lambda e: e.num_embeddings)
    heads = [m for m in outside if isinstance(m, nn.Linear) and m.out_features == embedding.num_embeddings]
    head = heads[-1] if heads else None
    return embedding, head, head is not None and head.weight is embedding.weight


def _hidden_size(structure: ModelStructure, embedding: nn.Embedding | None) -> int:
    block = structure.blocks[0]
    attentions = [m for m in block.modules() if isinstance(m, nn.MultiheadAttention)]
    if attentions:
        return attentions[0].embed_dim
    inputs = Counter(m.in_features for m in block.modules() if isinstance(m, nn.Linear))
    # The token embedding's width, unless no layer of the block reads it: embeddings projected to the blocks'
    # width outside them (ELECTRA, OPT-350m) leave the most common input width of the block's layers.
    if embedding is not None and (not inputs or embedding.embedding_dim in inputs):
        return embedding.embedding_dim
    if not inputs:
        raise ValueError(f"cannot tell the hidden size of {model_class(block).__name__}: it has no nn.Linear layers")
    return inputs.most_common(1)[0][0]


def _outside_parameters(structure: ModelStructure) -> tuple[int, int]:
    """Parameters outside the blocks registered before the first block list, and after it."""
    containers = {id(bl.container) for bl in structure.block_lists}
    in_blocks = structure.block_parameter_ids()
    seen: set[int] = set()
    before = after = 0
    blocks_seen = False
    for _, m in structure.root.named_modules():
        if id(m) in containers:
            blocks_seen = True
            continue
        for p in m.parameters(recurse=False):
            if id(p) in in_blocks or id(p) in seen:
                continue
            seen.add(id(p))
            if blocks_seen:
                after += p.numel()
            else:
                before += p.numel()
    return before, after


def _last_width(structure: ModelStructure, hidden: int) -> int:
    in_blocks = {id(m) for b in structure.blocks for m in b.modules()}
    linears = [m for m in structure.root.modules() if isinstance(m, nn.Linear) and id(m) not in in_blocks]
    return linears[-1].out_features if linears else hidden
