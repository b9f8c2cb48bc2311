"""Analytic model profiles for clusters you do not have: ``lightning-galvatron estimate``.

The search needs a :class:`~lightning_galvatron.profiles.ModelProfile`: per block type its parameters,
its forward time as a function of the batch and its activation bytes per sample and parallel degree.
For a model that has never run on the target hardware those numbers are built here from two sources:

* **the model's shape** (:class:`ArchitectureShape`): counted exactly from a Hugging Face config
  (:func:`architecture_from_hf_config`, no torch needed for the families it knows) or from a model
  built on the meta device (:mod:`lightning_galvatron.model.shapes`): parameters per block, the
  parameters of its matrix multiplications, hidden size, heads, FFN width, vocabulary;
* **a measured reference profile** (a profile written by ``lightning-galvatron profile`` or imported
  with ``import-galvatron``): its block type with the most parameters calibrates compute and memory.

What is measured, what is scaled, and how (:func:`scaled_model_profile`):

* parameters, heads, widths, vocabulary: exact, from the shape (nothing scaled);
* forward time per sample: the reference block's measured slope times the ratio of forward FLOPs,
  ``2 x matmul parameters x s + 4 x s x s_kv x attention width`` per attention call (per sample of
  ``s`` tokens). This assumes the new block reaches the same FLOP rate as the measured one on that
  hardware: a good assumption for blocks of similar width, optimistic for much narrower ones. The
  fixed cost per call (intercept) is kept as measured;
* activation bytes per sample, per parallel degree: the reference's measured table times the ratio
  of the tensors a block keeps for backward, counted per token in :func:`activation_elements`
  (inputs of the norms and projections, q/k/v and the attention output, the MLP's hidden
  activations; attention through SDPA/flash kernels, so no ``s x s`` score matrix) times ``s``.
  What the reference keeps beyond that count (fp32 copies in norms, masks) scales along with it;
* what a recomputed block keeps (its input) and the part plain tensor parallelism keeps whole: the
  reference's, times the ratio of ``s x hidden``;
* embedding and head: the reference's times the ratio of ``s x hidden`` (embedding) and of
  ``s x head outputs x hidden`` (head time; ``s x (head outputs + hidden)`` for its activations,
  the logits included);
* backward/forward ratio and activation dtype: the reference's;
* hardware (collectives, overlap, memory overhead): the hardware profile's, unchanged.

Everything here is numpy-free and torch-free: estimates run anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_galvatron.profiles import (
    DegreeTable,
    HardwareProfile,
    LayerTypeProfile,
    LinearFit,
    ModelProfile,
    Profile,
    ProfileError,
    VocabProfile,
)


@dataclass(frozen=True)
class BlockShape:
    """The shape of one block type, all that the analytic costs need.

    Attributes:
        name: label (the block class).
        parameters: parameter count of one block.
        matmul_parameters: parameters that are weights of matrix multiplications (2 FLOPs each per token).
        hidden_size: width of the residual stream.
        num_heads: query heads; ``head_dim`` their width.
        num_key_value_heads: key/value heads (grouped-query attention; = ``num_heads`` otherwise).
        ffn_hidden_size: width of the feed-forward layer.
        gated_mlp: the MLP has a gate (SwiGLU: three matrices instead of two).
        attention_calls: attention operations per forward (2 for a decoder block with cross-attention).
        supports_tensor_parallel, supports_megatron_sp, supports_ulysses: what the runtime can execute for it.
        tp_collectives_per_forward: all-reduces per forward under Megatron TP (one per row-parallel layer).
        tensor_parallel_divisors, ulysses_divisors: sizes a Megatron / Ulysses degree must divide (see
            :class:`~lightning_galvatron.profiles.LayerTypeProfile`); empty: from the heads and widths.
    """

    name: str
    parameters: int
    matmul_parameters: int
    hidden_size: int
    num_heads: int
    head_dim: int
    num_key_value_heads: int
    ffn_hidden_size: int
    gated_mlp: bool = False
    attention_calls: int = 1
    supports_tensor_parallel: bool = True
    supports_megatron_sp: bool = True
    supports_ulysses: bool = True
    tp_collectives_per_forward: int = 2
    tensor_parallel_divisors: tuple[int, ...] = ()
    ulysses_divisors: tuple[int, ...] = ()

    @property
    def attention_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def key_value_width(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True)
class VocabShape:
    """Embedding and head.

    Attributes:
        vocab_size: rows of the token embedding.
        embedding_parameters: parameters before the blocks (token and position embeddings, their norm).
        head_parameters: parameters after the blocks that are not tied to the embedding (final norm, head).
        head_outputs: outputs per position of the head (the vocabulary for a language model, the
            classes of a classifier).
        tied: the head's weight is the token embedding.
        vocab_parallel: there is a token embedding (an ``nn.Embedding`` outside the blocks) to split by vocabulary.
    """

    vocab_size: int
    embedding_parameters: int
    head_parameters: int
    head_outputs: int
    tied: bool = False
    vocab_parallel: bool = True


@dataclass(frozen=True)
class ArchitectureShape:
    """A model's shape: block types, which type each block is, how many block lists, the vocabulary."""

    name: str
    layer_types: tuple[BlockShape, ...]
    blocks: tuple[int, ...]
    vocab: VocabShape
    hidden_size: int
    block_lists: int = 1
    default_seq_length: int | None = None

    @property
    def parameters(self) -> int:
        blocks = sum(self.layer_types[t].parameters for t in self.blocks)
        return blocks + self.vocab.embedding_parameters + self.vocab.head_parameters

    def describe(self) -> str:
        counts: dict[int, int] = {}
        for t in self.blocks:
            counts[t] = counts.get(t, 0) + 1
        kinds = " + ".join(f"{n} x {self.layer_types[t].name}" for t, n in counts.items())
        return f"{self.name} ({kinds}, {self.parameters / 1e9:.2f} B parameters)"


