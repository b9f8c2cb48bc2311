"""BERT-style encoder layers (BERT, RoBERTa, ELECTRA and other Hugging Face encoders with
``attention.self.query/key/value``, ``attention.output.dense``, ``intermediate.dense``, ``output.dense``),
found by their structure rather than their class; and DistilBERT's ``TransformerBlock``, by its class.

Post-norm: q/k/v and the MLP's first layer split by columns, the two output projections by rows.
With Megatron-SP the two LayerNorms (after each residual add) run on sequence shards, their outputs
stay local tensors (they feed the next residual add as well as the next sub-layer), and the attention
and the MLP gather the sequence on entry.
"""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan

_BERT_LINEARS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)


def is_bert_style_layer(block: nn.Module) -> bool:
    """A Hugging Face BERT-family encoder layer without cross-attention."""
    modules = dict(block.named_modules())
    return (
        all(isinstance(modules.get(name), nn.Linear) for name in _BERT_LINEARS)
        and isinstance(modules.get("attention.output.LayerNorm"), nn.LayerNorm)
        and isinstance(modules.get("output.LayerNorm"), nn.LayerNorm)
        and "crossattention" not in modules
        and sum(isinstance(m, nn.Linear) for m in modules.values()) == len(_BERT_LINEARS)
    )


def bert_style_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    attention = block.attention.self

    def localize(module: nn.Module, tp: int) -> None:
        local_heads(
            module.attention.self, tp, "num_attention_heads", "all_head_size"
        )  # the code reshapes with -1 heads

    return megatron_plan(
        block,
        columns={
            "attention.self.query": None,
            "attention.self.key": None,
            "attention.self.value": None,
            "intermediate.dense": None,
        },
        rows=["attention.output.dense", "output.dense"],
        norms=["attention.output.LayerNorm", "output.LayerNorm"],
        gathers=["attention.self", "intermediate"],
        divisible={
            "attention heads": attention.num_attention_heads,
            "MLP width": block.intermediate.dense.out_features,
        },
        localize=localize,
        ulysses=hf_sdpa(block),
    )


def distilbert_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    """DistilBERT: ``attention.q_lin/k_lin/v_lin/out_lin``, ``ffn.lin1/lin2``, post-norm ``sa_layer_norm`` and
    ``output_layer_norm`` after the residual adds of the block; the attention reshapes with -1 heads."""
    return megatron_plan(
        block,
        columns={"attention.q_lin": None, "attention.k_lin": None, "attention.v_lin": None, "ffn.lin1": None},
        rows=["attention.out_lin", "ffn.lin2"],
        norms=["sa_layer_norm", "output_layer_norm"],
        gathers=["attention", "ffn"],
        divisible={"attention heads": block.attention.n_heads, "MLP width": block.ffn.lin1.out_features},
        ulysses=hf_sdpa(block),
    )


add_plan("transformers.models.distilbert.modeling_distilbert.TransformerBlock", distilbert_plan)
