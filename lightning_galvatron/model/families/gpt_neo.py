"""Hugging Face GPT-Neo: ``attn.attention.q_proj/k_proj/v_proj/out_proj``, an MLP of ``c_fc``/``c_proj``, learned
positions outside the blocks, global and local (sliding-window) attention layers.

Its attention reshapes with ``self.num_heads`` (divided by the degree) and computes its scores itself (a matmul in
float32 under its causal or sliding-window mask): no Ulysses.
"""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan


def gpt_neo_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attention = block.attn.attention
    return megatron_plan(
        block,
        columns={f"attn.attention.{name}": None for name in ("q_proj", "k_proj", "v_proj")} | {"mlp.c_fc": None},
        rows=["attn.attention.out_proj", "mlp.c_proj"],
        norms=["ln_1", "ln_2"],
        gathers=["attn", "mlp"],
        divisible={"attention heads": attention.num_heads, "MLP width": block.mlp.c_fc.out_features},
        localize=lambda module, tp: local_heads(module.attn.attention, tp, "num_heads"),
        ulysses="GPT-Neo's attention computes its scores itself (a matmul in float32 under its own mask)",
    )


add_plan("transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoBlock", gpt_neo_plan)
