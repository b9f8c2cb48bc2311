"""Hugging Face GPT-2: ``Conv1D`` layers, q/k/v fused as three equal parts ``[q | k | v]``."""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, ColwiseFused


def gpt2_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    if hasattr(block, "crossattention"):
        return "GPT-2 blocks with cross-attention have no tensor-parallel plan"
    attn, hidden, ffn = block.attn, block.attn.embed_dim, block.mlp.c_fc.weight.shape[1]

    def localize(module: nn.Module, tp: int) -> None:
        local_heads(module.attn, tp, "split_size", "num_heads")  # the fused projection yields 3 x hidden/tp

    return megatron_plan(
        block,
        columns={
            "attn.c_attn": ColwiseFused((hidden,) * 3, conv1d=True),
            "mlp.c_fc": ColwiseFused((ffn,), conv1d=True),
        },
        rows=["attn.c_proj", "mlp.c_proj"],
        norms=["ln_1", "ln_2"],
        gathers=["attn", "mlp"],
        divisible={"attention heads": attn.num_heads, "MLP width": ffn},
        localize=localize,
        ulysses=hf_sdpa(block),
    )


add_plan("transformers.models.gpt2.modeling_gpt2.GPT2Block", gpt2_plan)
