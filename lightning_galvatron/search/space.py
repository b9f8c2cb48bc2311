"""The search space: which strategies, pipeline degrees and schedules are worth looking at.

The decision tree of the Galvatron paper, as generators: pipeline degree ``pp`` (a divisor of the
world size, at most the number of blocks), then per block the size of its model-parallel group
``g`` (a divisor of the ``n = W/pp`` devices of a stage) and its kind (Megatron TP with or without
sequence parallelism, or Ulysses), the data-parallel degree ``d = n/g`` takes the rest, then how the
``d`` replicas hold their states (DDP, ZeRO-2, ZeRO-3), recomputation, and the rank layout.

A candidate is offered if and only if it is a valid plan (the global batch divides by
``d * micro_batches`` for every block, chunks hold at least one block) and no rule of
:mod:`lightning_galvatron.plan.rules` objects (degrees, sequence splits, styles a layer type has,
schedules ``torch.distributed.pipelining`` accepts, pipelines over one block list) -- unless the
user's options leave it out or it is pruned because it cannot help: ZeRO at ``d = 1`` (identical to
DDP), strided layouts where every group stays inside one node (identical costs), GPipe with
``m >= pp`` when 1F1B is allowed (same time, never less memory), any schedule but 1F1B without a
pipeline (the schedule is moot).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from lightning_galvatron.plan import DP_TYPES, LayerStrategy, divisors
from lightning_galvatron.plan.layout import ActivationForm, activation_form
from lightning_galvatron.plan.rules import (
    pipeline_problem,
    schedule_problem,
    token_mean_problem,
    vocab_problem,
)
from lightning_galvatron.profiles import LayerTypeProfile, VocabProfile
from lightning_galvatron.search.options import SearchOptions
from lightning_galvatron.search.pipeline import step_span
from lightning_galvatron.search.profile_facts import layer_problem


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline shape: degree, schedule, micro-batches, chunks per rank."""

    pp: int
    schedule: str
    micro_batches: int
    virtual_stages: int = 1

    @property
    def span(self) -> float:
        """The step in stage times per micro-batch (:func:`~.pipeline.step_span`)."""
        return step_span(self.pp, self.micro_batches, self.virtual_stages)


def pipeline_degrees(world_size: int, num_blocks: int, options: SearchOptions, block_lists: int = 1) -> list[int]:
    """Pipeline degrees: divisors of the world size, at most one stage per block and ``max_pp``.

    A model whose blocks sit in several lists (encoder and decoder) gets no pipeline: the runtime
    cuts one list only (see :attr:`~lightning_galvatron.profiles.ModelProfile.block_lists`).
    """
    if "pipeline" in options.disable:
        return [1]
    limit = min(num_blocks, options.max_pp or world_size)
    return [p for p in divisors(world_size) if p <= limit and pipeline_problem(p, block_lists) is None]


def pipeline_configs(pp: int, global_batch: int, num_blocks: int, options: SearchOptions) -> list[PipelineConfig]:
    """Schedules and micro-batch counts for ``pp`` stages that the runtime accepts and that can win."""
    counts = [m for m in divisors(global_batch) if options.max_micro_batches is None or m <= options.max_micro_batches]
    if pp == 1:
        # Without a pipeline the micro-batches are gradient accumulation; the schedule is moot.
        return [PipelineConfig(1, "1f1b", m) for m in counts]
    configs = []
    for schedule in options.schedules:
        if schedule == "gpipe":
            dominated = "1f1b" in options.schedules
            configs += [PipelineConfig(pp, "gpipe", m) for m in counts if not (dominated and m >= pp)]
        elif schedule == "1f1b":
            configs += [PipelineConfig(pp, "1f1b", m) for m in counts]
        else:
            for v in options.virtual_stages:
                if pp * v <= num_blocks:
                    configs += [PipelineConfig(pp, schedule, m, v) for m in counts]
    return [c for c in configs if schedule_problem(c.schedule, c.pp, c.micro_batches, c.virtual_stages) is None]


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


def _kinds(g: int, options: SearchOptions) -> list[str]:
    """Model-parallel kinds the options allow for a group of ``g`` (``none``: Megatron TP without SP)."""
    if g == 1:
        return ["none"]
    kinds = []
    if "tensor_parallel" not in options.disable:
        if "megatron_sp" not in options.disable:
            kinds.append("megatron")
        if "tp_without_sp" not in options.disable:
            kinds.append("none")
    if "ulysses" not in options.disable:
        kinds.append("ulysses")
    return kinds


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
        kinds = [sp for sp in _kinds(g, options) if layer_problem(LayerStrategy(tp=g, sp=sp), layer) is None]
        for sp in kinds:
            for dp_type in _dp_types(d, options):
                for recompute in _recompute(options):
                    for consecutive in _layouts(g, n, stage_spans_nodes, options):
                        out.append(
                            LayerStrategy(tp=g, sp=sp, dp_type=dp_type, recompute=recompute, tp_consecutive=consecutive)
                        )
    return out


