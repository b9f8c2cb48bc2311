"""The search: the fastest hybrid plan that fits the memory budget, with baselines for comparison.

This module is the driver: :func:`search` checks the request, runs the solver once per global batch
size (:class:`~.solver.FixedBatchSolver`, whose module opens with the notation), keeps the best, says
why when nothing fits, and prices the winner and the uniform baselines with :func:`~.estimate.evaluate`.

Recipe of the solver, per global batch size:

1. For every pipeline shape (``pp``, schedule, micro-batches; :mod:`.space`) compute, with numpy
   over all candidate strategies, each block type's time and memory (:mod:`.cost`), prune
   strategies dominated in both within the same activation layout, and bound the step time from
   below (every block at its fastest, stages perfectly balanced). Shapes are visited in order of
   that bound, and a shape whose bound cannot beat the best plan so far is skipped.
2. For each number of micro-batches in flight (1F1B stages differ) run the block DP once
   (:mod:`.dp`): it gives the least time for every prefix of blocks and every memory cap, which
   serves every stage and every embedding/head strategy (they only change the cap).
3. Choose the stage partition (even, time-balanced, memory-balanced and Galvatron-BMW's middle
   ground, then refined block by block; :mod:`.pipeline`) and the embedding/head strategy by table
   look-ups; the step time formula is monotone in every stage's time, so per-stage optima compose.
4. Rebuild the winner's per-block strategies by backtracking, and price it (and the uniform
   baselines) with :func:`~.estimate.evaluate`, the same cost model.
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_galvatron.plan import LayerStrategy, ParallelPlan, divisors, even_partition
from lightning_galvatron.plan.rules import token_mean_problem, vocab_problem
from lightning_galvatron.profiles import Profile, load_profile
from lightning_galvatron.search.cost import CostModel, Precision, StageContext
from lightning_galvatron.search.estimate import Estimate, evaluate
from lightning_galvatron.search.options import SearchOptions
from lightning_galvatron.search.overheads import applicable_calibration
from lightning_galvatron.search.pipeline import pipeline_step_time, rank_blocks
from lightning_galvatron.search.profile_facts import layer_problem
from lightning_galvatron.search.solver import Choice, FixedBatchSolver, NoAssignment
from lightning_galvatron.search.space import PipelineConfig, pipeline_configs, pipeline_degrees
from lightning_galvatron.search.working import RESERVE_LEVELS, reserve_level, working_memory_bytes
from lightning_galvatron.units import format_bytes, parse_bytes

__all__ = [
    "Baseline",
    "Estimate",
    "InfeasibleBudgetError",
    "NoValidPlanError",
    "SearchOptions",
    "SearchResult",
    "evaluate",
    "search",
    "search_memory_per_stage",
]


class NoValidPlanError(ValueError):
    """No executable plan exists for this world size and batch size, whatever the memory."""


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget; ``smallest_budget_bytes`` is the least budget that does."""

    def __init__(self, message: str, smallest_budget_bytes: int, global_batch_size: int):
        super().__init__(message)
        self.smallest_budget_bytes = smallest_budget_bytes
        self.global_batch_size = global_batch_size


@dataclass(frozen=True)
class Baseline:
    """A uniform plan (every block the same strategy) for comparison; ``estimate`` is None if none is executable."""

    name: str
    description: str
    estimate: Estimate | None

    @property
    def fits(self) -> bool:
        return self.estimate is not None and bool(self.estimate.fits)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description, "fits": self.fits}
        if self.estimate is not None:
            e = self.estimate
            out.update(
                throughput_samples_per_s=e.throughput_samples_per_s,
                step_time_s=e.step_time_s,
                peak_memory_bytes_per_device=e.peak_memory_bytes,
                plan=e.plan.to_dict(),
            )
        return out


