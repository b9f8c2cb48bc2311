"""The search space: which strategies, pipeline degrees and schedules are worth looking at.

The decision tree of the Galvatron paper, as generators: pipeline degree ``pp`` (a divisor of the
world size, at most the number of blocks), then per block the size of its model-parallel group
``g`` (a divisor of the ``n = W/pp`` devices of a stage) and its kind (Megatron TP with or without
sequence parallelism, or Ulysses), the data-parallel degree ``d = n/g`` takes the rest, then how the
``d`` replicas hold their states (DDP, ZeRO-2, ZeRO-3), recomputation, and the rank layout.

Everything offered is executable by the runtime: degrees divide what the block's tensor-parallel
plan splits (Megatron; and the sequence with Megatron-SP) or heads/sequence (Ulysses), the global batch divides by ``d * micro_batches`` for every block, layer
types that have no TP or Ulysses support only get ``g = 1``, and schedules respect what
``torch.distributed.pipelining`` accepts (1F1B and interleaved need ``m >= pp``; interleaved
``m % pp == 0``). Pruned because they cannot help: ZeRO at ``d = 1`` (identical to DDP), strided
layouts where every group stays inside one node (identical costs), GPipe with ``m >= pp`` when 1F1B
is allowed (same time, never less memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_galvatron.layout import ActivationForm, activation_form
from lightning_galvatron.plan import DP_TYPES, SCHEDULES, LayerStrategy
from lightning_galvatron.profiles import LayerTypeProfile, VocabProfile

DISABLE_CHOICES = {
    "ddp": "data parallelism with replicated states",
    "zero2": "ZeRO-2 (sharded gradients and optimizer states)",
    "zero3": "ZeRO-3 (everything sharded)",
    "recompute": "activation recomputation",
    "tensor_parallel": "Megatron tensor parallelism (with or without sequence parallelism)",
    "tp_without_sp": "Megatron tensor parallelism without sequence parallelism",
    "megatron_sp": "Megatron sequence parallelism",
    "ulysses": "Ulysses sequence parallelism",
    "vocab_parallel": "vocabulary-parallel embedding and head",
    "strided": "strided tensor-parallel rank layouts",
    "pipeline": "pipeline parallelism (pp > 1)",
}


@dataclass(frozen=True)
class SearchOptions:
    """User limits and knobs of the search.

    Attributes:
        max_tp: largest model-parallel group (TP or Ulysses degree) to consider.
        max_pp: largest pipeline degree.
        disable: names from :data:`DISABLE_CHOICES` to leave out.
        schedules: pipeline schedules allowed.
        virtual_stages: model chunks per rank tried with ``interleaved_1f1b``.
        memory_tolerance: ``eps`` of the DP's guarantee: its plan is at least as fast as the best
            plan under a budget smaller by ``eps * (budget - fixed memory)``, and never over budget.
        max_stage_imbalance: a stage holds at most this many times the even share of blocks.
    """

    max_tp: int | None = None
    max_pp: int | None = None
    disable: frozenset[str] = field(default_factory=frozenset)
    schedules: tuple[str, ...] = SCHEDULES
    virtual_stages: tuple[int, ...] = (2,)
    memory_tolerance: float = 0.01
    max_stage_imbalance: float = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "disable", frozenset(self.disable))
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "virtual_stages", tuple(self.virtual_stages))
        unknown = self.disable - set(DISABLE_CHOICES)
        if unknown:
            raise ValueError(f"cannot disable {sorted(unknown)}; choose from {sorted(DISABLE_CHOICES)}")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ValueError(f"schedules must be a non-empty subset of {SCHEDULES}, got {list(self.schedules)}")
        if any(not isinstance(v, int) or v < 2 for v in self.virtual_stages):
            raise ValueError(f"virtual_stages must be integers >= 2, got {list(self.virtual_stages)}")
        for name in ("max_tp", "max_pp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not 0 < self.memory_tolerance < 1:
            raise ValueError(f"memory_tolerance must be in (0, 1), got {self.memory_tolerance!r}")
        if self.max_stage_imbalance < 1:
            raise ValueError(f"max_stage_imbalance must be >= 1, got {self.max_stage_imbalance!r}")
        if {"ddp", "zero2", "zero3"} <= self.disable:
            raise ValueError("disabling ddp, zero2 and zero3 leaves no way to hold the model states")


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline shape: degree, schedule, micro-batches, chunks per rank."""

    pp: int
    schedule: str
    micro_batches: int
    virtual_stages: int = 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_degrees(world_size: int, num_blocks: int, options: SearchOptions, block_lists: int = 1) -> list[int]:
    """Pipeline degrees: divisors of the world size, at most one stage per block and ``max_pp``.

    A model whose blocks sit in several lists (encoder and decoder) gets no pipeline: the runtime
    cuts one list only (see :attr:`~lightning_galvatron.profiles.ModelProfile.block_lists`).
    """
    if "pipeline" in options.disable or block_lists > 1:
        return [1]
    limit = min(num_blocks, options.max_pp or world_size)
    return [p for p in divisors(world_size) if p <= limit]