def vocab_candidates(
    vocab: VocabProfile,
    seq_length: int,
    devices_per_stage: int,
    batch_per_micro_batch: int,
    options: SearchOptions,
    pp: int = 1,
    micro_batches: int | None = None,
) -> list[LayerStrategy]:
    """Strategies for the embedding and head: data parallelism, or vocabulary parallelism of any degree
    (the runtime shards a vocabulary the degree does not divide unevenly). With ``options.token_means``, only the
    degrees that give each of the shape's ``micro_batches`` one DDP rank's samples
    (:func:`~lightning_galvatron.plan.rules.token_mean_problem`).

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
        if g > 1 and {"vocab_parallel", "tensor_parallel"} & options.disable:
            continue
        if vocab_problem(LayerStrategy(tp=g), vocab.supports_tensor_parallel) is not None:
            continue
        if options.token_means and micro_batches is not None and token_mean_problem(pp, micro_batches, g) is not None:
            continue
        for dp_type in _dp_types(d, options):
            out.append(LayerStrategy(tp=g, sp="none", dp_type=dp_type))
    return out


# ---------------------------------------------------------------------------------------------- arrays
DP_CODE = {t: i for i, t in enumerate(DP_TYPES)}


#: How activations between blocks are laid out (group size, replicated or split, rank order): blocks with the
#: same layout hand activations over as they are; others need a relocation. Owned by
#: :mod:`lightning_galvatron.plan.layout`.
Layout = ActivationForm


def layout_of(strategy: LayerStrategy, devices_per_stage: int) -> Layout:
    return activation_form(strategy, devices_per_stage)


@dataclass(frozen=True, eq=False)
class StrategyArrays:
    """Candidate strategies as parallel numpy arrays, so cost terms are computed for all at once."""

    strategies: tuple[LayerStrategy, ...]
    tp: NDArray[np.int64]
    splits_weights: NDArray[np.bool_]
    sequence_split: NDArray[np.bool_]
    megatron_sp: NDArray[np.bool_]
    ulysses: NDArray[np.bool_]
    replicated_tp: NDArray[np.bool_]
    dp_code: NDArray[np.int64]
    recompute: NDArray[np.bool_]
    consecutive: NDArray[np.bool_]

    @classmethod
    def build(cls, strategies: Iterable[LayerStrategy]) -> StrategyArrays:
        s = tuple(strategies)

        def ints(values: Sequence[int]) -> NDArray[np.int64]:
            return np.asarray(values, dtype=np.int64).reshape(len(s))

        def flags(values: Sequence[bool]) -> NDArray[np.bool_]:
            return np.asarray(values, dtype=bool).reshape(len(s))

        return cls(
            strategies=s,
            tp=ints([x.tp for x in s]),
            splits_weights=flags([x.splits_weights for x in s]),
            sequence_split=flags([x.tp > 1 and x.sp != "none" for x in s]),
            megatron_sp=flags([x.tp > 1 and x.sp == "megatron" for x in s]),
            ulysses=flags([x.tp > 1 and x.sp == "ulysses" for x in s]),
            replicated_tp=flags([x.tp > 1 and x.sp == "none" for x in s]),
            dp_code=ints([DP_CODE[x.dp_type] for x in s]),
            recompute=flags([x.recompute for x in s]),
            consecutive=flags([x.tp_consecutive for x in s]),
        )

    def __len__(self) -> int:
        return len(self.strategies)


def canonical_order(
    strategies: list[LayerStrategy],
    types: Sequence[int],
    resets: Sequence[bool],
    devices_per_stage: int,
    keep_last: bool = False,
) -> list[LayerStrategy]:
    """Group equal strategies inside each run of same-type, same-layout blocks of a chunk.

    Swapping such blocks changes neither time (relocations depend only on layouts) nor memory, so
    the DP's arbitrary order among equals is replaced by a readable one: plain blocks first, then
    ZeRO-2, ZeRO-3, recomputed blocks last. With ``keep_last`` the last block of each chunk stays where it is (the
    stage's reserve depends on it, :func:`~.working.closing_reserve`) and recomputed blocks come first: a replay
    then has the most activations freed behind it, so the stage needs no more than the search priced.
    """
    out = list(strategies)
    dp_order = ("ddp", "zero2", "zero3")
    key = lambda s: (s.recompute != keep_last, dp_order.index(s.dp_type), s.sp, s.tp)  # noqa: E731
    start = 0
    for i in range(1, len(out) + 1):
        boundary = (
            i == len(out)
            or resets[i]
            or (keep_last and (i + 1 == len(out) or resets[i + 1]))
            or types[i] != types[start]
            or layout_of(out[i], devices_per_stage) != layout_of(out[start], devices_per_stage)
        )
        if boundary:
            out[start:i] = sorted(out[start:i], key=key)
            start = i
    return out