@dataclass(frozen=True)
class SearchResult:
    """The best plan with its predicted time and memory, the uniform baselines and the search's own cost."""

    plan: ParallelPlan
    estimate: Estimate
    baselines: tuple[Baseline, ...]
    search_time_s: float
    memory_budget_bytes: int
    memory_tolerance: float
    shapes_considered: int
    shapes_solved: int
    notes: tuple[str, ...] = field(default=())

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def throughput_samples_per_s(self) -> float:
        return self.estimate.throughput_samples_per_s

    @property
    def peak_memory_bytes_per_device(self) -> float:
        return self.estimate.peak_memory_bytes

    @property
    def peak_memory_bytes_per_stage(self) -> tuple[float, ...]:
        return self.estimate.peak_memory_bytes_per_stage

    @property
    def global_batch_size(self) -> int:
        return self.estimate.global_batch_size

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate.to_dict()
        return {
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "step_time_s": self.step_time_s,
            "peak_memory_bytes_per_device": self.peak_memory_bytes_per_device,
            "peak_memory_bytes_per_stage": list(self.peak_memory_bytes_per_stage),
            "memory_budget_bytes": self.memory_budget_bytes,
            "global_batch_size": self.global_batch_size,
            "plan": self.plan.to_dict(),
            "stages": e["stages"],
            "blocks": e["blocks"],
            "baselines": [b.to_dict() for b in self.baselines],
            "search_time_s": self.search_time_s,
            "memory_tolerance": self.memory_tolerance,
            "shapes_considered": self.shapes_considered,
            "shapes_solved": self.shapes_solved,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------- API
def search(
    profile: Profile | str,
    world_size: int,
    memory_budget_bytes: int | str,
    *,
    global_batch_size: int | None = None,
    optimizer: str | float = "adamw",
    precision: str | Precision = "bf16-mixed",
    options: SearchOptions | Mapping[str, Any] | None = None,
    **knobs: Any,
) -> SearchResult:
    """Find the plan with the highest predicted throughput that fits ``memory_budget_bytes`` per device.

    ``options`` holds the knobs (:class:`~.options.SearchOptions`, or a dict of its fields); any of them may
    also be given by name (``max_tp=2``, ``disable=["zero3"]``), over ``options``. The global batch is fixed
    (``global_batch_size``, default ``world_size``: one sample per device as DDP would train) unless
    ``search_batch_size`` is set, in which case batch sizes up to ``max_global_batch_size`` (default
    ``8 * world_size``) are tried for the best throughput. ``calibration`` prices plans with the cost model
    calibrated from measured steps; without it, the profile's measured overheads do when it has them.

    Raises :class:`InfeasibleBudgetError` (naming the smallest budget that fits) or
    :class:`NoValidPlanError`; both are ``ValueError``.
    """
    started = _time.perf_counter()
    profile = load_profile(profile)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    budget = parse_bytes(memory_budget_bytes)
    options = SearchOptions.of(options, **knobs)
    cm = CostModel(profile, precision, optimizer, applicable_calibration(profile, options.calibration))
    if options.search_batch_size:
        limit = options.max_global_batch_size or 8 * world_size
        batches = batch_size_candidates(limit)
    else:
        if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
            raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
        batches = [global_batch_size or world_size]

    best: Choice | None = None
    smallest: tuple[float, int] | None = None
    considered = solved = 0
    executable = False
    for B in batches:
        searcher = FixedBatchSolver(cm, world_size, budget, B, options)
        choice = searcher.run(best_throughput=None if best is None else best.throughput)
        considered += searcher.considered
        solved += searcher.solved
        executable |= searcher.executable
        if searcher.smallest_budget is not None and (smallest is None or searcher.smallest_budget < smallest[0]):
            smallest = (searcher.smallest_budget, B)
        if choice is not None and (best is None or choice.throughput > best.throughput):
            best = choice
    if best is None:
        if not executable or smallest is None:  # only executable shapes have a smallest budget
            raise NoValidPlanError(_no_plan_message(profile, world_size, batches, options))
        need, B = smallest
        message = (
            f"no plan fits {format_bytes(budget)} per device for global batch size {B} on {world_size} devices; "
            f"the smallest budget that fits is {format_bytes(need)} ({math.ceil(need)} bytes)"
        )
        if B != 1:
            one = FixedBatchSolver(cm, world_size, budget, 1, options)
            one.price()
            if one.smallest_budget is not None:
                message += f"; at global batch size 1 it is {format_bytes(one.smallest_budget)}"
        raise InfeasibleBudgetError(message, smallest_budget_bytes=math.ceil(need), global_batch_size=B)
    estimate = evaluate(profile, best.plan, cost_model=cm, memory_budget_bytes=budget)
    if estimate.peak_memory_bytes > budget:
        raise AssertionError(f"internal error: the searched plan needs {estimate.peak_memory_bytes} > budget {budget}")
    notes = []
    if options.search_batch_size:
        notes.append(f"global batch size searched up to {batches[-1]}: chose {best.batch}")
    if profile.model.activation_dtype_bytes != cm.precision.compute_bytes:
        notes.append("activation bytes rescaled to the compute dtype; compute times are those of the profiled dtype")
    base = _baselines(cm, world_size, budget, best.batch, options) if options.baselines else ()
    return SearchResult(
        plan=estimate.plan,
        estimate=estimate,
        baselines=base,
        search_time_s=_time.perf_counter() - started,
        memory_budget_bytes=budget,
        memory_tolerance=options.memory_tolerance,
        shapes_considered=considered,
        shapes_solved=solved,
        notes=tuple(notes),
    )


def batch_size_candidates(limit: int) -> list[int]:
    """Global batch sizes tried by the batch search: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to ``limit``."""
    out = sorted({c for i in range(64) for c in (2**i, 3 * 2 ** max(i - 1, 0)) if c <= limit})
    return out or [1]


def solve_configuration(
    profile: Profile | str,
    world_size: int,
    memory_budget_bytes: int | str,
    global_batch_size: int,
    config: PipelineConfig,
    partition: Sequence[int],
    vocab: LayerStrategy,
    *,
    options: SearchOptions | None = None,
    optimizer: str | float = "adamw",
    precision: str | Precision = "bf16-mixed",
) -> Estimate | None:
    """The DP's best per-block strategies for one fixed pipeline shape, partition (blocks per chunk)
    and embedding/head strategy, priced by :func:`evaluate`; None if nothing fits. A building block
    of :func:`search`, exposed for tests and what-ifs."""
    profile = load_profile(profile)
    budget = parse_bytes(memory_budget_bytes)
    calibration = options.calibration if options is not None else None
    cm = CostModel(profile, precision, optimizer, applicable_calibration(profile, calibration))
    solver = FixedBatchSolver(cm, world_size, budget, global_batch_size, options or SearchOptions())
    pp, v = config.pp, config.virtual_stages
    full = solver.shape(config, max_blocks=max(len(rank_blocks(partition, pp, r)[0]) for r in range(pp)))
    if full is None:
        return None
    if vocab not in full.vocab.strategies:
        raise ValueError(f"{vocab} is not an executable embedding/head strategy for this configuration")
    best: Estimate | None = None
    for shape in solver.levels(full):  # each reserve level's DP, as the search solves them
        try:
            layers = solver.solve_blocks(shape, partition, shape.vocab.strategies.index(vocab))
        except NoAssignment:
            continue
        plan = ParallelPlan(
            world_size=world_size,
            layers=tuple(layers),
            vocab=vocab,
            pp=pp,
            partition=tuple(partition) if pp > 1 else None,
            schedule=config.schedule,
            micro_batches=config.micro_batches,
            virtual_stages=v,
            global_batch_size=global_batch_size,
        )
        estimate = evaluate(profile, plan, cost_model=cm, memory_budget_bytes=budget)
        if best is None or estimate.step_time_s < best.step_time_s:
            best = estimate
    return best


def search_memory_per_stage(
    profile: Profile | str,
    plan: ParallelPlan,
    *,
    global_batch_size: int | None = None,
    optimizer: str | float = "adamw",
    precision: str | Precision = "bf16-mixed",
    options: SearchOptions | None = None,
) -> tuple[float, ...]:
    """Peak bytes per pipeline stage of ``plan`` as :func:`search` prices it against the budget while searching
    (:meth:`~.solver.FixedBatchSolver.stage_memory`), which differs from :func:`evaluate`'s estimate of the same
    plan by the search's working reserve (a bound at the plan's reserve level, which with one chunk per rank depends
    on each stage's last block, :func:`~.working.closing_reserve`): what a
    measured peak should be compared with to know how much memory the search leaves unused."""
    profile = load_profile(profile)
    B = global_batch_size or plan.global_batch_size
    if B is None:
        raise ValueError("the plan does not fix its global batch size: pass global_batch_size")
    if plan.global_batch_size != B:
        plan = plan.replace(global_batch_size=B)
    cm = CostModel(profile, precision, optimizer)
    solver = FixedBatchSolver(cm, plan.world_size, 0, B, options or SearchOptions())
    return tuple(solver.stage_memory(plan))


# ---------------------------------------------------------------------------------------------- baselines
def _baselines(
    cm: CostModel, world_size: int, budget: int, global_batch: int, options: SearchOptions
) -> tuple[Baseline, ...]:
    """Pure DDP, pure ZeRO-3, pure TP (no pipeline, best micro-batch count) and the best uniform 3D plan."""
    model = cm.profile.model
    L = model.num_blocks
    W = world_size

    def best_of(plans: Iterable[ParallelPlan]) -> Estimate | None:
        fitting, rest = None, None
        for plan in plans:
            try:
                e = evaluate(cm.profile, plan, cost_model=cm, memory_budget_bytes=budget)
            except ValueError:
                continue
            if e.fits:
                if fitting is None or e.step_time_s < fitting.step_time_s:
                    fitting = e
            elif rest is None or e.peak_memory_bytes < rest.peak_memory_bytes:
                rest = e
        return fitting or rest

    def uniform(strategy: LayerStrategy, vocab: LayerStrategy, **kw: Any) -> Iterable[ParallelPlan]:
        for m in divisors(global_batch):
            if options.token_means and token_mean_problem(kw.get("pp", 1), m, vocab.tp) is not None:
                continue
            try:
                yield ParallelPlan.uniform(
                    W, L, strategy, vocab=vocab, micro_batches=m, global_batch_size=global_batch, **kw
                )
            except ValueError:
                continue

    out = [
        Baseline("ddp", "pure data parallelism (DDP), no pipeline", best_of(uniform(LayerStrategy(), LayerStrategy()))),
        Baseline(
            "zero3",
            "pure ZeRO-3 (FSDP), no pipeline",
            best_of(
                uniform(LayerStrategy(dp_type="zero3"), LayerStrategy(dp_type="zero3"))
                if W > 1
                else uniform(LayerStrategy(), LayerStrategy())
            ),
        ),
    ]
    tp_plans = []
    degrees = [g for g in divisors(W) if options.max_tp is None or g <= options.max_tp]
    for g in sorted(degrees, reverse=True):
        if all(layer_problem(LayerStrategy(tp=g), lt) is None for lt in model.layer_types):
            vg = g if vocab_problem(LayerStrategy(tp=g), model.vocab.supports_tensor_parallel) is None else 1
            # Megatron-SP only where every block type runs it.
            kinds = [
                sp
                for sp in (("megatron", "none") if g > 1 else ("none",))
                if all(layer_problem(LayerStrategy(tp=g, sp=sp), t) is None for t in model.layer_types)
            ]
            for sp in kinds:
                tp_plans += list(uniform(LayerStrategy(tp=g, sp=sp), LayerStrategy(tp=vg)))
            break
    out.append(
        Baseline(
            "tp",
            "pure tensor parallelism (largest Megatron degree), no pipeline",
            best_of(tp_plans) if tp_plans else None,
        )
    )
    out.append(
        Baseline(
            "uniform_3d",
            "best plan with one strategy for every block (any pp, tp, dp type, recompute)",
            _best_uniform(cm, W, budget, global_batch, options),
        )
    )
    return tuple(out)


def _best_uniform(cm: CostModel, W: int, budget: int, B: int, options: SearchOptions) -> Estimate | None:
    """Every shape x every single block strategy x every embedding/head strategy, even partitions, priced in numpy
    (one block type only: with several, one strategy for all is rarely what the types allow)."""
    solver = FixedBatchSolver(cm, W, budget, B, options)
    if not solver.single_type:
        return None
    L = solver.L
    best: tuple[float, ParallelPlan] | None = None
    for pp in pipeline_degrees(W, L, options, cm.profile.model.block_lists):
        for config in pipeline_configs(pp, B, L, options):
            shape = solver.shape(config)
            if shape is None:
                continue
            pp, m, v = config.pp, config.micro_batches, config.virtual_stages
            sizes = even_partition(L, pp * v)
            per_rank = np.array([len(rank_blocks(sizes, pp, r)[0]) for r in range(pp)])
            c = shape.costs[0]
            share = c.step_share(m)  # (S,)
            memory = np.stack([c.memory(k) for k in shape.in_flight])  # (pp, S)
            ends = (shape.vocab_time + shape.p2p[:, None]).T[None, :, :]
            stage_time = per_rank[None, None, :] * share[:, None, None] + ends
            # Each strategy with the reserve of its own level, as the search prices a uniform plan of it.
            ctx = StageContext(W, pp, B, m, 1.0, v)
            lt = cm.profile.model.layer_types[0]
            reserves = {level: working_memory_bytes(cm, [lt], ctx, level) for level in RESERVE_LEVELS}
            reserve = np.array([reserves[reserve_level([s])] for s in shape.strategies[0].strategies])
            fixed = shape.vocab_memory.T[None, :, :] + reserve[:, None, None] + solver.overhead
            stage_memory = per_rank[None, None, :] * memory.T[:, None, :] + fixed
            values = pipeline_step_time(stage_time, m, v)  # (S, V)
            values = np.where(stage_memory.max(axis=2) <= budget, values, np.inf)
            s, vi = np.unravel_index(int(np.argmin(values)), values.shape)
            if np.isfinite(values[s, vi]) and (best is None or values[s, vi] < best[0]):
                plan = ParallelPlan.uniform(
                    W,
                    L,
                    shape.strategies[0].strategies[s],
                    vocab=shape.vocab.strategies[vi],
                    pp=pp,
                    partition=tuple(sizes) if pp > 1 else None,
                    schedule=config.schedule,
                    micro_batches=m,
                    virtual_stages=v,
                    global_batch_size=B,
                )
                best = (float(values[s, vi]), plan)
    if best is None:
        return None
    return evaluate(cm.profile, best[1], cost_model=cm, memory_budget_bytes=budget)


def _no_plan_message(profile: Profile, world_size: int, batches: Sequence[int], options: SearchOptions) -> str:
    lt = profile.model.layer_types
    batch = f"global batch size {batches[0]}" if len(batches) == 1 else f"global batch sizes up to {batches[-1]}"
    return (
        f"no executable plan for {profile.model.num_blocks} blocks on {world_size} devices with {batch}: "
        f"every block needs its data-parallel degree times the micro-batches to divide the batch, tensor-parallel "
        f"degrees must divide heads/hidden/FFN "
        f"({', '.join(f'{t.num_heads}/{t.hidden_size}/{t.ffn_hidden_size}' for t in lt)}) "
        f"and pipeline degrees the world size (at most one stage per block"
        + (f", max_tp={options.max_tp}" if options.max_tp else "")
        + (f", max_pp={options.max_pp}" if options.max_pp else "")
        + (f", disabled: {', '.join(sorted(options.disable))}" if options.disable else "")
        + (", micro-batches = pp x vocab tp (token_means)" if options.token_means else "")
        + "); try a global batch size that is a multiple of the world size"
    )
