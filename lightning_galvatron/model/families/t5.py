"""Hugging Face T5 (and mT5): ``layer.0.SelfAttention`` (and ``layer.1.EncDecAttention`` in decoder blocks) with
``q``/``k``/``v``/``o``, ``layer.-1.DenseReluDense`` with ``wi`` (or ``wi_0``/``wi_1``) and ``wo``, RMS norms
before each sub-layer, and a relative position bias with one column per head.

The first block of each stack computes the position bias ``[batch or 1, heads, queries, keys]`` (its
``relative_attention_bias`` embedding split by heads, so each rank computes its heads' columns) and
hands it, with the mask added, to every later block as an input. Blocks may use other degrees, so
the bias travels between blocks whole: each attention takes its heads' part of it on entry (the
gradient summed over the group) and gathers the heads of the one it returns.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_galvatron.model.families._common import Compose, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import (
    BlockTensorParallelPlan,
    ColwiseEmbedding,
    SliceHeads,
    all_gather_heads,
    head_slice,
)


class _WholePositionBias(ParallelStyle):
    """The attention returns the position bias of all heads (it computed or received only its own)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: Any, output: Any) -> Any:
            return (output[0], all_gather_heads(output[1], device_mesh, dim=1), *output[2:])

        module.register_forward_hook(hook)
        return module


def t5_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attentions = ["layer.0.SelfAttention"] + (["layer.1.EncDecAttention"] if block.is_decoder else [])
    feed_forward = f"layer.{len(block.layer) - 1}"
    dense = block.layer[-1].DenseReluDense
    inputs = ("wi_0", "wi_1") if hasattr(dense, "wi_0") else ("wi",)
    heads = block.layer[0].SelfAttention.n_heads
    columns: dict[str, None | ParallelStyle] = {f"{feed_forward}.DenseReluDense.{name}": None for name in inputs}
    extra: dict[str, ParallelStyle] = {}
    for attention in attentions:
        columns |= {f"{attention}.{name}": None for name in ("q", "k", "v")}
        extra[attention] = Compose(SliceHeads({"position_bias": head_slice(1, heads)}), _WholePositionBias())
    if block.layer[0].SelfAttention.has_relative_attention_bias:
        columns["layer.0.SelfAttention.relative_attention_bias"] = ColwiseEmbedding()

    def localize(module: nn.Module, tp: int) -> None:
        for attention in attentions:
            local_heads(module.get_submodule(attention), tp, "n_heads", "inner_dim")

    return megatron_plan(
        block,
        columns=columns,
        rows=[f"{attention}.o" for attention in attentions] + [f"{feed_forward}.DenseReluDense.wo"],
        norms=[f"layer.{i}.layer_norm" for i in range(len(block.layer))],
        gathers=[*attentions, f"{feed_forward}.DenseReluDense"],
        divisible={"attention heads": heads, "MLP width": getattr(dense, inputs[0]).out_features},
        extra=extra,
        localize=localize,
        ulysses="T5's attention computes its scores itself (with the relative position bias), not with "
        "F.scaled_dot_product_attention",
    )


add_plan("transformers.models.t5.modeling_t5.T5Block", t5_plan)
add_plan("transformers.models.mt5.modeling_mt5.MT5Block", t5_plan)  # a copy of T5's
