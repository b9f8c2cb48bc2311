"""Hugging Face ViT and DeiT: ``attention.attention.query/key/value``, ``attention.output.dense``,
``intermediate.dense``, ``output.dense`` (which adds the residual itself), pre-norm ``layernorm_before`` /
``layernorm_after``; patches enter through a convolution, so there is no token table to split by vocabulary.

The sequence is the patches plus the class token (and DeiT's distillation token): 197 at 224 pixels and 16-pixel
patches, which no degree > 1 divides, so sequence parallelism runs only where the image size makes it divisible.
"""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan


def vit_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attention = block.attention.attention
    return megatron_plan(
        block,
        columns={
            "attention.attention.query": None,
            "attention.attention.key": None,
            "attention.attention.value": None,
            "intermediate.dense": None,
        },
        rows=["attention.output.dense", "output.dense"],
        norms=["layernorm_before", "layernorm_after"],
        gathers=["attention", "intermediate"],
        divisible={
            "attention heads": attention.num_attention_heads,
            "MLP width": block.intermediate.dense.out_features,
        },
        localize=lambda module, tp: local_heads(module.attention.attention, tp, "num_attention_heads", "all_head_size"),
        ulysses=hf_sdpa(block),
    )


for _name in ("vit.modeling_vit.ViTLayer", "deit.modeling_deit.DeiTLayer"):
    add_plan(f"transformers.models.{_name}", vit_plan)
