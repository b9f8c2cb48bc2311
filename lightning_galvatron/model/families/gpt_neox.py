"""Hugging Face GPT-NeoX (Pythia): fused ``query_key_value`` laid out per head (``[q k v]`` of head 0, then
head 1, ...), so contiguous rows are whole heads; parallel residual by default; rotary positions."""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan


def gpt_neox_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    config = block.attention.config
    return megatron_plan(
        block,
        columns={"attention.query_key_value": None, "mlp.dense_h_to_4h": None},
        rows=["attention.dense", "mlp.dense_4h_to_h"],
        norms=["input_layernorm", "post_attention_layernorm"],
        gathers=["attention", "mlp"],
        divisible={"attention heads": config.num_attention_heads, "MLP width": block.mlp.dense_h_to_4h.out_features},
        ulysses=hf_sdpa(block),  # the attention reshapes with -1 heads: nothing to localize
    )


add_plan("transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXLayer", gpt_neox_plan)
