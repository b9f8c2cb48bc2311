"""Hugging Face mixtures of experts (Mixtral, Qwen2-MoE, OLMoE): the attention split as Llama's, the experts whole.

Expert parallelism is a plan of its own; here every rank of a tensor-parallel group holds every expert, the router
and (Qwen2-MoE) the shared expert and its gate, and only the attention is split (grouped-query attention: a degree
must divide the key/value heads). A dense MLP in place of the experts (Qwen2-MoE's ``mlp_only_layers``) is split as
Llama's.

- Plain tensor parallelism: every rank runs the experts on the whole (replicated) hidden states, so their gradients
  are the same on every rank, as a norm's are.
- Megatron-SP: the post-attention norm runs on sequence shards and the experts with it, each rank on its own
  positions (routing is per position); their weights stay whole and their gradients are summed over the group
  (:class:`~lightning_galvatron.runtime.tensor_parallel.PerHeadWeights`'s convention), as the norms' are.
- OLMoE normalises all heads' queries (and keys) at once, as OLMo-2 does: each rank gathers the width for those norms
  (:func:`~.llama.whole_width_norms`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_galvatron.model.families._common import hf_sdpa, localize_groups, megatron_plan
from lightning_galvatron.model.families.llama import attention_projections, gated_mlp_columns, whole_width_norms
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, PerHeadWeights


def _dense_mlp(mlp: nn.Module) -> bool:
    return all(isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


def whole_experts(block: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    """Under Megatron-SP: every module under ``prefix`` that holds weights, whole on each rank, its gradient summed
    over the group (each rank computes it on its positions)."""
    return {
        f"{prefix}.{name}" if name else prefix: PerHeadWeights()
        for name, module in block.get_submodule(prefix).named_modules()
        if any(True for _ in module.parameters(recurse=False))
    }


def moe_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attn = block.self_attn
    columns, sizes, kv_heads = attention_projections(attn, "self_attn")
    heads, head_dim = attn.config.num_attention_heads, attn.head_dim
    rows, gathers, divisible = ["self_attn.o_proj"], ["self_attn"], dict(sizes)
    if _dense_mlp(block.mlp):
        mlp, width = gated_mlp_columns(block.mlp)
        columns, experts = columns | mlp, {}
        rows.append("mlp.down_proj")
        gathers.append("mlp")
        divisible["MLP width"] = width
    else:
        experts = whole_experts(block, "mlp")
    return megatron_plan(
        block,
        columns=columns,
        rows=rows,
        norms=["input_layernorm", "post_attention_layernorm"],
        gathers=gathers,
        divisible=divisible,
        extra=whole_width_norms(attn, "self_attn", kv_heads),
        sequence_extra=experts,
        localize=lambda module, tp: localize_groups(module.self_attn, tp, heads, kv_heads),
        head_dim=head_dim,
        ulysses=hf_sdpa(block),
    )


for _name in (
    "mixtral.modeling_mixtral.MixtralDecoderLayer",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeDecoderLayer",
    "olmoe.modeling_olmoe.OlmoeDecoderLayer",
):
    add_plan(f"transformers.models.{_name}", moe_plan)
