"""The model half of a profile: per block type, the embedding/head, and the block sequence."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_galvatron.profiles.fields import (
    DegreeTable,
    LinearFit,
    ProfileError,
    _fields,
    _finite_nonneg,
    _positive_int,
)


@dataclass(frozen=True)
class LayerTypeProfile:
    """One kind of Transformer block (e.g. a decoder layer).

    Attributes:
        name: label used in tables.
        parameters: parameter count of one block (elements).
        hidden_size, num_heads, ffn_hidden_size, seq_length: shape, for the divisibility rules of
            tensor parallelism (heads, hidden, FFN) and Ulysses (heads, sequence) and for message sizes.
        forward_time: forward time of one block on one device without model parallelism, as a
            function of its local batch size.
        backward_to_forward: backward time / forward time (about 2: two matmuls per forward one).
        activation_bytes_per_sample: bytes one device keeps for backward per sample of its local
            batch, per degree ``g`` of a group that splits the activations (Megatron TP with
            sequence parallelism, or Ulysses). Degree 1 = no model parallelism.
        replicated_activation_bytes_per_sample: the part of the degree-1 activations that Megatron
            TP *without* sequence parallelism keeps whole on every rank (norm inputs and the like).
        recompute_activation_bytes_per_sample: what a recomputed block keeps (its input), at degree 1.
        supports_tensor_parallel, supports_megatron_sp, supports_ulysses: which model-parallel
            styles the runtime has for this block type.
        tp_collectives_per_forward: all-reduces per forward under Megatron TP (2: attention and MLP).
        ulysses_all_to_alls_per_forward: all-to-alls per forward under Ulysses (4: q, k, v, output).
        tensor_parallel_divisors: sizes every Megatron TP degree must divide, from the block's
            tensor-parallel plan (heads, key/value heads, widths; key/value heads a plan keeps whole are
            not among them). Empty (profiles before this field): the heads, hidden and FFN sizes above.
        ulysses_divisors: sizes every Ulysses degree must divide besides the sequence (the query heads).
            Empty: ``num_heads``.
    """

    name: str
    parameters: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    seq_length: int
    forward_time: LinearFit
    activation_bytes_per_sample: DegreeTable
    recompute_activation_bytes_per_sample: float
    replicated_activation_bytes_per_sample: float = 0.0
    backward_to_forward: float = 2.0
    supports_tensor_parallel: bool = True
    supports_megatron_sp: bool = True
    supports_ulysses: bool = True
    tp_collectives_per_forward: int = 2
    ulysses_all_to_alls_per_forward: int = 4
    tensor_parallel_divisors: tuple[int, ...] = ()
    ulysses_divisors: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("parameters", "hidden_size", "num_heads", "ffn_hidden_size", "seq_length"):
            _positive_int(f"layer type {self.name!r}: {name}", getattr(self, name))
        for name in ("tensor_parallel_divisors", "ulysses_divisors"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)):
                raise ProfileError(
                    f"layer type {self.name!r}: {name} must be a list of positive integers, got {values!r}"
                )
            for value in values:
                _positive_int(f"layer type {self.name!r}: {name}", value)
            object.__setattr__(self, name, tuple(values))
        _finite_nonneg(
            f"layer type {self.name!r}: recompute_activation_bytes_per_sample",
            self.recompute_activation_bytes_per_sample,
        )
        _finite_nonneg(
            f"layer type {self.name!r}: replicated_activation_bytes_per_sample",
            self.replicated_activation_bytes_per_sample,
        )
        _finite_nonneg(f"layer type {self.name!r}: backward_to_forward", self.backward_to_forward)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["forward_time"] = self.forward_time.to_dict()
        out["activation_bytes_per_sample"] = self.activation_bytes_per_sample.to_dict()
        for name in ("tensor_parallel_divisors", "ulysses_divisors"):
            out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LayerTypeProfile:
        kwargs = _fields(data, where, cls=cls)
        kwargs["forward_time"] = LinearFit.from_dict(kwargs["forward_time"], f"{where}.forward_time")
        kwargs["activation_bytes_per_sample"] = DegreeTable.from_dict(
            kwargs["activation_bytes_per_sample"], f"{where}.activation_bytes_per_sample"
        )
        return cls(**kwargs)


@dataclass(frozen=True)
class VocabProfile:
    """The embedding (first pipeline stage) and the head with the loss (last stage).

    Attributes:
        vocab_size: vocabulary size (any vocabulary-parallel degree works: shards may differ by one row).
        embedding_parameters, head_parameters: parameter counts; with ``tied`` the head reuses the
            embedding (``head_parameters`` is then 0 and, under pipelining, both end stages hold it).
        embedding_forward_time, head_forward_time: forward time vs local batch, degree 1.
        embedding_activation_bytes_per_sample, head_activation_bytes_per_sample: bytes per sample
            one device keeps, per vocabulary-parallel (or sequence-split) degree. The head's include
            the logits, usually the largest activation of the model.
        backward_to_forward: backward time / forward time.
        supports_tensor_parallel, supports_sequence_split: vocabulary-parallel (Megatron) and
            sequence-split (weights whole, like Ulysses) execution available in the runtime.
    """

    vocab_size: int
    embedding_parameters: int
    head_parameters: int
    embedding_forward_time: LinearFit
    head_forward_time: LinearFit
    embedding_activation_bytes_per_sample: DegreeTable
    head_activation_bytes_per_sample: DegreeTable
    tied: bool = False
    backward_to_forward: float = 2.0
    supports_tensor_parallel: bool = True
    supports_sequence_split: bool = True

    def __post_init__(self) -> None:
        _positive_int("vocab.vocab_size", self.vocab_size)
        for name in ("embedding_parameters", "head_parameters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProfileError(f"vocab.{name} must be a non-negative integer, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("embedding_forward_time", "head_forward_time"):
            out[name] = getattr(self, name).to_dict()
        for name in ("embedding_activation_bytes_per_sample", "head_activation_bytes_per_sample"):
            out[name] = getattr(self, name).to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> VocabProfile:
        kwargs = _fields(data, where, cls=cls)
        for name in ("embedding_forward_time", "head_forward_time"):
            kwargs[name] = LinearFit.from_dict(kwargs[name], f"{where}.{name}")
        for name in ("embedding_activation_bytes_per_sample", "head_activation_bytes_per_sample"):
            kwargs[name] = DegreeTable.from_dict(kwargs[name], f"{where}.{name}")
        return cls(**kwargs)


@dataclass(frozen=True)
class ModelProfile:
    """A model: its block types, which type each block is, and the embedding/head.

    Attributes:
        name: label.
        layer_types: the distinct block types.
        blocks: one index into ``layer_types`` per Transformer block, in model order.
        vocab: the embedding and head.
        activation_dtype_bytes: bytes per element of the profiled activations (2 for bf16); the
            cost model rescales activation bytes when asked about another compute dtype.
        hidden_size, seq_length: of the residual stream between blocks and of the embedding.
        block_lists: how many separate block containers hold the blocks (an encoder and a decoder: 2).
            A pipeline cuts one sequence of blocks; with several lists the decoder's stages would need
            the encoder's output, which the runtime does not pass on, so the search keeps ``pp = 1``.
        precision: the Lightning precision the blocks were measured in (``bf16-mixed``, ``32-true``, ...);
            what the offline tools assume unless told otherwise. ``None``: not recorded.
    """

    name: str
    layer_types: tuple[LayerTypeProfile, ...]
    blocks: tuple[int, ...]
    vocab: VocabProfile
    hidden_size: int
    seq_length: int
    activation_dtype_bytes: int = 2
    block_lists: int = 1
    precision: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.layer_types:
            raise ProfileError("model.layer_types needs at least one block type")
        if not self.blocks:
            raise ProfileError("model.blocks needs at least one block (a layer-type index per block)")
        for i, t in enumerate(self.blocks):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < len(self.layer_types):
                raise ProfileError(
                    f"model.blocks[{i}] = {t!r} is not an index into the {len(self.layer_types)} layer types"
                )
        _positive_int("model.hidden_size", self.hidden_size)
        _positive_int("model.seq_length", self.seq_length)
        _positive_int("model.activation_dtype_bytes", self.activation_dtype_bytes)
        _positive_int("model.block_lists", self.block_lists)
        if self.block_lists > len(self.blocks):
            raise ProfileError(
                f"model.block_lists = {self.block_lists} but the model has only {len(self.blocks)} blocks"
            )
        if self.precision is not None and not (isinstance(self.precision, str) and self.precision):
            raise ProfileError(f"model.precision must be a precision name such as 'bf16-mixed', got {self.precision!r}")

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_type(self, index: int) -> LayerTypeProfile:
        return self.layer_types[self.blocks[index]]

    def with_num_blocks(self, num_blocks: int) -> ModelProfile:
        """The same model with ``num_blocks`` blocks (the block-type pattern repeated); for what-ifs and benchmarks."""
        _positive_int("num_blocks", num_blocks)
        pattern = self.blocks
        blocks = tuple(pattern[i % len(pattern)] for i in range(num_blocks))
        return dataclasses.replace(self, blocks=blocks)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "seq_length": self.seq_length,
            "activation_dtype_bytes": self.activation_dtype_bytes,
            "layer_types": [t.to_dict() for t in self.layer_types],
            "blocks": list(self.blocks),
            "block_lists": self.block_lists,
            "vocab": self.vocab.to_dict(),
        }
        if self.precision is not None:  # files without it stay readable by earlier versions
            out["precision"] = self.precision
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "model") -> ModelProfile:
        kwargs = _fields(data, where, cls=cls)
        if not isinstance(kwargs["layer_types"], list):
            raise ProfileError(f"{where}.layer_types must be a list")
        kwargs["layer_types"] = tuple(
            LayerTypeProfile.from_dict(t, f"{where}.layer_types[{i}]") for i, t in enumerate(kwargs["layer_types"])
        )
        kwargs["vocab"] = VocabProfile.from_dict(kwargs["vocab"], f"{where}.vocab")
        if not isinstance(kwargs["blocks"], list):
            raise ProfileError(f"{where}.blocks must be a list of layer-type indices")
        kwargs["blocks"] = tuple(kwargs["blocks"])
        return cls(**kwargs)
