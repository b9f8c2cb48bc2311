"""Predict the step time and per-device memory of any plan: the search's own plans, or a what-if."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError
from lightning_galvatron.plan.layout import rank_chunks
from lightning_galvatron.plan.rules import plan_problems
from lightning_galvatron.profiles import LayerTypeProfile, Profile, load_profile
from lightning_galvatron.search.coefficients import Calibration
from lightning_galvatron.search.cost import (
    CostModel,
    Precision,
    StageContext,
    block_costs,
    relocation_time,
    vocab_costs,
)
from lightning_galvatron.search.overheads import applicable_calibration
from lightning_galvatron.search.pipeline import in_flight_micro_batches, p2p_transfers, pipeline_step_time, step_span
from lightning_galvatron.search.profile_facts import ProfileFacts
from lightning_galvatron.search.space import StrategyArrays, layout_of
from lightning_galvatron.search.working import plan_working_memory_bytes
from lightning_galvatron.units import parse_bytes


@dataclass(frozen=True)
class BlockEstimate:
    """One block's share: time per micro-batch (relocation into it included), the step's extra
    (unhidden gradient reduction), and memory per device (states + activations in flight)."""

    index: int
    stage: int
    layer_type: str
    strategy: LayerStrategy
    time_per_micro_batch_s: float
    step_extra_s: float
    state_bytes: float
    activation_bytes: float

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "stage": self.stage,
            "layer_type": self.layer_type,
            "strategy": self.strategy.to_dict(),
            "label": self.strategy.short(),
            "time_per_micro_batch_s": self.time_per_micro_batch_s,
            "step_extra_s": self.step_extra_s,
            "state_bytes": self.state_bytes,
            "activation_bytes": self.activation_bytes,
            "memory_bytes": self.memory_bytes,
        }


@dataclass(frozen=True)
class StageEstimate:
    """A pipeline rank: its time per micro-batch and its peak memory, itemised."""

    stage: int
    blocks: tuple[int, ...]
    in_flight: float
    time_per_micro_batch_s: float
    block_state_bytes: float
    block_activation_bytes: float
    vocab_bytes: float
    working_bytes: float
    overhead_bytes: float

    @property
    def peak_memory_bytes(self) -> float:
        return (
            self.block_state_bytes
            + self.block_activation_bytes
            + self.vocab_bytes
            + self.working_bytes
            + self.overhead_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "blocks": list(self.blocks),
            "in_flight_micro_batches": self.in_flight,
            "time_per_micro_batch_s": self.time_per_micro_batch_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "block_state_bytes": self.block_state_bytes,
            "block_activation_bytes": self.block_activation_bytes,
            "vocab_bytes": self.vocab_bytes,
            "working_bytes": self.working_bytes,
            "overhead_bytes": self.overhead_bytes,
        }


@dataclass(frozen=True)
class Estimate:
    """Predicted step time, throughput and per-device memory of a plan."""

    plan: ParallelPlan
    global_batch_size: int
    step_time_s: float
    stages: tuple[StageEstimate, ...]
    blocks: tuple[BlockEstimate, ...]
    precision: str
    memory_budget_bytes: int | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def throughput_samples_per_s(self) -> float:
        return self.global_batch_size / self.step_time_s

    @property
    def peak_memory_bytes_per_stage(self) -> tuple[float, ...]:
        return tuple(s.peak_memory_bytes for s in self.stages)

    @property
    def peak_memory_bytes(self) -> float:
        """The largest per-device peak over the stages: what must fit on every device."""
        return max(self.peak_memory_bytes_per_stage)

    @property
    def fits(self) -> bool | None:
        return None if self.memory_budget_bytes is None else self.peak_memory_bytes <= self.memory_budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "step_time_s": self.step_time_s,
            "peak_memory_bytes_per_device": self.peak_memory_bytes,
            "peak_memory_bytes_per_stage": list(self.peak_memory_bytes_per_stage),
            "memory_budget_bytes": self.memory_budget_bytes,
            "fits": self.fits,
            "global_batch_size": self.global_batch_size,
            "precision": self.precision,
            "plan": self.plan.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "blocks": [b.to_dict() for b in self.blocks],
            "warnings": list(self.warnings),
        }


def evaluate(
    profile: Profile | str,
    plan: ParallelPlan,
    *,
    global_batch_size: int | None = None,
    optimizer: str | float = "adamw",
    precision: str | Precision = "bf16-mixed",
    memory_budget_bytes: int | str | None = None,
    cost_model: CostModel | None = None,
    calibration: Calibration | str | None = None,
) -> Estimate:
    """Predict ``plan``'s step time and per-device peak memory with the search's cost model
    (calibrated from measured steps when ``calibration`` is given, see :mod:`.calibration`; else by the
    profile's measured overheads when it has them, see :mod:`.overheads`)."""
    profile = load_profile(profile)
    cm = cost_model or CostModel(profile, precision, optimizer, applicable_calibration(profile, calibration))
    model = profile.model
    if plan.num_layers != model.num_blocks:
        raise PlanError(
            f"the plan has {plan.num_layers} layer strategies but the profiled model has {model.num_blocks} blocks"
        )
    B = global_batch_size or plan.global_batch_size
    if B is None:
        raise PlanError("the plan does not fix its global batch size: pass global_batch_size")
    plan.check_batch_size(B)
    budget = None if memory_budget_bytes is None else parse_bytes(memory_budget_bytes)
    warnings = plan_problems(plan, ProfileFacts(model))  # what the runtime would refuse: still priced, as a what-if
    W, pp, m, v = plan.world_size, plan.pp, plan.micro_batches, plan.virtual_stages
    span = step_span(pp, m, v)
    hw = profile.hardware
    stages, blocks = [], []
    for rank in range(pp):
        k = in_flight_micro_batches(plan.schedule, pp, m, rank, v)
        ctx = StageContext(W, pp, B, m, k, v)
        time = 0.0
        states = acts = 0.0
        cache: dict[tuple[int, LayerStrategy], Any] = {}
        chunks: list[list[tuple[LayerTypeProfile, LayerStrategy, float]]] = []  # what the working memory depends on
        for chunk in rank_chunks(rank, pp, v):
            chunks.append([])
            previous = None
            for i in plan.chunk_layers(chunk):
                t = model.blocks[i]
                s = plan.layers[i]
                if (t, s) not in cache:
                    cache[(t, s)] = block_costs(cm, model.layer_types[t], StrategyArrays.build([s]), ctx)
                c = cache[(t, s)]
                lt = model.layer_types[t]
                move = 0.0
                if previous is not None:
                    move = relocation_time(
                        cm,
                        layout_of(previous, ctx.devices_per_stage),
                        layout_of(s, ctx.devices_per_stage),
                        ctx,
                        lt.hidden_size,
                        lt.seq_length,
                    )
                block_time = float(c.time[0]) + move
                extra = float(c.last_extra[0])
                time += block_time + extra / span
                blocks.append(
                    BlockEstimate(
                        i,
                        rank,
                        lt.name,
                        s,
                        block_time,
                        extra,
                        float(c.state_bytes[0]),
                        k * float(c.activation_bytes[0]),
                    )
                )
                chunks[-1].append((lt, s, float(c.activation_bytes[0])))
                states += float(c.state_bytes[0])
                acts += k * float(c.activation_bytes[0])
                previous = s
        vocab_bytes = 0.0
        vocab_arrays = StrategyArrays.build([plan.vocab])
        for part, present in (("embedding", rank == 0), ("head", rank == pp - 1)):
            if present:
                c = vocab_costs(cm, vocab_arrays, ctx, part)
                time += float(c.step_share(span)[0])
                vocab_bytes += float(c.memory(k)[0])
        time += p2p_transfers(pp, rank, v) * cm.p2p_time(
            ctx, model.hidden_size, model.seq_length
        ) + cm.pipeline_overhead(pp, v)
        layers = plan.stage_layers(rank)
        working = plan_working_memory_bytes(cm, chunks, ctx)
        stages.append(
            StageEstimate(rank, tuple(layers), k, time, states, acts, vocab_bytes, working, hw.memory_overhead_bytes)
        )
    step = float(pipeline_step_time(np.array([s.time_per_micro_batch_s for s in stages]), m, v)) + cm.step_overhead()
    blocks.sort(key=lambda b: b.index)
    return Estimate(
        plan=plan if plan.global_batch_size == B else plan.replace(global_batch_size=B),
        global_batch_size=B,
        step_time_s=step,
        stages=tuple(stages),
        blocks=tuple(blocks),
        precision=cm.precision.name,
        memory_budget_bytes=budget,
        warnings=tuple(warnings),
    )