def pipeline_configs(pp: int, global_batch: int, num_blocks: int, options: SearchOptions) -> list[PipelineConfig]:
    """Schedules and micro-batch counts for ``pp`` stages that the runtime accepts and that can win."""
    counts = divisors(global_batch)
    if pp == 1:
        # Without a pipeline the micro-batches are gradient accumulation; the schedule is moot.
        return [PipelineConfig(1, "1f1b", m) for m in counts]
    configs = []
    for schedule in options.schedules:
        if schedule == "gpipe":
            dominated = "1f1b" in options.schedules
            configs += [PipelineConfig(pp, "gpipe", m) for m in counts if not (dominated and m >= pp)]
        elif schedule == "1f1b":
            configs += [PipelineConfig(pp, "1f1b", m) for m in counts if m >= pp]
        else:
            for v in options.virtual_stages:
                if pp * v <= num_blocks:
                    configs += [PipelineConfig(pp, schedule, m, v) for m in counts if m >= pp and m % pp == 0]
    return configs


def _dp_types(d: int, options: SearchOptions) -> list[str]:
    if d == 1:
        return ["ddp"]  # nothing to shard over: ZeRO-2/3 would be DDP
    return [t for t in DP_TYPES if t not in options.disable]


def _recompute(options: SearchOptions) -> list[bool]:
    return [False] if "recompute" in options.disable else [False, True]


def _layouts(g: int, n: int, stage_spans_nodes: bool, options: SearchOptions) -> list[bool]:
    if 1 < g < n and stage_spans_nodes and "strided" not in options.disable:
        return [True, False]
    return [True]


def megatron_degree_ok(layer: LayerTypeProfile, g: int, sequence_parallel: bool = False) -> bool:
    """Megatron TP splits what the block's plan splits (heads, key/value heads, widths: the profile's
    ``tensor_parallel_divisors``; heads, hidden and FFN for older profiles); with sequence parallelism
    the sequence too."""
    sizes = layer.tensor_parallel_divisors or (layer.num_heads, layer.hidden_size, layer.ffn_hidden_size)
    return all(size % g == 0 for size in sizes) and (not sequence_parallel or layer.seq_length % g == 0)


def ulysses_degree_ok(layer: LayerTypeProfile, g: int) -> bool:
    """Ulysses splits the sequence and then the (query) heads: the degree must divide both, and leave each rank
    at least two positions (attention code tells a causal pass from a one-token decoding step by that)."""
    heads = layer.ulysses_divisors or (layer.num_heads,)
    return all(size % g == 0 for size in heads) and layer.seq_length % g == 0 and layer.seq_length // g >= 2


