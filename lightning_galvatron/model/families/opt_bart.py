"""Hugging Face OPT and BART (and BART's copies: mBART, Marian, Pegasus, M2M-100; Whisper's layers):
``self_attn.q_proj/k_proj/v_proj/out_proj`` (BART decoders add ``encoder_attn``), ``fc1``/``fc2`` called by the
layer itself, learned positions outside the blocks.

OPT flattens batch and sequence before its MLP (``[batch x seq, hidden]``), so under Megatron-SP its
MLP norm and layers shard dimension 0 of that view: each rank's rows are its own tokens, which is
all a per-token MLP needs. BART is post-norm: its norms run on sequence shards after each residual add; Whisper
is pre-norm, its norms on sequence shards before each sub-layer, which gathers the sequence.
"""

from __future__ import annotations

from torch import nn

from lightning_galvatron.model.families._common import hf_sdpa, local_heads, megatron_plan
from lightning_galvatron.model.plan_registry import add_plan
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan


def _attention_columns(prefix: str) -> dict[str, None]:
    return {f"{prefix}.{name}": None for name in ("q_proj", "k_proj", "v_proj")}


def opt_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    pre_norm = block.do_layer_norm_before
    return megatron_plan(
        block,
        columns=_attention_columns("self_attn") | {"fc1": None},
        rows=["self_attn.out_proj", "fc2"],
        norms=["self_attn_layer_norm", "final_layer_norm"],
        gathers=["self_attn", "fc1"],
        # Pre-norm OPT normalises the flattened [batch x seq, hidden] view before fc1; post-norm OPT after the view
        # back.
        sequence_dims={"fc1": 0, "fc2": 0, "final_layer_norm": 0 if pre_norm else 1},
        divisible={"attention heads": block.self_attn.num_heads, "MLP width": block.fc1.out_features},
        localize=lambda module, tp: local_heads(module.self_attn, tp, "num_heads"),
        ulysses=hf_sdpa(block),
    )


def bart_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    return _bart_like_plan(block, localize=False)


def whisper_plan(block: nn.Module) -> BlockTensorParallelPlan | str:
    """Whisper's layers are BART's, pre-norm; its attention views keys and values with ``self.num_heads``."""
    return _bart_like_plan(block, localize=True)


def _bart_like_plan(block: nn.Module, localize: bool) -> BlockTensorParallelPlan | str:
    attentions = ["self_attn"] + (["encoder_attn"] if hasattr(block, "encoder_attn") else [])

    def local(module: nn.Module, tp: int) -> None:
        for name in attentions:
            local_heads(module.get_submodule(name), tp, "num_heads")

    columns: dict[str, None] = {"fc1": None}
    for name in attentions:
        columns |= _attention_columns(name)
    return megatron_plan(
        block,
        columns=columns,
        rows=[f"{name}.out_proj" for name in attentions] + ["fc2"],
        norms=[f"{name}_layer_norm" for name in attentions] + ["final_layer_norm"],
        gathers=[*attentions, "fc1"],
        divisible={"attention heads": block.self_attn.num_heads, "MLP width": block.fc1.out_features},
        localize=local if localize else None,  # BART's attention reshapes with -1 heads: nothing to localize
        ulysses=hf_sdpa(block),
    )


add_plan("transformers.models.opt.modeling_opt.OPTDecoderLayer", opt_plan)
# BART's layers and their copies (same modules, same attention): mBART, Marian, Pegasus, M2M-100 (NLLB).
for _module, _prefix in (
    ("bart.modeling_bart", "Bart"),
    ("mbart.modeling_mbart", "MBart"),
    ("marian.modeling_marian", "Marian"),
    ("pegasus.modeling_pegasus", "Pegasus"),
    ("m2m_100.modeling_m2m_100", "M2M100"),
):
    for _kind in ("EncoderLayer", "DecoderLayer"):
        add_plan(f"transformers.models.{_module}.{_prefix}{_kind}", bart_plan)
for _kind in ("EncoderLayer", "DecoderLayer"):
    add_plan(f"transformers.models.whisper.modeling_whisper.Whisper{_kind}", whisper_plan)