# ---------------------------------------------------------------------------------------------- Hugging Face configs
_GATED_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "yi", "internlm2")
_BERT_STYLE = ("bert", "roberta", "xlm-roberta", "camembert", "electra")


def architecture_from_hf_config(config: Mapping[str, Any]) -> ArchitectureShape | None:
    """The shape of a Hugging Face model from its ``config.json``, for the families counted here exactly
    (Llama-style decoders, GPT-2, BERT-style encoders); ``None`` for others (the meta-device path
    of :mod:`lightning_galvatron.model.shapes` handles any model ``transformers`` can build)."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type in _GATED_DECODERS:
        return _gated_decoder(config, model_type)
    if model_type == "gpt2":
        return _gpt2(config)
    if model_type in _BERT_STYLE:
        return _bert_style(config, model_type)
    return None


def _require(config: Mapping[str, Any], *keys: str) -> list[int]:
    missing = [k for k in keys if k not in config]
    if missing:
        raise ProfileError(f"the config lacks {missing}")
    return [int(config[k]) for k in keys]


def _gated_decoder(config: Mapping[str, Any], model_type: str) -> ArchitectureShape:
    h, layers, heads, ffn, vocab = _require(
        config, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"
    )
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
    out_bias = bool(config.get("attention_bias", False)) and model_type != "qwen2"
    mlp_bias = bool(config.get("mlp_bias", False))
    matmul = h * q + 2 * h * kv + q * h + 3 * h * ffn
    biases = (q + 2 * kv if qkv_bias else 0) + (h if out_bias else 0) + (2 * ffn + h if mlp_bias else 0)
    norms = 2 * h + (2 * head_dim if model_type == "qwen3" else 0)  # qwen3 adds q/k norms
    block = BlockShape(
        name=f"{model_type} decoder layer",
        parameters=matmul + biases + norms,
        matmul_parameters=matmul,
        hidden_size=h,
        num_heads=heads,
        head_dim=head_dim,
        num_key_value_heads=kv_heads,
        ffn_hidden_size=ffn,
        gated_mlp=True,
        # As the built-in Llama-family plan splits them (key/value heads kept whole under multi-query attention).
        tensor_parallel_divisors=(heads, *((kv_heads,) if kv_heads > 1 else ()), ffn),
        ulysses_divisors=(heads,),
    )
    tied = bool(config.get("tie_word_embeddings", False))
    vocab_shape = VocabShape(
        vocab_size=vocab,
        embedding_parameters=vocab * h,
        head_parameters=h + (0 if tied else vocab * h),
        head_outputs=vocab,
        tied=tied,
    )
    return ArchitectureShape(
        name=_name(config, model_type),
        layer_types=(block,),
        blocks=(0,) * layers,
        vocab=vocab_shape,
        hidden_size=h,
        default_seq_length=_positions(config, "max_position_embeddings"),
    )


def _gpt2(config: Mapping[str, Any]) -> ArchitectureShape:
    h, layers, heads, vocab = _require(config, "n_embd", "n_layer", "n_head", "vocab_size")
    ffn = int(config.get("n_inner") or 4 * h)
    positions = int(config.get("n_positions", 1024))
    matmul = h * 3 * h + h * h + 2 * h * ffn
    block = BlockShape(
        name="GPT2Block",
        parameters=matmul + 3 * h + h + ffn + h + 4 * h,
        matmul_parameters=matmul,
        hidden_size=h,
        num_heads=heads,
        head_dim=h // heads,
        num_key_value_heads=heads,
        ffn_hidden_size=ffn,
        tensor_parallel_divisors=(heads, ffn),
        ulysses_divisors=(heads,),
    )
    vocab_shape = VocabShape(
        vocab_size=vocab,
        embedding_parameters=vocab * h + positions * h,
        head_parameters=2 * h,
        head_outputs=vocab,
        tied=True,
    )
    return ArchitectureShape(
        name=_name(config, "gpt2"),
        layer_types=(block,),
        blocks=(0,) * layers,
        vocab=vocab_shape,
        hidden_size=h,
        default_seq_length=positions,
    )


def _bert_style(config: Mapping[str, Any], model_type: str) -> ArchitectureShape:
    h, layers, heads, ffn, vocab = _require(
        config, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"
    )
    positions = int(config.get("max_position_embeddings", 512))
    token_types = int(config.get("type_vocab_size", 2))
    matmul = 4 * h * h + 2 * h * ffn
    block = BlockShape(
        name=f"{model_type} layer",
        parameters=matmul + 4 * h + ffn + h + 4 * h,
        matmul_parameters=matmul,
        hidden_size=h,
        num_heads=heads,
        head_dim=h // heads,
        num_key_value_heads=heads,
        ffn_hidden_size=ffn,
        tensor_parallel_divisors=(heads, ffn),
        ulysses_divisors=(heads,),
    )
    architectures = " ".join(config.get("architectures") or [])
    if "MaskedLM" in architectures or not architectures:
        head_parameters, outputs, tied = h * h + h + 2 * h + vocab, vocab, True  # transform, norm, bias; tied decoder
    else:
        labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
        head_parameters, outputs, tied = h * h + h + h * labels + labels, labels, False  # pooler and classifier
    vocab_shape = VocabShape(
        vocab_size=vocab,
        embedding_parameters=(vocab + positions + token_types) * h + 2 * h,
        head_parameters=head_parameters,
        head_outputs=outputs,
        tied=tied,
    )
    return ArchitectureShape(
        name=_name(config, model_type),
        layer_types=(block,),
        blocks=(0,) * layers,
        vocab=vocab_shape,
        hidden_size=h,
        default_seq_length=positions,
    )


def _name(config: Mapping[str, Any], fallback: str) -> str:
    return str(config.get("_name_or_path") or (config.get("architectures") or [fallback])[0])


def _positions(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    return int(value) if value else None


# ---------------------------------------------------------------------------------------------- scaling
def forward_flops_per_sample(block: BlockShape, seq_length: int) -> float:
    """Forward FLOPs of one block for one sample of ``seq_length`` tokens (attention over as many keys)."""
    s = seq_length
    return 2.0 * block.matmul_parameters * s + block.attention_calls * 4.0 * s * s * block.attention_width


def activation_elements(block: BlockShape) -> float:
    """Elements per token a block keeps for backward (no recomputation, no parallelism).

    Per token: the inputs of the two norms and of the attention and MLP projections (4 x hidden),
    q, k and v and the attention output (2 x attention width + 2 x key/value width) per attention
    call, the output projection's input (attention width), and the MLP's hidden activations: the
    activation's input and the second projection's input (2 x FFN), plus the gate and the product
    with a gated MLP (4 x FFN). Attention runs through SDPA/flash kernels, so no ``s x s`` scores.
    """
    attention = block.attention_calls * (3 * block.attention_width + 2 * block.key_value_width)
    mlp = (4 if block.gated_mlp else 2) * block.ffn_hidden_size
    return 4.0 * block.hidden_size + attention + mlp


def reference_block_shape(layer: LayerTypeProfile) -> BlockShape:
    """What a profiled block type says about its shape (for the reference side of the ratios): its
    parameters as matmul weights, attention as wide as the hidden size, the MLP gated when its FFN
    is narrower than 4 x hidden (the usual sign of SwiGLU widths)."""
    return BlockShape(
        name=layer.name,
        parameters=layer.parameters,
        matmul_parameters=layer.parameters,
        hidden_size=layer.hidden_size,
        num_heads=layer.num_heads,
        head_dim=max(layer.hidden_size // layer.num_heads, 1),
        num_key_value_heads=layer.num_heads,
        ffn_hidden_size=layer.ffn_hidden_size,
        gated_mlp=layer.ffn_hidden_size < 4 * layer.hidden_size,
    )


@dataclass(frozen=True)
class Scaling:
    """How one block type's costs were derived from the reference (for the report)."""

    layer_type: str
    reference: str
    time_ratio: float
    activation_ratio: float


