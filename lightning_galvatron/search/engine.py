"""The search: the fastest hybrid plan that fits the memory budget, with baselines for comparison.

Recipe, per global batch size:

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_galvatron.plan import LayerStrategy, ParallelPlan, even_partition
from lightning_galvatron.profiles import Profile, load_profile
from lightning_galvatron.search.calibration import Calibration
from lightning_galvatron.search.cost import (
    CostModel,
    LayerCosts,
    Precision,
    StageContext,
    block_costs,
    relocation_matrix,
    vocab_costs,
    working_memory_bytes,
)
from lightning_galvatron.search.dp import LayerDP, Step, cap_cells, cell_bytes
from lightning_galvatron.search.estimate import Estimate, evaluate
from lightning_galvatron.search.pipeline import (
    balanced_partition,
    in_flight_micro_batches,
    interpolate_partitions,
    p2p_transfers,
    pipeline_step_time,
    refine_partition,
)
from lightning_galvatron.search.space import (
    PipelineConfig,
    SearchOptions,
    StrategyArrays,
    layer_candidates,
    layout_of,
    megatron_degree_ok,
    pipeline_configs,
    pipeline_degrees,
    vocab_candidates,
)
from lightning_galvatron.units import format_bytes, parse_bytes

__all__ = [
    "Baseline",
    "Estimate",
    "InfeasibleBudgetError",
    "NoValidPlanError",
    "SearchResult",
    "evaluate",
    "search",
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
    max_tp: int | None = None,
    max_pp: int | None = None,
    disable: Iterable[str] = (),
    schedules: Sequence[str] | None = None,
    optimizer: str | float = "adamw",
    precision: str | Precision = "bf16-mixed",
    search_batch_size: bool = False,
    max_global_batch_size: int | None = None,
    virtual_stages: Sequence[int] = (2,),
    memory_tolerance: float = 0.01,
    baselines: bool = True,
    calibration: Calibration | str | None = None,
) -> SearchResult:
    """Find the plan with the highest predicted throughput that fits ``memory_budget_bytes`` per device.

    The global batch is fixed (``global_batch_size``, default ``world_size``: one sample per device
    as DDP would train) unless ``search_batch_size`` is set, in which case batch sizes up to
    ``max_global_batch_size`` (default ``8 * world_size``) are tried for the best throughput.

    ``calibration`` (a :class:`~lightning_galvatron.search.calibration.Calibration` or its JSON file)
    prices plans with the cost model calibrated from measured steps.

    Raises :class:`InfeasibleBudgetError` (naming the smallest budget that fits) or
    :class:`NoValidPlanError`; both are ``ValueError``.
    """
    started = _time.perf_counter()
    profile = load_profile(profile)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    budget = parse_bytes(memory_budget_bytes)
    options = SearchOptions(
        max_tp=max_tp,
        max_pp=max_pp,
        disable=frozenset(disable),
        schedules=tuple(schedules) if schedules else SearchOptions().schedules,
        virtual_stages=tuple(virtual_stages),
        memory_tolerance=memory_tolerance,
    )
    cm = CostModel(profile, precision, optimizer, calibration)
    if search_batch_size:
        limit = max_global_batch_size or 8 * world_size
        batches = batch_size_candidates(limit)
    else:
        if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
            raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
        batches = [global_batch_size or world_size]

    best: _Choice | None = None
    smallest: tuple[float, int] | None = None
    considered = solved = 0
    executable = False
    for B in batches:
        searcher = _FixedBatchSearch(cm, world_size, budget, B, options)
        choice = searcher.run(best_throughput=None if best is None else best.throughput)
        considered += searcher.considered
        solved += searcher.solved
        executable |= searcher.executable
        if searcher.smallest_budget is not None and (smallest is None or searcher.smallest_budget < smallest[0]):
            smallest = (searcher.smallest_budget, B)
        if choice is not None and (best is None or choice.throughput > best.throughput):
            best = choice
    if best is None:
        if not executable:
            raise NoValidPlanError(_no_plan_message(profile, world_size, batches, options))
        need, B = smallest
        message = (
            f"no plan fits {format_bytes(budget)} per device for global batch size {B} on {world_size} devices; "
            f"the smallest budget that fits is {format_bytes(need)} ({math.ceil(need)} bytes)"
        )
        if B != 1:
            one = _FixedBatchSearch(cm, world_size, budget, 1, options)
            one.price()
            if one.smallest_budget is not None:
                message += f"; at global batch size 1 it is {format_bytes(one.smallest_budget)}"
        raise InfeasibleBudgetError(message, smallest_budget_bytes=math.ceil(need), global_batch_size=B)
    estimate = evaluate(profile, best.plan, cost_model=cm, memory_budget_bytes=budget)
    if estimate.peak_memory_bytes > budget:
        raise AssertionError(f"internal error: the searched plan needs {estimate.peak_memory_bytes} > budget {budget}")
    notes = []
    if search_batch_size:
        notes.append(f"global batch size searched up to {batches[-1]}: chose {best.batch}")
    if profile.model.activation_dtype_bytes != cm.precision.compute_bytes:
        notes.append("activation bytes rescaled to the compute dtype; compute times are those of the profiled dtype")
    base = _baselines(cm, world_size, budget, best.batch, options) if baselines else ()
    return SearchResult(
        plan=estimate.plan,
        estimate=estimate,
        baselines=base,
        search_time_s=_time.perf_counter() - started,
        memory_budget_bytes=budget,
        memory_tolerance=memory_tolerance,
        shapes_considered=considered,
        shapes_solved=solved,
        notes=tuple(notes),
    )


def batch_size_candidates(limit: int) -> list[int]:
    """Global batch sizes tried by the batch search: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to ``limit``."""
    out = sorted({c for i in range(64) for c in (2**i, 3 * 2 ** max(i - 1, 0)) if c <= limit})
    return out or [1]


# ---------------------------------------------------------------------------------------------- internals
@dataclass
class _Choice:
    throughput: float
    step_time: float
    batch: int
    plan: ParallelPlan


@dataclass
class _Shape:
    """Everything priced for one pipeline shape, shared by its DP runs and partition search."""

    config: PipelineConfig
    in_flight: list[float]
    strategies: list[StrategyArrays]  # per layer type
    costs: list[LayerCosts]
    layouts: list  # union of layouts
    layout_index: list[np.ndarray]  # per layer type, per candidate
    relocation: list[np.ndarray]  # per layer type (into that type)
    vocab: StrategyArrays
    vocab_time: np.ndarray  # (pp, V): embedding/head time share per stage
    vocab_memory: np.ndarray  # (pp, V)
    p2p: np.ndarray  # (pp,)
    working: np.ndarray  # (L+1, J+1) reserve of a stage starting at a with j blocks
    lower_bound: float
    max_blocks: int


class _FixedBatchSearch:
    def __init__(self, cm: CostModel, world_size: int, budget: int, global_batch: int, options: SearchOptions):
        self.cm = cm
        self.model = cm.profile.model
        self.W = world_size
        self.budget = budget
        self.B = global_batch
        self.options = options
        self.overhead = cm.profile.hardware.memory_overhead_bytes
        self.capacity = budget - self.overhead
        self.types = np.asarray(self.model.blocks)
        self.L = len(self.types)
        self.single_type = len(set(self.model.blocks)) == 1
        self.considered = self.solved = 0
        self.executable = False
        self.smallest_budget: float | None = None

    # ------------------------------------------------------------------ pricing
    def _shape(self, config: PipelineConfig, max_blocks: int | None = None) -> _Shape | None:
        cm, model, W, B = self.cm, self.model, self.W, self.B
        pp, m, v = config.pp, config.micro_batches, config.virtual_stages
        n = W // pp
        spans = n > cm.profile.hardware.devices_per_node
        per_micro = B // m
        strategies, costs = [], []
        ctx = StageContext(W, pp, B, m, 1.0)
        for lt in model.layer_types:
            cands = layer_candidates(lt, n, per_micro, spans, self.options)
            if not cands:
                return None
            sa = StrategyArrays.build(cands)
            strategies.append(sa)
            costs.append(block_costs(cm, lt, sa, ctx))
        vocab = vocab_candidates(model.vocab, model.seq_length, n, per_micro, self.options)
        if not vocab:
            return None
        layouts = sorted({layout_of(s, n) for sa in strategies for s in sa.strategies}, key=lambda x: (x.group, x.replicated, not x.consecutive))
        index = {x: i for i, x in enumerate(layouts)}
        layout_index = [np.array([index[layout_of(s, n)] for s in sa.strategies]) for sa in strategies]
        relocation = [relocation_matrix(cm, layouts, ctx, lt.hidden_size, lt.seq_length) for lt in model.layer_types]
        in_flight = [in_flight_micro_batches(config.schedule, pp, m, r, v) for r in range(pp)]
        vsa = StrategyArrays.build(vocab)
        emb = vocab_costs(cm, vsa, StageContext(W, pp, B, m, in_flight[0]), "embedding")
        head = vocab_costs(cm, vsa, StageContext(W, pp, B, m, in_flight[-1]), "head")
        vocab_time = np.zeros((pp, len(vocab)))
        vocab_memory = np.zeros((pp, len(vocab)))
        vocab_time[0] += emb.step_share(m)
        vocab_memory[0] += emb.memory(in_flight[0])
        vocab_time[-1] += head.step_share(m)
        vocab_memory[-1] += head.memory(in_flight[-1])
        p2p = np.array([p2p_transfers(pp, r, v) for r in range(pp)]) * cm.p2p_time(ctx, model.hidden_size, model.seq_length)
        p2p = p2p + cm.pipeline_overhead(pp)
        # Working-memory reserve of a stage [a, a+j): the largest over the block types it holds.
        per_type = np.array([working_memory_bytes(cm, [lt], ctx) for lt in model.layer_types])
        max_blocks_override = max_blocks
        if v == 1:
            max_blocks = self.L if pp == 1 else min(self.L - pp + 1, math.ceil(self.options.max_stage_imbalance * self.L / pp))
        else:
            max_blocks = max(sum(even_partition(self.L, pp * v)[c] for c in range(r, pp * v, pp)) for r in range(pp))
        max_blocks = max(max_blocks, max_blocks_override or 0)
        last = np.arange(self.L + 1)[:, None] + np.arange(max_blocks + 1)[None, :] - 1  # last block of [a, a+j)
        valid = (last >= np.arange(self.L + 1)[:, None]) & (last < self.L)
        working = np.maximum.accumulate(np.where(valid, per_type[self.types[np.clip(last, 0, self.L - 1)]], 0.0), axis=1)
        # Lower bound on the step: every block at its fastest, perfectly balanced stages (max >= mean).
        fastest = np.array([c.step_share(m).min() for c in costs])
        total = fastest[self.types].sum() + vocab_time.sum(axis=0).min() + p2p.sum()
        lower_bound = total * (1.0 / v + (m - 1.0 / v) / pp)
        return _Shape(config, in_flight, strategies, costs, layouts, layout_index, relocation, vsa, vocab_time, vocab_memory, p2p, working, lower_bound, max_blocks)

    def _steps(self, shape: _Shape, k: float) -> list[Step]:
        """One DP step per layer type at ``k`` micro-batches in flight, dominated candidates removed."""
        out = []
        for t, c in enumerate(shape.costs):
            time = c.step_share(shape.config.micro_batches)
            memory = c.memory(k)
            keep = _undominated(time, memory, shape.layout_index[t], [shape.relocation[t], *shape.relocation])
            out.append(Step(time[keep], memory[keep], shape.layout_index[t][keep], shape.relocation[t], np.nonzero(keep)[0]))
        return out

    def _min_stage_memory(self, shape: _Shape) -> float:
        """The least peak memory a plan of this shape needs: every block at its most frugal strategy,
        the min-max memory partition, for each embedding/head strategy that is not dominated."""
        mins = np.array([[c.memory(k).min() for c in shape.costs] for k in shape.in_flight])  # (pp, types)
        weights = mins[:, self.types]
        pp, v = shape.config.pp, shape.config.virtual_stages
        reserve = shape.working[:, 1:].max()
        ends = shape.vocab_memory[[0, -1]]
        frugal = _undominated(ends[0], ends[1], np.zeros(ends.shape[1], dtype=np.int64))
        best = math.inf
        for vi in np.nonzero(frugal)[0]:
            consts = shape.vocab_memory[:, vi] + self.overhead
            if v > 1:
                sizes = even_partition(self.L, pp * v)
                starts = np.concatenate([[0], np.cumsum(sizes)])
                need = max(
                    consts[r] + reserve + sum(weights[r, starts[c] : starts[c + 1]].sum() for c in range(r, pp * v, pp))
                    for r in range(pp)
                )
            else:
                parts = balanced_partition(pp, weights, consts + reserve, shape.max_blocks)
                if parts is None:
                    continue
                starts = np.concatenate([[0], np.cumsum(parts)])
                need = max(
                    consts[r] + shape.working[starts[r], parts[r]] + weights[r, starts[r] : starts[r + 1]].sum()
                    for r in range(pp)
                )
            best = min(best, need)
        return best

    # ------------------------------------------------------------------ search
    def price(self) -> list[_Shape]:
        """Price every executable pipeline shape; note the least budget any of them needs; return those that may fit."""
        shapes = []
        for pp in pipeline_degrees(self.W, self.L, self.options, self.model.block_lists):
            for config in pipeline_configs(pp, self.B, self.L, self.options):
                self.considered += 1
                shape = self._shape(config)
                if shape is None:
                    continue
                self.executable = True
                need = self._min_stage_memory(shape)
                if math.isfinite(need):
                    eps = self.options.memory_tolerance
                    # With cells of eps * capacity / J the DP needs at most eps * capacity more than the exact minimum.
                    fits_from = (need - eps * self.overhead) / (1 - eps)
                    self.smallest_budget = fits_from if self.smallest_budget is None else min(self.smallest_budget, fits_from)
                if need <= self.budget:
                    shapes.append(shape)
        return shapes

    def run(self, best_throughput: float | None) -> _Choice | None:
        """The fastest plan at this batch size, or None; shapes that cannot beat ``best_throughput`` are skipped."""
        shapes = self.price()
        shapes.sort(key=lambda s: s.lower_bound)
        overhead = self.cm.step_overhead()  # per step, whatever the plan: compared without it, counted in throughput
        best_time = math.inf if best_throughput is None else self.B / best_throughput - overhead
        best: tuple[float, _Shape, tuple[int, ...], int] | None = None
        for shape in shapes:
            if shape.lower_bound >= best_time * (1 - 1e-12):
                break
            self.solved += 1
            found = self._solve_shape(shape)
            if found is not None and found[0] < best_time:
                best_time = found[0]
                best = (found[0], shape, found[1], found[2])
        if best is None:
            return None
        step, shape, partition, vocab_index = best
        plan = self._build_plan(shape, partition, vocab_index)
        return _Choice(self.B / (step + overhead), step + overhead, self.B, plan)

    def _cell(self, shape: _Shape) -> tuple[float, int]:
        cell = cell_bytes(self.capacity, shape.max_blocks, self.options.memory_tolerance)
        return cell, int(cap_cells(self.capacity, cell)) + 1

    def _solve_shape(self, shape: _Shape) -> tuple[float, tuple[int, ...], int] | None:
        if shape.config.virtual_stages > 1:
            return self._solve_interleaved(shape)
        pp, m = shape.config.pp, shape.config.micro_batches
        cell, M = self._cell(shape)
        J = shape.max_blocks
        k_values = sorted(set(shape.in_flight))
        k_of_stage = np.array([k_values.index(k) for k in shape.in_flight])
        tables: dict[tuple[int, int], np.ndarray] = {}

        def table(k_idx: int, start: int) -> np.ndarray:
            key = (k_idx, 0 if self.single_type else start)
            if key not in tables:
                steps_by_type = self._steps(shape, k_values[k_idx])
                first = 0 if self.single_type else start
                seq = self.types[first : first + J]
                tables[key] = LayerDP([steps_by_type[t] for t in seq], [], cell, M).tables()
            return tables[key]

        def objective(parts: np.ndarray, vocab_index: int | None = None) -> np.ndarray:
            """Step time of each partition (rows) for each embedding/head strategy (columns), or one."""
            parts = np.atleast_2d(parts)
            N = parts.shape[0]
            vt = shape.vocab_time if vocab_index is None else shape.vocab_time[:, [vocab_index]]
            vm = shape.vocab_memory if vocab_index is None else shape.vocab_memory[:, [vocab_index]]
            V = vt.shape[1]
            starts = np.concatenate([np.zeros((N, 1), dtype=np.int64), np.cumsum(parts, axis=1)[:, :-1]], axis=1)
            stage_time = np.empty((N, V, pp))
            for s in range(pp):
                j, a = parts[:, s], starts[:, s]
                cap = self.capacity - shape.working[a, j][:, None] - vm[s][None, :]  # (N, V)
                cells = np.minimum(cap_cells(cap, cell), M - 1)
                value = np.full((N, V), np.inf)
                for start in (np.unique(a) if not self.single_type else [0]):
                    rows = np.arange(N) if self.single_type else np.nonzero(a == start)[0]
                    tab = table(int(k_of_stage[s]), int(start))
                    c = cells[rows]
                    ok = c >= 0
                    jj = np.repeat(j[rows][:, None] - 1, V, axis=1)
                    got = np.full(c.shape, np.inf)
                    got[ok] = tab[jj[ok], c[ok]]
                    value[rows] = got
                stage_time[:, :, s] = value + vt[s][None, :] + shape.p2p[s]
            return pipeline_step_time(stage_time, m)

        if pp == 1:
            candidates = [(self.L,)]
        else:
            candidates = self._partition_candidates(shape, k_values)
        if not candidates:
            return None
        values = objective(np.array(candidates))  # (P, V)
        if not np.isfinite(values).any():
            return None
        best = (math.inf, None, None)
        # Refine the best few (partition, embedding/head strategy) pairs block by block.
        flat = np.argsort(values, axis=None)[: 3 if pp > 1 else 1]
        for f in flat:
            p_idx, v_idx = np.unravel_index(int(f), values.shape)
            if not np.isfinite(values[p_idx, v_idx]):
                continue
            if pp > 1:
                part, _ = refine_partition(candidates[p_idx], lambda P: objective(P, int(v_idx))[:, 0], J)
            else:
                part = candidates[p_idx]
            # The refined partition may prefer another embedding/head strategy.
            row = objective(np.array([part]))[0]
            v_best = int(np.argmin(row))
            if row[v_best] < best[0]:
                best = (float(row[v_best]), tuple(part), v_best)
        return None if best[1] is None else best

    def _partition_candidates(self, shape: _Shape, k_values: list[float]) -> list[tuple[int, ...]]:
        pp, m = shape.config.pp, shape.config.micro_batches
        J = shape.max_blocks
        fastest = np.array([c.step_share(m).min() for c in shape.costs])[self.types]
        smallest = np.array([[c.memory(k).min() for c in shape.costs] for k in shape.in_flight])[:, self.types]
        time_consts = shape.vocab_time.min(axis=1) + shape.p2p
        memory_consts = shape.vocab_memory.min(axis=1) + shape.working[:, 1:].max()
        out = []
        even = even_partition(self.L, pp)
        if max(even) <= J:
            out.append(even)
        by_time = balanced_partition(pp, fastest, time_consts, J)
        by_memory = balanced_partition(pp, smallest, memory_consts, J)
        for p in (by_time, by_memory):
            if p is not None:
                out.append(p)
        if by_time is not None and by_memory is not None:
            out += interpolate_partitions(by_time, by_memory)
        return list(dict.fromkeys(tuple(int(x) for x in p) for p in out if max(p) <= J))

    def _rank_sequence(self, pp: int, v: int, rank: int) -> tuple[list[int], list[bool]]:
        sizes = even_partition(self.L, pp * v)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        blocks, resets = [], []
        for c in range(rank, pp * v, pp):
            for i in range(starts[c], starts[c + 1]):
                blocks.append(i)
                resets.append(i == starts[c])
        return blocks, resets

    def _solve_interleaved(self, shape: _Shape) -> tuple[float, tuple[int, ...], int] | None:
        pp, m, v = shape.config.pp, shape.config.micro_batches, shape.config.virtual_stages
        cell, M = self._cell(shape)
        V = shape.vocab_time.shape[1]
        stage_time = np.empty((V, pp))
        for r in range(pp):
            blocks, resets = self._rank_sequence(pp, v, r)
            steps = self._steps(shape, shape.in_flight[r])
            best = LayerDP([steps[self.types[i]] for i in blocks], resets, cell, M).tables()[-1]
            working = max(shape.working[i, 1] for i in blocks)
            cells = np.minimum(cap_cells(self.capacity - working - shape.vocab_memory[r], cell), M - 1)
            value = np.where(cells >= 0, best[np.maximum(cells, 0)], np.inf)
            stage_time[:, r] = value + shape.vocab_time[r] + shape.p2p[r]
        values = pipeline_step_time(stage_time, m, v)
        v_best = int(np.argmin(values))
        if not np.isfinite(values[v_best]):
            return None
        return float(values[v_best]), even_partition(self.L, pp * v), v_best

    # ------------------------------------------------------------------ plan
    def _build_plan(self, shape: _Shape, partition: tuple[int, ...], vocab_index: int) -> ParallelPlan:
        layers = solve_blocks(self, shape, partition, vocab_index)
        config = shape.config
        return ParallelPlan(
            world_size=self.W,
            layers=tuple(layers),
            vocab=shape.vocab.strategies[vocab_index],
            pp=config.pp,
            partition=tuple(partition) if config.pp > 1 else None,
            schedule=config.schedule,
            micro_batches=config.micro_batches,
            virtual_stages=config.virtual_stages,
            global_batch_size=self.B,
        )


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
    cm = CostModel(profile, precision, optimizer)
    searcher = _FixedBatchSearch(cm, world_size, budget, global_batch_size, options or SearchOptions())
    pp, v = config.pp, config.virtual_stages
    per_rank = [sum(partition[c] for c in range(r, pp * v, pp)) for r in range(pp)]
    shape = searcher._shape(config, max_blocks=max(per_rank))
    if shape is None:
        return None
    if vocab not in shape.vocab.strategies:
        raise ValueError(f"{vocab} is not an executable embedding/head strategy for this configuration")
    try:
        layers = solve_blocks(searcher, shape, partition, shape.vocab.strategies.index(vocab))
    except _NoAssignment:
        return None
    plan = ParallelPlan(
        world_size=world_size, layers=tuple(layers), vocab=vocab, pp=pp, partition=tuple(partition) if pp > 1 else None,
        schedule=config.schedule, micro_batches=config.micro_batches, virtual_stages=v, global_batch_size=global_batch_size,
    )
    return evaluate(profile, plan, cost_model=cm, memory_budget_bytes=budget)


class _NoAssignment(Exception):
    """A stage whose blocks fit no assignment of strategies."""


def solve_blocks(search: _FixedBatchSearch, shape: _Shape, partition: Sequence[int], vocab_index: int) -> list[LayerStrategy]:
    """Per-block strategies for a fixed pipeline shape, partition and embedding/head strategy (DP + backtracking)."""
    pp, v = shape.config.pp, shape.config.virtual_stages
    cell, M = search._cell(shape)
    layers: list[LayerStrategy | None] = [None] * search.L
    starts = np.concatenate([[0], np.cumsum(partition)])
    for r in range(pp):
        blocks, resets = [], []
        for c in range(r, pp * v, pp):
            for i in range(starts[c], starts[c + 1]):
                blocks.append(int(i))
                resets.append(i == starts[c])
        steps = search._steps(shape, shape.in_flight[r])
        working = max(shape.working[i, 1] for i in blocks)
        if v == 1:
            working = shape.working[blocks[0], len(blocks)]
        cap = int(min(cap_cells(search.capacity - working - shape.vocab_memory[r, vocab_index], cell), M - 1))
        seq = [steps[search.types[i]] for i in blocks]
        _, choices = LayerDP(seq, resets, cell, M).solve(cap)
        if not choices:
            raise _NoAssignment(f"stage {r}")
        chosen = [shape.strategies[search.types[i]].strategies[int(step.candidates[c])] for i, step, c in zip(blocks, seq, choices)]
        for i, strategy in zip(blocks, _canonical_order(chosen, [search.types[i] for i in blocks], resets, search.W // shape.config.pp)):
            layers[i] = strategy
    return layers  # type: ignore[return-value]


def _canonical_order(strategies: list[LayerStrategy], types: Sequence[int], resets: Sequence[bool], devices_per_stage: int) -> list[LayerStrategy]:
    """Group equal strategies inside each run of same-type, same-layout blocks of a chunk.

    Swapping such blocks changes neither time (relocations depend only on layouts) nor memory, so
    the DP's arbitrary order among equals is replaced by a readable one: plain blocks first, then
    ZeRO-2, ZeRO-3, recomputed blocks last.
    """
    out = list(strategies)
    key = lambda s: (s.recompute, ("ddp", "zero2", "zero3").index(s.dp_type), s.sp, s.tp)  # noqa: E731
    start = 0
    for i in range(1, len(out) + 1):
        boundary = (
            i == len(out)
            or resets[i]
            or types[i] != types[start]
            or layout_of(out[i], devices_per_stage) != layout_of(out[start], devices_per_stage)
        )
        if boundary:
            out[start:i] = sorted(out[start:i], key=key)
            start = i
    return out


def _undominated(time: np.ndarray, memory: np.ndarray, layout: np.ndarray, relocation: Sequence[np.ndarray] = ()) -> np.ndarray:
    """Candidates that no other candidate beats in both time and memory, relocations included.

    ``y`` dominates ``x`` if it needs no more memory and ``t_y + slack <= t_x``, where ``slack``
    bounds how much more relocation ``y``'s layout can cost than ``x``'s, into the block from any
    layout and out of it into any layout (``relocation``: the matrices of the block types that can
    follow). Replacing every ``x`` by ``y`` in any plan then costs no time and no memory, so the DP
    loses nothing. Ties are broken by position, so one of equals survives.
    """
    S = len(time)
    if relocation:
        into = relocation[0]
        outs = np.max(np.stack(relocation), axis=0)
        ly, lx = layout[:, None], layout[None, :]
        slack_in = np.maximum((into[:, ly] - into[:, lx]).max(axis=0), 0.0)  # (S_y, S_x)
        slack_out = np.maximum((outs[ly, :] - outs[lx, :]).max(axis=2), 0.0)
        slack = slack_in + slack_out
    else:
        slack = np.where(layout[:, None] == layout[None, :], 0.0, np.inf)
    effective = time[:, None] + slack
    no_worse = (effective <= time[None, :]) & (memory[:, None] <= memory[None, :])
    better = (effective < time[None, :]) | (memory[:, None] < memory[None, :])
    earlier = np.arange(S)[:, None] < np.arange(S)[None, :]
    np.fill_diagonal(no_worse, False)
    dominated = (no_worse & (better | earlier)).any(axis=0)
    return ~dominated


# ---------------------------------------------------------------------------------------------- baselines
def _baselines(cm: CostModel, world_size: int, budget: int, global_batch: int, options: SearchOptions) -> tuple[Baseline, ...]:
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

    def uniform(strategy: LayerStrategy, vocab: LayerStrategy, **kw) -> Iterable[ParallelPlan]:
        for m in _divisors(global_batch):
            try:
                yield ParallelPlan.uniform(W, L, strategy, vocab=vocab, micro_batches=m, global_batch_size=global_batch, **kw)
            except ValueError:
                continue

    out = [
        Baseline("ddp", "pure data parallelism (DDP), no pipeline", best_of(uniform(LayerStrategy(), LayerStrategy()))),
        Baseline(
            "zero3", "pure ZeRO-3 (FSDP), no pipeline", best_of(uniform(LayerStrategy(dp_type="zero3"), LayerStrategy(dp_type="zero3")) if W > 1 else uniform(LayerStrategy(), LayerStrategy()))
        ),
    ]
    tp_plans = []
    degrees = [g for g in _divisors(W) if options.max_tp is None or g <= options.max_tp]
    for g in sorted(degrees, reverse=True):
        if all(lt.supports_tensor_parallel and megatron_degree_ok(lt, g) for lt in model.layer_types):
            vg = g if model.vocab.supports_tensor_parallel else 1
            # Megatron-SP only where every block type has it (the runtime refuses it otherwise).
            sp_ok = all(lt.supports_megatron_sp and megatron_degree_ok(lt, g, True) for lt in model.layer_types)
            kinds = ("megatron", "none") if sp_ok else ("none",)
            for sp in kinds:
                tp_plans += list(uniform(LayerStrategy(tp=g, sp=sp if g > 1 else "none"), LayerStrategy(tp=vg)))
            break
    out.append(Baseline("tp", "pure tensor parallelism (largest Megatron degree), no pipeline", best_of(tp_plans) if tp_plans else None))
    out.append(Baseline("uniform_3d", "best plan with one strategy for every block (any pp, tp, dp type, recompute)", _best_uniform(cm, W, budget, global_batch, options)))
    return tuple(out)


def _best_uniform(cm: CostModel, W: int, budget: int, B: int, options: SearchOptions) -> Estimate | None:
    """Every shape x every single block strategy x every embedding/head strategy, even partitions, priced in numpy."""
    search = _FixedBatchSearch(cm, W, budget, B, options)
    best: tuple[float, ParallelPlan] | None = None
    for pp in pipeline_degrees(W, search.L, options, cm.profile.model.block_lists):
        for config in pipeline_configs(pp, B, search.L, options):
            shape = search._shape(config)
            if shape is None or not search.single_type:
                continue
            pp, m, v = config.pp, config.micro_batches, config.virtual_stages
            sizes = even_partition(search.L, pp * v)
            per_rank = np.array([sum(sizes[c] for c in range(r, pp * v, pp)) for r in range(pp)])
            c = shape.costs[0]
            share = c.step_share(m)  # (S,)
            memory = np.stack([c.memory(k) for k in shape.in_flight])  # (pp, S)
            stage_time = per_rank[None, None, :] * share[:, None, None] + (shape.vocab_time + shape.p2p[:, None]).T[None, :, :]
            reserve = shape.working[0, 1]
            stage_memory = per_rank[None, None, :] * memory.T[:, None, :] + shape.vocab_memory.T[None, :, :] + reserve + search.overhead
            values = pipeline_step_time(stage_time, m, v)  # (S, V)
            values = np.where(stage_memory.max(axis=2) <= budget, values, np.inf)
            s, vi = np.unravel_index(int(np.argmin(values)), values.shape)
            if np.isfinite(values[s, vi]) and (best is None or values[s, vi] < best[0]):
                plan = ParallelPlan.uniform(
                    W, search.L, shape.strategies[0].strategies[s], vocab=shape.vocab.strategies[vi], pp=pp,
                    partition=tuple(sizes) if pp > 1 else None, schedule=config.schedule, micro_batches=m,
                    virtual_stages=v, global_batch_size=B,
                )
                best = (float(values[s, vi]), plan)
    if best is None:
        return None
    return evaluate(cm.profile, best[1], cost_model=cm, memory_budget_bytes=budget)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _no_plan_message(profile: Profile, world_size: int, batches: Sequence[int], options: SearchOptions) -> str:
    lt = profile.model.layer_types
    batch = f"global batch size {batches[0]}" if len(batches) == 1 else f"global batch sizes up to {batches[-1]}"
    return (
        f"no executable plan for {profile.model.num_blocks} blocks on {world_size} devices with {batch}: "
        f"every block needs its data-parallel degree times the micro-batches to divide the batch, tensor-parallel "
        f"degrees must divide heads/hidden/FFN ({', '.join(f'{t.num_heads}/{t.hidden_size}/{t.ffn_hidden_size}' for t in lt)}) "
        f"and pipeline degrees the world size (at most one stage per block"
        + (f", max_tp={options.max_tp}" if options.max_tp else "")
        + (f", max_pp={options.max_pp}" if options.max_pp else "")
        + (f", disabled: {', '.join(sorted(options.disable))}" if options.disable else "")
        + "); try a global batch size that is a multiple of the world size"
    )
