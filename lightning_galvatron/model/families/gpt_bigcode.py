"""Hugging Face GPTBigCode (StarCoder): ``nn.Linear`` layers named like GPT-2's; by default multi-query
attention, fused as ``[q heads | k | v]`` with one key/value head kept whole on every rank."""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, ColwiseFused


def gpt_bigcode_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    if hasattr(block, "crossattention"):
        return "GPTBigCode blocks with cross-attention have no tensor-parallel plan"
    attn = block.attn
    if attn.multi_query:
        qkv = ColwiseFused((attn.embed_dim, attn.kv_dim, attn.kv_dim), (True, False, False))
    else:
        qkv = None  # [q k v] per head

    def localize(module: nn.Module, tp: int) -> None:
        local_heads(module.attn, tp, "embed_dim", "num_heads")
        if not attn.multi_query:
            local_heads(module.attn, tp, "kv_heads", "kv_dim")
        module.attn.num_key_value_groups = module.attn.num_heads // module.attn.kv_heads

    return megatron_plan(
        block,
        columns={"attn.c_attn": qkv, "mlp.c_fc": None},
        rows=["attn.c_proj", "mlp.c_proj"],
        norms=["ln_1", "ln_2"],
        gathers=["attn", "mlp"],
        divisible={"attention heads": attn.num_heads, "MLP width": block.mlp.c_fc.out_features},
        localize=localize,
        ulysses=hf_sdpa(block),
    )


add_plan("transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeBlock", gpt_bigcode_plan)
