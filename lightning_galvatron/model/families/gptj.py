"""Hugging Face GPT-J: separate ``q_proj``/``k_proj``/``v_proj``/``out_proj``, ``fc_in``/``fc_out``, one norm
feeding attention and MLP in parallel, rotary positions computed inside the attention."""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan


def gptj_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    return megatron_plan(
        block,
        columns={"attn.q_proj": None, "attn.k_proj": None, "attn.v_proj": None, "mlp.fc_in": None},
        rows=["attn.out_proj", "mlp.fc_out"],
        norms=["ln_1"],
        gathers=["attn", "mlp"],
        divisible={"attention heads": block.attn.num_attention_heads, "MLP width": block.mlp.fc_in.out_features},
        localize=lambda module, tp: local_heads(module.attn, tp, "num_attention_heads", "embed_dim"),
        ulysses=hf_sdpa(block),
    )


add_plan("transformers.models.gptj.modeling_gptj.GPTJBlock", gptj_plan)