def layer_candidates(
    layer: LayerTypeProfile,
    devices_per_stage: int,
    batch_per_micro_batch: int,
    stage_spans_nodes: bool,
    options: SearchOptions,
) -> list[LayerStrategy]:
    """Every executable strategy of one block type on a stage of ``devices_per_stage`` devices.

    ``batch_per_micro_batch`` (global batch / micro-batches) must divide by the data-parallel degree.
    """
    n = devices_per_stage
    out = []
    for g in divisors(n):
        if options.max_tp is not None and g > options.max_tp:
            continue
        d = n // g
        if batch_per_micro_batch % d:
            continue
        kinds = ["none"] if g == 1 else []
        if g > 1 and layer.supports_tensor_parallel and "tensor_parallel" not in options.disable and megatron_degree_ok(layer, g):
            if layer.supports_megatron_sp and "megatron_sp" not in options.disable and megatron_degree_ok(layer, g, True):
                kinds.append("megatron")
            if "tp_without_sp" not in options.disable:
                kinds.append("none")
        if g > 1 and layer.supports_ulysses and "ulysses" not in options.disable and ulysses_degree_ok(layer, g):
            kinds.append("ulysses")
        for sp in kinds:
            for dp_type in _dp_types(d, options):
                for recompute in _recompute(options):
                    for consecutive in _layouts(g, n, stage_spans_nodes, options):
                        out.append(LayerStrategy(tp=g, sp=sp, dp_type=dp_type, recompute=recompute, tp_consecutive=consecutive))
    return out


def vocab_candidates(
    vocab: VocabProfile,
    seq_length: int,
    devices_per_stage: int,
    batch_per_micro_batch: int,
    options: SearchOptions,
) -> list[LayerStrategy]:
    """Strategies for the embedding and head: data parallelism, or vocabulary parallelism of any degree
    (the runtime shards a vocabulary the degree does not divide unevenly).

    The embedding and head always run on whole sequences (``sp="none"``): the user's ``training_step``
    computes the loss from them, so the runtime cannot split their sequence. ``seq_length`` is kept for
    callers; it no longer restricts anything.
    """
    n = devices_per_stage
    out = []
    for g in divisors(n):
        if options.max_tp is not None and g > options.max_tp:
            continue
        d = n // g
        if batch_per_micro_batch % d:
            continue
        if g > 1 and not (
            vocab.supports_tensor_parallel  # any degree: uneven vocabularies are sharded unevenly
            and not {"vocab_parallel", "tensor_parallel"} & options.disable
        ):
            continue
        for dp_type in _dp_types(d, options):
            out.append(LayerStrategy(tp=g, sp="none", dp_type=dp_type))
    return out


# ---------------------------------------------------------------------------------------------- arrays
DP_CODE = {t: i for i, t in enumerate(DP_TYPES)}


#: How activations between blocks are laid out (group size, replicated or split, rank order): blocks with the
#: same layout hand activations over as they are; others need a relocation. Owned by :mod:`lightning_galvatron.layout`.
Layout = ActivationForm


def layout_of(strategy: LayerStrategy, devices_per_stage: int) -> Layout:
    return activation_form(strategy, devices_per_stage)


@dataclass(frozen=True, eq=False)
class StrategyArrays:
    """Candidate strategies as parallel numpy arrays, so cost terms are computed for all at once."""

    strategies: tuple[LayerStrategy, ...]
    tp: np.ndarray
    splits_weights: np.ndarray
    sequence_split: np.ndarray
    megatron_sp: np.ndarray
    ulysses: np.ndarray
    replicated_tp: np.ndarray
    dp_code: np.ndarray
    recompute: np.ndarray
    consecutive: np.ndarray

    @classmethod
    def build(cls, strategies: Iterable[LayerStrategy]) -> StrategyArrays:
        s = tuple(strategies)

        def arr(values: Sequence, dtype) -> np.ndarray:
            return np.asarray(values, dtype=dtype).reshape(len(s))

        return cls(
            strategies=s,
            tp=arr([x.tp for x in s], np.int64),
            splits_weights=arr([x.splits_weights for x in s], bool),
            sequence_split=arr([x.tp > 1 and x.sp != "none" for x in s], bool),
            megatron_sp=arr([x.tp > 1 and x.sp == "megatron" for x in s], bool),
            ulysses=arr([x.tp > 1 and x.sp == "ulysses" for x in s], bool),
            replicated_tp=arr([x.tp > 1 and x.sp == "none" for x in s], bool),
            dp_code=arr([DP_CODE[x.dp_type] for x in s], np.int64),
            recompute=arr([x.recompute for x in s], bool),
            consecutive=arr([x.tp_consecutive for x in s], bool),
        )

    def __len__(self) -> int:
        return len(self.strategies)
