"""PyTorch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``: attention(s) split by heads
(:class:`~lightning_galvatron.runtime.multihead_attention.ParallelMultiheadAttention`), the feed-forward
``linear1`` by columns and ``linear2`` by rows; no sequence parallelism.

Only ``batch_first=True`` layers: between blocks the runtime moves activations along their first
dimension as the batch.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.multihead_attention import ParallelMultiheadAttention, multihead_attention_unsupported
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan

_NO_SEQUENCE_PARALLEL = (
    "nn.MultiheadAttention checks its masks against the sequence it receives, so these layers run on whole sequences"
)


def torch_transformer_layer_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attentions = ["self_attn"] + (["multihead_attn"] if isinstance(block, nn.TransformerDecoderLayer) else [])
    if not all(getattr(block, name).batch_first for name in attentions):
        return (
            f"{type(block).__name__} with batch_first=False has no tensor-parallel plan (the runtime moves the "
            "batch along dim 0)"
        )
    for name in attentions:
        reason = multihead_attention_unsupported(getattr(block, name))
        if reason is not None:
            return f"{type(block).__name__}.{name}: {reason}"

    def styles(sequence_parallel: bool) -> dict[str, ParallelStyle]:
        out: dict[str, ParallelStyle] = {name: ParallelMultiheadAttention() for name in attentions}
        out["linear1"] = ColwiseParallel()
        out["linear2"] = RowwiseParallel()
        return out

    sizes = {"attention heads": block.self_attn.num_heads, "feed-forward width": block.linear1.out_features}
    if "multihead_attn" in attentions:
        sizes["cross-attention heads"] = block.multihead_attn.num_heads
    return BlockTensorParallelPlan(
        styles, sizes, why_not_megatron_sp=_NO_SEQUENCE_PARALLEL, why_not_ulysses=_NO_SEQUENCE_PARALLEL
    )


for _name in ("TransformerEncoderLayer", "TransformerDecoderLayer"):
    add_plan(f"torch.nn.modules.transformer.{_name}", torch_transformer_layer_plan)
