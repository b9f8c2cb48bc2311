"""Hugging Face MPT and CodeGen: fused query/key/value projections whose layouts are not per head.

MPT's ``Wqkv`` is ``[q | k | v]`` over all heads (each section split by heads); its ALiBi bias reaches the
attention as ``position_bias`` ``[heads, 1, keys]``, of which each rank takes its heads' rows (and which never
moves with the samples between blocks of different layouts, even where the heads are as many as the samples).

CodeGen's ``qkv_proj`` groups the heads in 4 partitions (its forward fixes ``mp_num = 4``), each laid out
``[q | v | k]`` of its heads: every rank takes its share of the heads of each partition -- twelve equal
sections, each split -- so the local output still reshapes into 4 partitions, and the output projection's
inputs, in the same order, are split the same way (4 sections). A degree must divide the heads of one partition.
"""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, ColwiseFused, SliceHeads, head_slice

#: CodeGen's attention reshapes its fused projection into this many partitions, whatever the config.
CODEGEN_PARTITIONS = 4


def mpt_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attn = block.attn
    width, heads = attn.hidden_size, attn.n_heads
    return megatron_plan(
        block,
        columns={"attn.Wqkv": ColwiseFused((width, width, width)), "ffn.up_proj": None},
        rows=["attn.out_proj", "ffn.down_proj"],
        norms=["norm_1", "norm_2"],
        gathers=["attn", "ffn"],
        divisible={"attention heads": heads, "MLP width": block.ffn.up_proj.out_features},
        extra={"attn": SliceHeads({"position_bias": head_slice(0, heads)})},
        shared_inputs=["position_bias"],  # [heads, 1, keys]: not per sample, even where heads = samples per shard
        localize=lambda module, tp: local_heads(module.attn, tp, "n_heads"),
        ulysses="MPT's attention computes its scores itself (matmul with an ALiBi bias), not with "
        "F.scaled_dot_product_attention",
    )


def codegen_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attn = block.attn
    heads, section = attn.num_attention_heads, attn.embed_dim // CODEGEN_PARTITIONS
    return megatron_plan(
        block,
        columns={"attn.qkv_proj": ColwiseFused((section,) * 3 * CODEGEN_PARTITIONS), "mlp.fc_in": None},
        rows=["attn.out_proj", "mlp.fc_out"],
        row_sections={"attn.out_proj": CODEGEN_PARTITIONS},
        norms=["ln_1"],
        gathers=["attn", "mlp"],
        divisible={
            f"attention heads of each of CodeGen's {CODEGEN_PARTITIONS} head partitions": heads // CODEGEN_PARTITIONS,
            "MLP width": block.mlp.fc_in.out_features,
        },
        localize=lambda module, tp: local_heads(module.attn, tp, "num_attention_heads", "embed_dim"),
        ulysses="CodeGen's attention computes its scores itself (matmul in float32), not with "
        "F.scaled_dot_product_attention",
    )


add_plan("transformers.models.mpt.modeling_mpt.MptBlock", mpt_plan)
add_plan("transformers.models.codegen.modeling_codegen.CodeGenBlock", codegen_plan)