def scaled_model_profile(
    architecture: ArchitectureShape, reference: ModelProfile, seq_length: int
) -> tuple[ModelProfile, list[Scaling]]:
    """The analytic :class:`ModelProfile` of ``architecture`` at ``seq_length`` (see the module docstring)."""
    if not isinstance(seq_length, int) or seq_length < 1:
        raise ProfileError(f"seq_length must be a positive integer, got {seq_length!r}")
    ref_layer = max(reference.layer_types, key=lambda t: t.parameters)
    ref_shape = reference_block_shape(ref_layer)
    ref_s, s = ref_layer.seq_length, seq_length
    ref_flops = forward_flops_per_sample(ref_shape, ref_s)
    ref_elements = activation_elements(ref_shape) * ref_s
    residual = (s * architecture.hidden_size) / (ref_s * ref_layer.hidden_size)

    layer_types, notes = [], []
    for block in architecture.layer_types:
        time_ratio = forward_flops_per_sample(block, s) / ref_flops
        activation_ratio = activation_elements(block) * s / ref_elements
        table = ref_layer.activation_bytes_per_sample
        degrees = sorted({g for g, _ in table.values} | {1, 2, 4, 8})
        layer_types.append(
            LayerTypeProfile(
                name=block.name,
                parameters=block.parameters,
                hidden_size=block.hidden_size,
                num_heads=math.gcd(block.num_heads, block.num_key_value_heads),  # what a TP degree must divide
                ffn_hidden_size=block.ffn_hidden_size,
                seq_length=s,
                forward_time=LinearFit(
                    ref_layer.forward_time.intercept_s, ref_layer.forward_time.per_sample_s * time_ratio
                ),
                activation_bytes_per_sample=DegreeTable(tuple((g, table.at(g) * activation_ratio) for g in degrees)),
                recompute_activation_bytes_per_sample=ref_layer.recompute_activation_bytes_per_sample
                * (s * block.hidden_size)
                / (ref_s * ref_layer.hidden_size),
                replicated_activation_bytes_per_sample=ref_layer.replicated_activation_bytes_per_sample
                * (s * block.hidden_size)
                / (ref_s * ref_layer.hidden_size),
                backward_to_forward=ref_layer.backward_to_forward,
                supports_tensor_parallel=block.supports_tensor_parallel,
                supports_megatron_sp=block.supports_megatron_sp,
                supports_ulysses=block.supports_ulysses,
                tp_collectives_per_forward=block.tp_collectives_per_forward,
                ulysses_all_to_alls_per_forward=4 * block.attention_calls,
                tensor_parallel_divisors=block.tensor_parallel_divisors,
                ulysses_divisors=block.ulysses_divisors,
            )
        )
        notes.append(Scaling(block.name, ref_layer.name, time_ratio, activation_ratio))

    ref_vocab, vocab = reference.vocab, architecture.vocab
    ref_h = reference.hidden_size
    ref_head_outputs = ref_vocab.vocab_size
    head_time = (s * vocab.head_outputs * architecture.hidden_size) / (ref_s * ref_head_outputs * ref_h)
    head_bytes = (s * (vocab.head_outputs + architecture.hidden_size)) / (ref_s * (ref_head_outputs + ref_h))

    def scaled_fit(fit: LinearFit, ratio: float) -> LinearFit:
        return LinearFit(fit.intercept_s, fit.per_sample_s * ratio)

    def scaled_table(table: DegreeTable, ratio: float) -> DegreeTable:
        return DegreeTable(tuple((g, v * ratio) for g, v in table.values))

    vocab_profile = VocabProfile(
        vocab_size=vocab.vocab_size,
        embedding_parameters=vocab.embedding_parameters,
        head_parameters=0 if vocab.tied else vocab.head_parameters,
        embedding_forward_time=scaled_fit(ref_vocab.embedding_forward_time, residual),
        head_forward_time=scaled_fit(ref_vocab.head_forward_time, head_time),
        embedding_activation_bytes_per_sample=scaled_table(ref_vocab.embedding_activation_bytes_per_sample, residual),
        head_activation_bytes_per_sample=scaled_table(ref_vocab.head_activation_bytes_per_sample, head_bytes),
        tied=vocab.tied,
        backward_to_forward=ref_vocab.backward_to_forward,
        supports_tensor_parallel=vocab.vocab_parallel,
        supports_sequence_split=False,
    )
    model = ModelProfile(
        name=architecture.name,
        layer_types=tuple(layer_types),
        blocks=architecture.blocks,
        vocab=vocab_profile,
        hidden_size=architecture.hidden_size,
        seq_length=s,
        activation_dtype_bytes=reference.activation_dtype_bytes,
        block_lists=architecture.block_lists,
        precision=reference.precision,
    )
    return model, notes


def analytic_profile(
    architecture: ArchitectureShape,
    reference: Profile,
    seq_length: int,
    hardware: HardwareProfile | None = None,
) -> tuple[Profile, list[Scaling]]:
    """A complete profile: the scaled model and ``hardware`` (default: the reference's hardware)."""
    model, notes = scaled_model_profile(architecture, reference.model, seq_length)
    hardware = hardware or reference.hardware
    source = (
        f"analytic estimate of {architecture.name} at sequence {seq_length}: compute and activations scaled from "
        f"{reference.model.name} ({reference.source or 'reference profile'}); hardware: {hardware.name}"
    )
    return Profile(model, hardware, source=source), notes


__all__ = [
    "ArchitectureShape",
    "BlockShape",
    "Scaling",
    "VocabShape",
    "activation_elements",
    "analytic_profile",
    "architecture_from_hf_config",
    "forward_flops_per_sample",
    "scaled_model_profile",
]
