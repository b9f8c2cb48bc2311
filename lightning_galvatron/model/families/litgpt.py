"""LitGPT's ``Block``: ``attn.qkv`` fused as ``[q heads | k groups | v groups]``, ``attn.proj``, an MLP of
``fc``/``proj`` (GPT-NeoX style) or ``fc_1``/``fc_2``/``proj`` (LLaMA style), ``norm_1``/``norm_2``, rotary
``cos``/``sin`` passed to every block.

With as many key/value groups as heads the three sections are equal and split in strides; with grouped
queries each rank takes its query heads and their groups; with one group (multi-query) the keys and
values stay whole on every rank. The attention reads its head counts from ``config``, which all
blocks share: a split block gets its own copy with its local counts.
"""

from __future__ import annotations

import copy

from torch import nn

from lightning_galvatron.model.families._common import megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, ColwiseFused

_MLPS = {"GptNeoxMLP": ("fc",), "LLaMAMLP": ("fc_1", "fc_2"), "GemmaMLP": ("fc_1", "fc_2")}


def litgpt_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    config, attn = block.config, block.attn
    mlp_inputs = _MLPS.get(type(block.mlp).__name__)
    if mlp_inputs is None or type(attn).__name__ != "CausalSelfAttention":
        return f"LitGPT blocks with {type(attn).__name__} and {type(block.mlp).__name__} have no tensor-parallel plan"
    heads, groups, head_size = config.n_head, config.n_query_groups, config.head_size
    sections = (heads * head_size, groups * head_size, groups * head_size)
    split = (True, groups > 1, groups > 1)
    sizes = {"attention heads": heads, "MLP width": getattr(block.mlp, mlp_inputs[0]).out_features}
    if groups > 1:
        sizes["key/value groups"] = groups

    def localize(module: nn.Module, tp: int) -> None:
        local = copy.copy(module.attn.config)  # shared by every block: this one's own local head counts
        local.n_head = heads // tp
        local.n_query_groups = groups // tp if groups > 1 else 1
        module.attn.config = local

    softcapping = config.attention_logit_softcapping is not None
    sliding = getattr(attn, "apply_sliding_window_attention", False)
    return megatron_plan(
        block,
        columns={"attn.qkv": ColwiseFused(sections, split)} | {f"mlp.{name}": None for name in mlp_inputs},
        rows=["attn.proj", "mlp.proj"],
        norms=["norm_1", "norm_2", "post_attention_norm", "post_mlp_norm"],
        gathers=["attn", "mlp"],
        divisible=sizes,
        localize=localize,
        ulysses=(
            "LitGPT computes its attention scores itself with logit softcapping"
            if softcapping
            else "LitGPT builds the sliding-window mask from the block's own (local) positions"
            if sliding
            else True
        ),
        position_inputs={1: -2, 2: -2, "cos": -2, "sin": -2},
        head_dim=head_size,
    )


add_plan("litgpt.model.Block", litgpt_plan)
