"""Hugging Face Falcon and BLOOM: a fused ``query_key_value`` projection, ``dense``,
``dense_h_to_4h``/``dense_4h_to_h``.

Layouts of the fused projection: BLOOM and Falcon without multi-query keep ``[q k v]`` per head
(contiguous rows are whole heads); Falcon's new architecture groups ``[q ... q k v]`` per key/value
head (contiguous rows are whole groups); Falcon's default multi-query layout is ``[q heads | k | v]``
with one key/value head, kept whole on every rank while the queries are split.

ALiBi (BLOOM, Falcon with ``alibi=True``) reaches every block as ``[batch x heads, 1, keys]``: each
rank's attention takes its heads' rows, and the runtime moves it with its samples (``folded_inputs``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, local_heads, localize_groups, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, ColwiseFused, CopyOutput, SliceHeads


def alibi_heads(heads: int) -> SliceHeads:
    """This rank's heads of an ALiBi bias ``[batch x heads, 1, keys]``."""

    def local(alibi: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        folded = alibi.view(-1, heads, *alibi.shape[1:])
        part = heads // tp
        return folded[:, tp_rank * part : (tp_rank + 1) * part].reshape(-1, *alibi.shape[1:])

    return SliceHeads({"alibi": local})


def falcon_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attn, config = block.self_attention, block.config
    heads, head_dim = attn.num_heads, attn.head_dim
    sizes = {"attention heads": heads, "MLP width": block.mlp.dense_h_to_4h.out_features}
    if config.new_decoder_architecture:
        qkv, kv_heads = None, config.num_kv_heads  # grouped per key/value head
        sizes["key/value heads"] = kv_heads
    elif config.multi_query:
        qkv, kv_heads = ColwiseFused((heads * head_dim, head_dim, head_dim), (True, False, False)), 1
    else:
        qkv, kv_heads = None, heads  # per head
    norms = ["input_layernorm", "post_attention_layernorm", "ln_attn", "ln_mlp"]

    def localize(module: nn.Module, tp: int) -> None:
        local_heads(module.self_attention, tp, "num_heads")
        if kv_heads > 1:
            local_heads(module.self_attention, tp, "num_kv_heads")
        localize_groups(module.self_attention, tp, heads, kv_heads)  # read by the sdpa/eager repeat of keys

    return megatron_plan(
        block,
        columns={"self_attention.query_key_value": qkv, "mlp.dense_h_to_4h": None},
        rows=["self_attention.dense", "mlp.dense_4h_to_h"],
        norms=norms,
        gathers=["self_attention", "mlp"],
        divisible=sizes,
        # The block adds the attention output to the MLP's in place.
        extra={"mlp.dense_4h_to_h": CopyOutput()} | ({"self_attention": alibi_heads(heads)} if config.alibi else {}),
        localize=localize,
        ulysses=hf_sdpa(block) if not config.alibi else "ALiBi biases are per key position of the whole sequence",
        folded_inputs={"alibi": heads} if config.alibi else None,
    )


def bloom_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attn = block.self_attention
    if attn.pretraining_tp > 1 and attn.slow_but_exact:
        return "BLOOM with slow_but_exact=True slices its projections by pretraining_tp; no tensor-parallel plan"
    return megatron_plan(
        block,
        columns={"self_attention.query_key_value": None, "mlp.dense_h_to_4h": None},
        rows=["self_attention.dense", "mlp.dense_4h_to_h"],
        norms=["input_layernorm", "post_attention_layernorm"],
        gathers=["self_attention", "mlp"],
        divisible={"attention heads": attn.num_heads, "MLP width": block.mlp.dense_h_to_4h.out_features},
        extra={"self_attention": alibi_heads(attn.num_heads)},
        localize=lambda module, tp: local_heads(module.self_attention, tp, "num_heads"),
        ulysses=(
            "BLOOM's attention computes its scores itself (baddbmm with ALiBi), not with F.scaled_dot_product_attention"
        ),
        folded_inputs={"alibi": attn.num_heads},
    )


add_plan("transformers.models.falcon.modeling_falcon.FalconDecoderLayer", falcon_plan)
add_plan("transformers.models.bloom.modeling_bloom.BloomBlock", bloom_plan)
