"""Hugging Face ViT and DeiT, in both layouts ``transformers`` has shipped: up to 5.x's refactor
``attention.attention.query/key/value``, ``attention.output.dense``, ``intermediate.dense``, ``output.dense`` (which
adds the residual itself); since then ``attention.q_proj/k_proj/v_proj/o_proj`` and ``mlp.fc1/fc2``. Pre-norm
``layernorm_before`` / ``layernorm_after`` in both; patches enter through a convolution, so there is no token table to
split by vocabulary.

The sequence is the patches plus the class token (and DeiT's distillation token): 197 at 224 pixels and 16-pixel
patches, which no degree > 1 divides, so sequence parallelism runs only where the image size makes it divisible.
"""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, layout_of, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan

#: The layer names of each layout, by role.
_LAYOUTS = {
    "separate attention output": {
        "query": "attention.attention.query",
        "key": "attention.attention.key",
        "value": "attention.attention.value",
        "attention out": "attention.output.dense",
        "mlp in": "intermediate.dense",
        "mlp out": "output.dense",
    },
    "q/k/v/o projections": {
        "query": "attention.q_proj",
        "key": "attention.k_proj",
        "value": "attention.v_proj",
        "attention out": "attention.o_proj",
        "mlp in": "mlp.fc1",
        "mlp out": "mlp.fc2",
    },
}


def vit_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    names = layout_of(block, _LAYOUTS)
    if isinstance(names, str):
        return names
    attention_path = names["query"].rsplit(".", 1)[0]
    attention = block.get_submodule(attention_path)
    heads = getattr(attention, "num_attention_heads", None)
    if not isinstance(heads, int):
        return f"{type(attention).__name__} has no integer num_attention_heads to divide by the degree"
    old = names is _LAYOUTS["separate attention output"]
    return megatron_plan(
        block,
        columns={names[role]: None for role in ("query", "key", "value", "mlp in")},
        rows=[names["attention out"], names["mlp out"]],
        norms=["layernorm_before", "layernorm_after"],
        gathers=["attention", "intermediate" if old else "mlp"],
        divisible={"attention heads": heads, "MLP width": block.get_submodule(names["mlp in"]).out_features},
        # The old attention reshapes with its global head count and width; the new one with -1 heads.
        localize=(
            lambda module, tp: local_heads(
                module.get_submodule(attention_path), tp, "num_attention_heads", "all_head_size"
            )
        )
        if old
        else None,
        ulysses=hf_sdpa(block),
    )


for _name in ("vit.modeling_vit.ViTLayer", "deit.modeling_deit.DeiTLayer"):
    add_plan(f"transformers.models.{_name}", vit_plan)
