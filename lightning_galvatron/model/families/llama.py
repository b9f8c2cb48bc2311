"""Hugging Face Llama-style decoders (Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma-2, Gemma-3, GLM, OLMo-2, Phi, Phi-3
and others): separate ``q_proj``/``k_proj``/``v_proj``/``o_proj``, a gated MLP (``gate_proj``/``up_proj``/
``down_proj``, or fused ``gate_up_proj``) or ``fc1``/``fc2``, rotary positions, grouped-query attention, and a norm
over each head's queries and keys (Qwen3, Gemma3: whole on every rank) or over all heads' at once (OLMo-2: on the
width each rank gathers for it).

Grouped-query attention: a degree must divide the key/value heads (each rank keeps whole groups).
Multi-query attention (one key/value head): the key and value projections stay whole on every rank
and only the queries are split (see :class:`~lightning_galvatron.runtime.tensor_parallel.ColwiseFused`).
"""

from __future__ import annotations

import copy

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_galvatron.model.families._common import GatherWidth, hf_sdpa, localize_groups, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, ColwiseFused


def attention_projections(attn: nn.Module, prefix: str) -> tuple[dict[str, ParallelStyle | None], dict[str, int], int]:
    """Column styles of ``q_proj``/``k_proj``/``v_proj``, the sizes a degree must divide, and the key/value heads."""
    config = attn.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    columns: dict[str, ParallelStyle | None] = {f"{prefix}.q_proj": None}
    if kv_heads == 1:  # multi-query: keys and values whole on every rank
        for name in ("k_proj", "v_proj"):
            columns[f"{prefix}.{name}"] = ColwiseFused((getattr(attn, name).out_features,), (False,))
        sizes = {"attention heads": heads}
    else:
        columns |= {f"{prefix}.k_proj": None, f"{prefix}.v_proj": None}
        sizes = {"attention heads": heads, "key/value heads": kv_heads}
    return columns, sizes, kv_heads


def gated_mlp_columns(mlp: nn.Module) -> tuple[dict[str, ParallelStyle | None], int]:
    """Column styles of a gated MLP, separate (``gate_proj``, ``up_proj``) or fused as ``gate_up_proj`` ``[gate |
    up]`` (Phi-3, GLM), and its width."""
    width = mlp.down_proj.in_features
    if hasattr(mlp, "gate_up_proj"):
        return {"mlp.gate_up_proj": ColwiseFused((width, width))}, width
    return {"mlp.gate_proj": None, "mlp.up_proj": None}, width


def whole_width_norms(attn: nn.Module, prefix: str, kv_heads: int) -> dict[str, ParallelStyle]:
    """Styles for norms over all heads' queries (keys) at once (OLMo-2's and OLMoE's ``q_norm``/``k_norm``, one
    projection wide): each rank gathers the width for them (:class:`~._common.GatherWidth`). With one key/value head
    the keys stay whole on every rank, and so does ``k_norm``."""
    extra: dict[str, ParallelStyle] = {}
    for norm, projection in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
        module = getattr(attn, norm, None)
        if module is None or (norm == "k_norm" and kv_heads == 1) or not hasattr(attn, projection):
            continue
        if {p.numel() for p in module.parameters()} == {getattr(attn, projection).out_features}:
            extra[f"{prefix}.{norm}"] = GatherWidth()
    return extra


def llama_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    columns, sizes, kv_heads = attention_projections(block.self_attn, "self_attn")
    heads = block.self_attn.config.num_attention_heads
    mlp, width = gated_mlp_columns(block.mlp)
    return megatron_plan(
        block,
        columns=columns | mlp,
        rows=["self_attn.o_proj", "mlp.down_proj"],
        norms=[
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_self_attn_layernorm",  # GLM-4: on the attention's and the MLP's outputs
            "post_mlp_layernorm",
        ],
        gathers=["self_attn", "mlp"],
        divisible=sizes | {"MLP width": width},
        extra=whole_width_norms(block.self_attn, "self_attn", kv_heads),
        localize=lambda module, tp: localize_groups(module.self_attn, tp, heads, kv_heads),
        head_dim=getattr(block.self_attn, "head_dim", None),
        ulysses=hf_sdpa(block),
    )


