"""The profile: everything the search needs to know about a model and a cluster, as versioned JSON.

A :class:`Profile` has two halves:

* :class:`ModelProfile` -- the Transformer: one or more :class:`LayerTypeProfile` (most models have
  one block type, encoder-decoder models two), the block sequence (a layer-type index per block)
  and the embedding/head (:class:`VocabProfile`). Per layer type: parameter count, shape
  (heads, hidden, FFN, sequence) for the divisibility rules, forward time as a linear fit of the
  local batch size, and activation bytes per sample for each tensor/sequence-parallel degree and
  with recomputation.
* :class:`HardwareProfile` -- the devices: memory, a fixed per-device overhead, the overlap
  coefficient of computation with communication and one :class:`CollectiveFit` per measured
  (collective, group size, ranks per node): ``time = latency + volume * bytes / bandwidth``.

Units are SI throughout: seconds, bytes, bytes per second. Parameters are counted in elements
(their bytes follow from the precision the search is asked about); activations are bytes in the
profiled compute dtype (``ModelProfile.activation_dtype_bytes``).

Bandwidths follow the NCCL-tests "bus bandwidth" convention, so one number per group describes
every collective: a collective of ``bytes`` (the full, unsharded tensor) over ``g`` ranks moves
``volume(kind, g) * bytes`` per rank, with ``volume`` = ``2(g-1)/g`` for all-reduce,
``(g-1)/g`` for all-gather, reduce-scatter and all-to-all, and 1 for point-to-point.

The layout of a group is described by ``ranks_per_node``: how many of its ranks share a node
(``== group_size`` for a group inside one node). This is what decides its bandwidth, and unlike a
"consecutive" flag it means the same thing whatever the size of the cluster it was measured on.

Shape of the JSON (version 1; every key is a field of the dataclass of the same name)::

    {"format": "lightning_galvatron.profile", "version": 1, "source": "...", "fingerprint": {...} (optional),
     "model": {"name": "llama2-7b", "hidden_size": 4096, "seq_length": 2048, "activation_dtype_bytes": 2,
               "layer_types": [{"name": "decoder", "parameters": 202383360, "hidden_size": 4096,
                                "num_heads": 32, "ffn_hidden_size": 11008, "seq_length": 2048,
                                "forward_time": {"intercept_s": 0.0008, "per_sample_s": 0.0039},
                                "activation_bytes_per_sample": {"1": 5.4e8, "2": 2.9e8, "4": 1.4e8, "8": 7.2e7},
                                "recompute_activation_bytes_per_sample": 3.4e7, ...}],
               "blocks": [0, 0, ...], "precision": "bf16-mixed" (optional),
               "vocab": {"vocab_size": 32000, "embedding_parameters": ..., "head_parameters": ..., ...}},
     "hardware": {"name": "...", "devices_per_node": 8, "overlap_coefficient": 1.13, "device_type": "cuda" (optional),
                  "device_memory_bytes": null, "memory_overhead_bytes": 0,
                  "collectives": [{"kind": "all_reduce", "group_size": 8, "ranks_per_node": 8,
                                   "latency_s": 8.6e-05, "bandwidth_bytes_per_s": 1.6e11}, ...]}}

A reader refuses unknown keys, missing required keys and newer versions, naming the path of the
offending entry. Profilers fill it naturally: time a block at two or more batch sizes and
:meth:`LinearFit.fit`; count activation bytes per degree; sweep message sizes per group and
:meth:`CollectiveFit.fit`.

The module is torch-free: the offline search and the torch profilers both use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_galvatron.jsonfile import read_json_object

PROFILE_FORMAT = "lightning_galvatron.profile"
PROFILE_VERSION = 1
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


class ProfileError(ValueError):
    """A profile that is malformed or lacks something the search needs; the message says what."""


# ---------------------------------------------------------------------------------------------- pieces
@dataclass(frozen=True)
class LinearFit:
    """``time(x) = intercept_s + per_sample_s * x`` for a local batch of ``x`` samples (x may be fractional)."""

    intercept_s: float
    per_sample_s: float

    def __post_init__(self) -> None:
        _finite_nonneg("intercept_s", self.intercept_s)
        _finite_nonneg("per_sample_s", self.per_sample_s)

    def __call__(self, samples: Any) -> Any:
        return self.intercept_s + self.per_sample_s * samples

    @classmethod
    def fit(cls, samples: Sequence[float], times_s: Sequence[float]) -> LinearFit:
        """Least-squares line through measured (batch size, time) points; one point gives a line through 0."""
        xs = [float(x) for x in samples]
        ys = [float(y) for y in times_s]
        if not xs or len(xs) != len(ys):
            raise ProfileError("a linear fit needs as many times as batch sizes, and at least one")
        if len(set(xs)) == 1:
            return cls(0.0, max(sum(ys) / len(ys) / xs[0], 0.0))
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        slope = max(slope, 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # a negative fixed cost is noise; refit through the origin
            return cls(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
        return cls(intercept, slope)

    def to_dict(self) -> dict[str, float]:
        return {"intercept_s": self.intercept_s, "per_sample_s": self.per_sample_s}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LinearFit:
        return cls(**_fields(data, where, required=("intercept_s", "per_sample_s")))


@dataclass(frozen=True)
class DegreeTable:
    """Bytes per sample measured at some parallel degrees; other degrees from a ``a + c/g`` fit.

    ``values`` maps a degree ``g`` (the size of the tensor/sequence-parallel group) to bytes per
    sample on one device. A degree that was not measured (3 or 6 on a 12-device cluster, say) is
    interpolated by least squares through ``a + c/g``: the part of the activations the group splits
    plus the part it cannot.
    """

    values: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        items = tuple(sorted((int(g), float(v)) for g, v in dict(self.values).items()))
        if not items:
            raise ProfileError("a per-degree table needs at least one measured degree")
        for g, v in items:
            if g < 1:
                raise ProfileError(f"parallel degrees start at 1, got {g}")
            _finite_nonneg(f"bytes at degree {g}", v)
        object.__setattr__(self, "values", items)

    def at(self, degree: int) -> float:
        table = dict(self.values)
        if degree in table:
            return table[degree]
        if len(table) == 1:
            (g0, v0), = table.items()
            return v0 * g0 / degree
        inv = [1.0 / g for g in table]
        ys = list(table.values())
        mean_x, mean_y = sum(inv) / len(inv), sum(ys) / len(ys)
        c = sum((x - mean_x) * (y - mean_y) for x, y in zip(inv, ys)) / sum((x - mean_x) ** 2 for x in inv)
        a = mean_y - c * mean_x
        return max(a + c / degree, 0.0)

    def to_dict(self) -> dict[str, float]:
        return {str(g): v for g, v in self.values}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DegreeTable:
        if not isinstance(data, Mapping) or not data:
            raise ProfileError(f"{where} must be a non-empty object mapping a parallel degree to bytes per sample")
        try:
            return cls(tuple((int(g), float(v)) for g, v in data.items()))
        except (TypeError, ValueError) as err:
            raise ProfileError(f"{where}: {err}") from None


# ---------------------------------------------------------------------------------------------- model
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
                raise ProfileError(f"layer type {self.name!r}: {name} must be a list of positive integers, got {values!r}")
            for value in values:
                _positive_int(f"layer type {self.name!r}: {name}", value)
            object.__setattr__(self, name, tuple(values))
        _finite_nonneg(f"layer type {self.name!r}: recompute_activation_bytes_per_sample", self.recompute_activation_bytes_per_sample)
        _finite_nonneg(f"layer type {self.name!r}: replicated_activation_bytes_per_sample", self.replicated_activation_bytes_per_sample)
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
            raise ProfileError(f"model.block_lists = {self.block_lists} but the model has only {len(self.blocks)} blocks")
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


# ---------------------------------------------------------------------------------------------- hardware
def bus_volume(kind: str, group_size: int) -> float:
    """Bytes each rank moves per byte of the (unsharded) tensor, in the bus-bandwidth convention."""
    g = group_size
    if kind == "all_reduce":
        return 2.0 * (g - 1) / g
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (g - 1) / g
    if kind == "p2p":
        return 1.0
    raise ProfileError(f"unknown collective kind {kind!r}; known: {COLLECTIVE_KINDS}")


@dataclass(frozen=True)
class CollectiveFit:
    """Measured cost of one collective on one kind of group: ``latency_s + volume * bytes / bandwidth``.

    Attributes:
        kind: one of :data:`COLLECTIVE_KINDS`.
        group_size: ranks in the group. For ``p2p`` it is the number of pipeline stages that were
            exchanging at the same time (pairs of neighbouring stages).
        ranks_per_node: how many of the group's ranks share a node (``group_size`` inside one node;
            for ``p2p``, 2 if a pair of neighbours shares a node, else 1).
        latency_s: fixed cost per call.
        bandwidth_bytes_per_s: bus bandwidth (see the module docstring), with the cluster's other
            groups busy at the same time as they are in training.
    """

    kind: str
    group_size: int
    ranks_per_node: int
    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ProfileError(f"collective kind must be one of {COLLECTIVE_KINDS}, got {self.kind!r}")
        _positive_int("collective group_size", self.group_size)
        _positive_int("collective ranks_per_node", self.ranks_per_node)
        if self.kind != "p2p" and self.ranks_per_node > self.group_size:
            raise ProfileError(f"ranks_per_node={self.ranks_per_node} exceeds group_size={self.group_size}")
        _finite_nonneg("latency_s", self.latency_s)
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ProfileError(f"bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s!r}")

    @property
    def intra_node(self) -> bool:
        return self.ranks_per_node >= (2 if self.kind == "p2p" else self.group_size)

    def time(self, nbytes: Any, group_size: int | None = None) -> Any:
        """Seconds for a tensor of ``nbytes`` over a group of ``group_size`` (default: the measured one)."""
        g = self.group_size if group_size is None else group_size
        return self.latency_s + bus_volume(self.kind, g) * nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def fit(cls, kind: str, group_size: int, ranks_per_node: int, sizes: Sequence[float], times_s: Sequence[float]) -> CollectiveFit:
        """Fit latency and bus bandwidth to measured (bytes, seconds) points, minimising relative error."""
        if len(sizes) < 2 or len(sizes) != len(times_s):
            raise ProfileError("a collective fit needs at least two (size, time) points")
        vol = bus_volume(kind, group_size) if kind != "p2p" else 1.0
        xs = [vol * float(s) for s in sizes]
        ys = [float(t) for t in times_s]
        # Weighted least squares with weights 1/t^2: small messages count as much as large ones.
        w = [1.0 / (y * y) for y in ys]
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, xs)) / sw
        my = sum(wi * y for wi, y in zip(w, ys)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
        slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx
        latency = my - slope * mx
        if latency < 0 or slope <= 0:
            latency = max(latency, 0.0)
            slope = max(sum(wi * x * (y - latency) for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs)), 1e-30)
        return cls(kind, group_size, ranks_per_node, latency, 1.0 / slope)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CollectiveFit:
        return cls(**_fields(data, where, cls=cls))


@dataclass(frozen=True)
class HardwareProfile:
    """Devices and interconnect.

    Attributes:
        name: label.
        devices_per_node: devices that share a node (and its fast interconnect).
        overlap_coefficient: slowdown ``alpha >= 1`` when computation and communication overlap:
            overlapped time is ``max(x, y) + (alpha - 1) * min(x, y)``.
        collectives: the measured :class:`CollectiveFit` entries; none for one device (nothing communicates).
        device_memory_bytes: memory of one device, if known (the budget is given separately).
        memory_overhead_bytes: fixed memory per device the model does not account for (CUDA
            context, allocator caches, communication buffers).
        device_type: the kind of device measured (``cuda``, ``cpu``, ...; torch's ``device.type``), so a
            profile of one kind is not taken for another. ``None``: not recorded.
    """

    name: str
    devices_per_node: int
    overlap_coefficient: float
    collectives: tuple[CollectiveFit, ...]
    device_memory_bytes: int | None = None
    memory_overhead_bytes: int = 0
    device_type: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "collectives", tuple(self.collectives))
        _positive_int("hardware.devices_per_node", self.devices_per_node)
        if not (self.overlap_coefficient >= 1.0 and math.isfinite(self.overlap_coefficient)):
            raise ProfileError(f"hardware.overlap_coefficient must be >= 1, got {self.overlap_coefficient!r}")
        if self.collectives and not any(c.kind == "all_reduce" for c in self.collectives):
            raise ProfileError("hardware.collectives needs at least one all_reduce entry (the fallback for the others)")
        keys = [(c.kind, c.group_size, c.ranks_per_node) for c in self.collectives]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ProfileError(f"hardware.collectives has duplicate entries for (kind, group_size, ranks_per_node) {duplicates}")
        if self.device_memory_bytes is not None:
            _positive_int("hardware.device_memory_bytes", self.device_memory_bytes)
        if not isinstance(self.memory_overhead_bytes, int) or self.memory_overhead_bytes < 0:
            raise ProfileError(f"hardware.memory_overhead_bytes must be a non-negative integer, got {self.memory_overhead_bytes!r}")
        if self.device_type is not None and not (isinstance(self.device_type, str) and self.device_type):
            raise ProfileError(f"hardware.device_type must be a device type such as 'cuda' or 'cpu', got {self.device_type!r}")

    def collective(self, kind: str, group_size: int, ranks_per_node: int) -> CollectiveFit:
        """The entry that best describes ``kind`` over such a group (see :func:`lookup_collective`)."""
        return lookup_collective(self.collectives, kind, group_size, ranks_per_node)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["collectives"] = [c.to_dict() for c in self.collectives]
        if self.device_type is None:  # files without it stay readable by earlier versions
            del out["device_type"]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "hardware") -> HardwareProfile:
        kwargs = _fields(data, where, cls=cls)
        if not isinstance(kwargs["collectives"], list):
            raise ProfileError(f"{where}.collectives must be a list")
        kwargs["collectives"] = tuple(
            CollectiveFit.from_dict(c, f"{where}.collectives[{i}]") for i, c in enumerate(kwargs["collectives"])
        )
        return cls(**kwargs)


# Which measured kind stands in for one that was not measured: all-gather and reduce-scatter move
# half an all-reduce's volume at the same bus bandwidth; all-to-all and p2p at worst behave like it.
_KIND_FALLBACK = {
    "all_gather": ("all_reduce",),
    "reduce_scatter": ("all_reduce",),
    "all_to_all": ("all_reduce",),
    "p2p": ("all_reduce",),
    "all_reduce": (),
}


def lookup_collective(entries: Iterable[CollectiveFit], kind: str, group_size: int, ranks_per_node: int) -> CollectiveFit:
    """Pick the measured entry for ``kind`` over a group of ``group_size`` with ``ranks_per_node`` per node.

    Order of preference: the exact entry; else an entry of the same kind on the same side of the
    node boundary (intra-node: nearest group size; inter-node: nearest ranks-per-node, then nearest
    group size, in log scale); else, for an inter-node group with no inter-node measurement, the
    nearest intra-node entry (optimistic: a one-node profile cannot know the network); else the
    fallback kind of :data:`_KIND_FALLBACK` (p2p is then an all-reduce of a pair of ranks).
    """
    entries = tuple(entries)
    for candidate_kind in (kind, *_KIND_FALLBACK[kind]):
        same = [e for e in entries if e.kind == candidate_kind]
        if not same:
            continue
        g, k = group_size, ranks_per_node
        if candidate_kind != kind and kind == "p2p":
            g, k = 2, min(ranks_per_node, 2)
        intra = k >= (2 if candidate_kind == "p2p" else g)
        for e in same:
            if e.group_size == g and e.ranks_per_node == k:
                return e
        side = [e for e in same if e.intra_node == intra] or same

        def distance(e: CollectiveFit) -> tuple[float, float]:
            dg = abs(math.log(e.group_size) - math.log(g))
            dk = abs(math.log(e.ranks_per_node) - math.log(k))
            return (dg, dk) if intra else (dk, dg)

        return min(side, key=distance)
    if not entries:
        raise ProfileError(
            f"the hardware profile measured no collectives (it was made on one device), so it cannot price {kind} over "
            f"{group_size} devices; profile the hardware on the cluster the plan is for"
        )
    raise ProfileError(f"the hardware profile has no {kind} or all_reduce measurement")


# ---------------------------------------------------------------------------------------------- profile
@dataclass(frozen=True)
class Profile:
    """A model on a kind of hardware: the search's whole input besides world size and budget."""

    model: ModelProfile
    hardware: HardwareProfile
    source: str = ""
    fingerprint: Mapping[str, Any] | None = None  # what it was measured on (profiler.cache.fingerprint); optional

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "source": self.source,
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
        }
        if self.fingerprint is not None:
            out["fingerprint"] = dict(self.fingerprint)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, Mapping):
            raise ProfileError("a profile must be a JSON object")
        if data.get("format") != PROFILE_FORMAT:
            hint = ""
            if any(str(k).startswith(("layertype_", "layernum", "allreduce_size_")) for k in data):
                hint = " (this looks like a Hetu-Galvatron profile file: convert the directory with `lightning-galvatron import-galvatron`)"
            raise ProfileError(f"not a lightning_galvatron profile: format={data.get('format')!r}{hint}")
        version = data.get("version")
        if not isinstance(version, int) or version < 1:
            raise ProfileError(f"profile version must be a positive integer, got {version!r}")
        if version > PROFILE_VERSION:
            raise ProfileError(
                f"profile format version {version} is newer than this lightning_galvatron understands ({PROFILE_VERSION}); upgrade the package"
            )
        unknown = set(data) - {"format", "version", "source", "model", "hardware", "fingerprint"}
        if unknown:
            raise ProfileError(
                f"unknown profile keys {sorted(unknown)}; known: format, version, source, model, hardware, fingerprint"
            )
        for key in ("model", "hardware"):
            if key not in data:
                raise ProfileError(f"the profile lacks its {key!r} section")
        fingerprint = data.get("fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, Mapping):
            raise ProfileError(f"the profile's fingerprint must be a JSON object, got {type(fingerprint).__name__}")
        return cls(
            model=ModelProfile.from_dict(data["model"]),
            hardware=HardwareProfile.from_dict(data["hardware"]),
            source=str(data.get("source", "")),
            fingerprint=None if fingerprint is None else dict(fingerprint),
        )

    @property
    def measured_precision(self) -> str | None:
        """The precision the blocks were measured in (recorded in the model part, else in the fingerprint)."""
        return self.model.precision or (self.fingerprint or {}).get("precision")

    @property
    def device_type(self) -> str | None:
        """The kind of device measured (``cuda``, ``cpu``): recorded in the hardware part, else in the fingerprint."""
        if self.hardware.device_type:
            return self.hardware.device_type
        device = (self.fingerprint or {}).get("device")  # torch's device type, or the name of a CUDA device
        if not device:
            return None
        return device if device in ("cpu", "mps", "xpu", "meta") else "cuda"

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise ProfileError(f"profile is not valid JSON: {err}") from None

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        data = read_json_object(path, "profile file", ProfileError)
        try:
            return cls.from_dict(data)
        except ProfileError as err:
            raise ProfileError(f"profile file {str(path)!r}: {err}") from None

    def with_num_blocks(self, num_blocks: int) -> Profile:
        return dataclasses.replace(self, model=self.model.with_num_blocks(num_blocks))


def load_profile(source: Profile | Mapping[str, Any] | str | os.PathLike) -> Profile:
    """Accept a :class:`Profile`, its dict, or a path to its JSON file."""
    if isinstance(source, Profile):
        return source
    if isinstance(source, Mapping):
        return Profile.from_dict(source)
    if isinstance(source, (str, os.PathLike)):
        return Profile.load(source)
    raise ProfileError(f"expected a Profile, a dict or a path, got {type(source).__name__}")


# ---------------------------------------------------------------------------------------------- helpers
def _fields(data: Any, where: str, cls: type | None = None, required: Sequence[str] = ()) -> dict[str, Any]:
    """Check a JSON object against a dataclass's fields: unknown keys and missing required keys are errors."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where} must be a JSON object, got {type(data).__name__}")
    if cls is not None:
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        required = tuple(
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
    else:
        known = set(required)
    unknown = set(data) - known
    if unknown:
        raise ProfileError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ProfileError(f"{where}: missing {missing}")
    return dict(data)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProfileError(f"{name} must be a positive integer, got {value!r}")


def _finite_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"{name} must be a finite number >= 0, got {value!r}")


__all__ = [
    "COLLECTIVE_KINDS",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "CollectiveFit",
    "DegreeTable",
    "HardwareProfile",
    "LayerTypeProfile",
    "LinearFit",
    "ModelProfile",
    "Profile",
    "ProfileError",
    "VocabProfile",
    "bus_volume",
    "load_profile",
    "lookup_collective",
]