def phi_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    """Phi: one norm feeding attention and MLP in parallel, ``dense`` output projection, ``fc1``/``fc2``,
    partial rotary positions (and, with ``qk_layernorm``, a norm over each head's queries and keys)."""
    columns, sizes, kv_heads = attention_projections(block.self_attn, "self_attn")
    heads = block.self_attn.config.num_attention_heads
    return megatron_plan(
        block,
        columns=columns | {"mlp.fc1": None},
        rows=["self_attn.dense", "mlp.fc2"],
        norms=["input_layernorm"],
        gathers=["self_attn", "mlp"],
        divisible=sizes | {"MLP width": block.mlp.fc1.out_features},
        localize=lambda module, tp: localize_groups(module.self_attn, tp, heads, kv_heads),
        head_dim=getattr(block.self_attn, "head_dim", None),
        ulysses=hf_sdpa(block),
    )


def phi3_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    """Phi-3 (and Phi-4): fused ``qkv_proj`` ``[q | k | v]`` and ``gate_up_proj`` ``[gate | up]``. Its attention
    reads the query heads from its config and the key/value heads from itself: each block gets its own copy of the
    config with this rank's heads."""
    attn = block.self_attn
    heads, kv_heads, head_dim = attn.config.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    sections = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    split = (True, kv_heads > 1, kv_heads > 1)  # multi-query: keys and values whole on every rank
    mlp, ffn = gated_mlp_columns(block.mlp)
    divisible = {"attention heads": heads, "MLP width": ffn}
    if kv_heads > 1:
        divisible["key/value heads"] = kv_heads

    def localize(module: nn.Module, tp: int) -> None:
        local = module.self_attn
        local.config = copy.copy(local.config)
        local.config.num_attention_heads = heads // tp
        if kv_heads > 1:
            local.num_key_value_heads = kv_heads // tp
        localize_groups(local, tp, heads, kv_heads)

    return megatron_plan(
        block,
        columns={"self_attn.qkv_proj": ColwiseFused(sections, split)} | mlp,
        rows=["self_attn.o_proj", "mlp.down_proj"],
        norms=["input_layernorm", "post_attention_layernorm"],
        gathers=["self_attn", "mlp"],
        divisible=divisible,
        localize=localize,
        head_dim=head_dim,
        ulysses=hf_sdpa(block),
    )


for _name in (
    "llama.modeling_llama.LlamaDecoderLayer",
    "qwen2.modeling_qwen2.Qwen2DecoderLayer",
    "qwen3.modeling_qwen3.Qwen3DecoderLayer",
    "mistral.modeling_mistral.MistralDecoderLayer",
    "gemma.modeling_gemma.GemmaDecoderLayer",
    "gemma3.modeling_gemma3.Gemma3DecoderLayer",
    "granite.modeling_granite.GraniteDecoderLayer",
    "helium.modeling_helium.HeliumDecoderLayer",
    "smollm3.modeling_smollm3.SmolLM3DecoderLayer",
    "cohere.modeling_cohere.CohereDecoderLayer",
    "gemma2.modeling_gemma2.Gemma2DecoderLayer",
    "olmo.modeling_olmo.OlmoDecoderLayer",
    "olmo2.modeling_olmo2.Olmo2DecoderLayer",
    "glm.modeling_glm.GlmDecoderLayer",
    "glm4.modeling_glm4.Glm4DecoderLayer",
):
    add_plan(f"transformers.models.{_name}", llama_plan)
add_plan("transformers.models.phi.modeling_phi.PhiDecoderLayer", phi_plan)
add_plan("transformers.models.phi3.modeling_phi3.Phi3DecoderLayer", phi3_plan)
