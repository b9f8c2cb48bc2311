"""The solver: the fastest plan of one global batch size, by pricing shapes, a block DP and partitions.

Notation (here, in :mod:`.dp`, :mod:`.pipeline` and :mod:`.cost`):

=============  =====================================================================================
``W``          world size: devices of the cluster
``pp``         pipeline degree; ``n = W / pp`` devices per stage
``B``          global batch size: samples per optimizer step
``m``          micro-batches per step
``v``          model chunks per pipeline rank (``virtual_stages``; > 1 only for interleaved 1F1B)
``k``          micro-batches whose activations a stage holds at its peak (``in_flight``)
``g``, ``d``   a block's model-parallel group (TP or Ulysses degree) and data-parallel degree ``n / g``
``L``          blocks of the model; ``types[i]`` the layer type of block ``i``
``J``          the most blocks one pipeline rank may hold (``max_blocks``)
``S``          candidate strategies of one layer type; ``K`` their activation layouts
``V``          candidate embedding/head strategies
``M``          memory cells of the DP (``capacity / cell + 1``); ``cell`` its bytes per cell
``T_s``        time of stage ``s`` per micro-batch (its blocks, embedding/head share, p2p)
=============  =====================================================================================

One :class:`FixedBatchSolver` per global batch size: :meth:`~FixedBatchSolver.price` prices every
pipeline shape (``pp``, schedule, ``m``, ``v``) into a :class:`Shape`, once per reserve level (the candidates a
level admits and the working memory it holds back, :data:`~.cost.RESERVE_LEVELS`), and drops those that cannot fit;
:meth:`~FixedBatchSolver.run` solves them in order of their lower bound (the block DP of :mod:`.dp` once
per ``k``, partitions of :mod:`.pipeline`, embedding/head strategies by table look-ups) and
:meth:`~FixedBatchSolver.solve_blocks` rebuilds the winner's per-block strategies by backtracking.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
from numpy.typing import ArrayLike, NDArray

from lightning_galvatron.plan import LayerStrategy, ParallelPlan, even_partition
from lightning_galvatron.plan.layout import rank_chunks
from lightning_galvatron.search.cost import (
    CostModel,
    LayerCosts,
    StageContext,
    block_costs,
    relocation_matrix,
    vocab_costs,
)
from lightning_galvatron.search.dp import LayerDP, Step, cap_cells, cell_bytes, undominated
from lightning_galvatron.search.options import SearchOptions
from lightning_galvatron.search.pipeline import (
    balanced_partition,
    in_flight_micro_batches,
    interpolate_partitions,
    p2p_transfers,
    pipeline_step_time,
    rank_blocks,
    refine_partition,
)
from lightning_galvatron.search.space import (
    Layout,
    PipelineConfig,
    StrategyArrays,
    canonical_order,
    layer_candidates,
    layout_of,
    pipeline_configs,
    pipeline_degrees,
    vocab_candidates,
)
from lightning_galvatron.search.working import (
    RESERVE_LEVELS,
    admitted_by_level,
    closing_reserve,
    reserve_level,
    reserve_tables,
)

__all__ = ["Choice", "FixedBatchSolver", "NoAssignment", "Shape"]


@dataclass
class Choice:
    """The best plan of one batch size and its predicted step."""

    throughput: float
    step_time: float
    batch: int
    plan: ParallelPlan


@dataclass
class Shape:
    """Everything priced for one pipeline shape, shared by its DP runs and partition search."""

    config: PipelineConfig
    in_flight: list[float]
    strategies: list[StrategyArrays]  # per layer type
    costs: list[LayerCosts]
    layouts: list[Layout]  # union of layouts
    layout_index: list[NDArray[np.int64]]  # per layer type, per candidate
    relocation: list[NDArray[np.float64]]  # per layer type (into that type)
    vocab: StrategyArrays
    vocab_time: NDArray[np.float64]  # (pp, V): embedding/head time share per stage
    vocab_memory: NDArray[np.float64]  # (pp, V)
    p2p: NDArray[np.float64]  # (pp,)
    replay: NDArray[np.float64]  # (L+1, J+1) the level's replay bound of a stage starting at a with j blocks
    gathered: NDArray[np.float64]  # (L+1, J+1) the level's gather bound, likewise
    lower_bound: float
    max_blocks: int
    level: str = "all"  # the reserve level (:data:`~.working.RESERVE_LEVELS`) whose candidates and reserve these are

    @property
    def working(self) -> NDArray[np.float64]:
        """(L+1, J+1) the reserve of a stage whatever its last block: what interleaved ranks hold back."""
        return self.replay + self.gathered

    def chunks_reserve(self, blocks: Sequence[int]) -> float:
        """What a rank of several chunks holds back for its ``blocks``: the bound of the costliest, wherever it sits."""
        return float(max(self.working[i, 1] for i in blocks))

    @property
    def closes_stages(self) -> bool:
        """Whether a stage's reserve depends on its last block (:func:`~.working.closing_reserve`): one chunk per
        rank; with several, a rank holds back the bound of all its chunks."""
        return self.config.virtual_stages == 1


class FixedBatchSolver:
    """The search at one global batch size ``B`` on ``W`` devices with ``budget`` bytes per device.

    ``considered`` / ``solved`` count the shapes priced and solved; ``executable`` says whether any shape
    has executable strategies at all; ``smallest_budget`` is the least budget any shape needs.
    """

    def __init__(self, cm: CostModel, world_size: int, budget: int, global_batch: int, options: SearchOptions):
        self.cm = cm
        self.model = cm.profile.model
        self.W = world_size
        self.budget = budget
        self.B = global_batch
        self.options = options
        self.overhead = cm.profile.hardware.memory_overhead_bytes
        self.capacity = budget - self.overhead
        self.types: NDArray[np.int64] = np.asarray(self.model.blocks)
        self.L = len(self.types)
        self.single_type = len(set(self.model.blocks)) == 1
        self.considered = self.solved = 0
        self.executable = False
        self.smallest_budget: float | None = None

    # ------------------------------------------------------------------ pricing
    def shape(self, config: PipelineConfig, max_blocks: int | None = None) -> Shape | None:
        cm, model, W, B = self.cm, self.model, self.W, self.B
        pp, m, v = config.pp, config.micro_batches, config.virtual_stages
        n = W // pp
        spans = n > cm.profile.hardware.devices_per_node
        per_micro = B // m
        strategies, costs = [], []
        ctx = StageContext(W, pp, B, m, 1.0, v)
        for lt in model.layer_types:
            cands = layer_candidates(lt, n, per_micro, spans, self.options)
            if not cands:
                return None
            sa = StrategyArrays.build(cands)
            strategies.append(sa)
            costs.append(block_costs(cm, lt, sa, ctx))
        vocab = vocab_candidates(model.vocab, model.seq_length, n, per_micro, self.options, pp=pp, micro_batches=m)
        if not vocab:
            return None
        layouts = sorted(
            {layout_of(s, n) for sa in strategies for s in sa.strategies},
            key=lambda x: (x.group, x.replicated, not x.consecutive),
        )
        index = {x: i for i, x in enumerate(layouts)}
        layout_index = [np.array([index[layout_of(s, n)] for s in sa.strategies]) for sa in strategies]
        relocation = [relocation_matrix(cm, layouts, ctx, lt.hidden_size, lt.seq_length) for lt in model.layer_types]
        in_flight = [in_flight_micro_batches(config.schedule, pp, m, r, v) for r in range(pp)]
        vsa = StrategyArrays.build(vocab)
        emb = vocab_costs(cm, vsa, StageContext(W, pp, B, m, in_flight[0], v), "embedding")
        head = vocab_costs(cm, vsa, StageContext(W, pp, B, m, in_flight[-1], v), "head")
        vocab_time = np.zeros((pp, len(vocab)))
        vocab_memory = np.zeros((pp, len(vocab)))
        vocab_time[0] += emb.step_share(config.span)
        vocab_memory[0] += emb.memory(in_flight[0])
        vocab_time[-1] += head.step_share(config.span)
        vocab_memory[-1] += head.memory(in_flight[-1])
        transfer = cm.p2p_time(ctx, model.hidden_size, model.seq_length)
        p2p = np.array([p2p_transfers(pp, r, v) for r in range(pp)]) * transfer + cm.pipeline_overhead(pp, v)
        max_blocks_override = max_blocks
        if v == 1:
            max_blocks = (
                self.L if pp == 1 else min(self.L - pp + 1, math.ceil(self.options.max_stage_imbalance * self.L / pp))
            )
        else:
            max_blocks = max(len(rank_blocks(even_partition(self.L, pp * v), pp, r)[0]) for r in range(pp))
        max_blocks = max(max_blocks, max_blocks_override or 0)
        replay, gathered = reserve_tables(self.cm, self.types, ctx, "all", max_blocks)
        lower_bound = self.lower_bound(config, costs, vocab_time, p2p)
        return Shape(
            config,
            in_flight,
            strategies,
            costs,
            layouts,
            layout_index,
            relocation,
            vsa,
            vocab_time,
            vocab_memory,
            p2p,
            replay,
            gathered,
            lower_bound,
            max_blocks,
        )

    def lower_bound(
        self,
        config: PipelineConfig,
        costs: Sequence[LayerCosts],
        vocab_time: NDArray[np.float64],
        p2p: NDArray[np.float64],
    ) -> float:
        """Lower bound on the step: every block at its fastest, perfectly balanced stages (max >= mean)."""
        m = config.micro_batches
        fastest = np.array([c.step_share(config.span).min() for c in costs])
        total = fastest[self.types].sum() + vocab_time.sum(axis=0).min() + p2p.sum()
        return float(pipeline_step_time(np.full(config.pp, total / config.pp), m, config.virtual_stages))

    def at_level(self, shape: Shape, level: str) -> Shape | None:
        """``shape`` with only the block candidates of reserve ``level`` and that level's reserve; None where a layer
        type keeps no candidate."""
        if level == shape.level:
            return shape
        keeps = [admitted_by_level(sa, level) for sa in shape.strategies]
        if not all(keep.any() for keep in keeps):
            return None
        config = shape.config
        costs = [c.take(keep) for c, keep in zip(shape.costs, keeps)]
        ctx = StageContext(self.W, config.pp, self.B, config.micro_batches, 1.0, config.virtual_stages)
        replay, gathered = reserve_tables(self.cm, self.types, ctx, level, shape.max_blocks)
        return dataclasses.replace(
            shape,
            strategies=[
                StrategyArrays.build(s for s, k in zip(sa.strategies, keep) if k)
                for sa, keep in zip(shape.strategies, keeps)
            ],
            costs=costs,
            layout_index=[index[keep] for index, keep in zip(shape.layout_index, keeps)],
            replay=replay,
            gathered=gathered,
            lower_bound=self.lower_bound(config, costs, shape.vocab_time, shape.p2p),
            level=level,
        )

    def levels(self, shape: Shape) -> list[Shape]:
        """``shape`` at each reserve level, narrowest first; a level that admits no candidate more than a narrower
        one is left out (it would only hold back more memory)."""
        out, seen = [], set()
        for level in RESERVE_LEVELS:
            at = self.at_level(shape, level)
            if at is None:
                continue
            key = tuple(sa.strategies for sa in at.strategies)
            if key not in seen:
                seen.add(key)
                out.append(at)
        return out

    def steps(self, shape: Shape, k: float) -> list[Step]:
        """One DP step per layer type at ``k`` micro-batches in flight, dominated candidates removed (a candidate
        that would close a stage with less memory than the one that beats it is kept, see :meth:`closing`)."""
        out = []
        for t, c in enumerate(shape.costs):
            time = c.step_share(shape.config.span)
            memory = c.memory(k)
            closing = None
            if shape.closes_stages and RESERVE_LEVELS[shape.level][0]:
                # memory + closing_reserve = memory + gathered + replay - min(replay, freed), for any replay >= 0
                closing = memory - np.where(shape.strategies[t].recompute, 0.0, c.activation_bytes)
            layout, relocation = shape.layout_index[t], shape.relocation[t]
            keep = undominated(time, memory, layout, [relocation, *shape.relocation], also=closing)
            out.append(Step(time[keep], memory[keep], layout[keep], relocation, np.nonzero(keep)[0]))
        return out

    def closing(
        self, shape: Shape, layer_type: int, start: int, blocks: int, candidates: ArrayLike | None = None
    ) -> NDArray[np.float64]:
        """The reserve of a stage ``[start, start+blocks)`` of a shape whose stages close with their last block's
        (:attr:`Shape.closes_stages`: one chunk per rank), per ``candidates`` of that block (indices into
        ``layer_type``'s strategies; all when None)."""
        sa, costs = shape.strategies[layer_type], shape.costs[layer_type]
        chosen = slice(None) if candidates is None else np.asarray(candidates)
        return closing_reserve(
            float(shape.replay[start, blocks]),
            float(shape.gathered[start, blocks]),
            sa.recompute[chosen],
            costs.activation_bytes[chosen],
        )

    def min_stage_memory(self, shape: Shape) -> float:
        """The least peak memory a plan of this shape needs: every block at its most frugal strategy,
        the min-max memory partition, for each embedding/head strategy that is not dominated."""
        mins = np.array([[c.memory(k).min() for c in shape.costs] for k in shape.in_flight])  # (pp, types)
        weights = mins[:, self.types]
        pp, v = shape.config.pp, shape.config.virtual_stages
        reserve = shape.working[:, 1:].max()
        ends = shape.vocab_memory[[0, -1]]
        frugal = undominated(ends[0], ends[1], np.zeros(ends.shape[1], dtype=np.int64))
        best = math.inf
        for vi in np.nonzero(frugal)[0]:
            consts = shape.vocab_memory[:, vi] + self.overhead
            if v > 1:
                sizes = even_partition(self.L, pp * v)
                starts = np.concatenate([[0], np.cumsum(sizes)])
                need = max(
                    consts[r]
                    + reserve
                    + sum(weights[r, starts[c] : starts[c + 1]].sum() for c in rank_chunks(r, pp, v))
                    for r in range(pp)
                )
            else:
                parts = balanced_partition(pp, weights, consts + reserve, shape.max_blocks)
                if parts is None:
                    continue
                starts = np.concatenate([[0], np.cumsum(parts)])
                need = max(
                    consts[r]
                    + weights[r, starts[r] : starts[r + 1]].sum()
                    + self.frugal_closing(shape, r, int(starts[r]), int(parts[r]))
                    for r in range(pp)
                )
            best = min(best, need)
        return best

    def frugal_closing(self, shape: Shape, rank: int, start: int, blocks: int) -> float:
        """What a stage ``[start, start+blocks)`` of pipeline rank ``rank`` needs beyond its blocks' least memory for
        its reserve, its last block chosen to need the least of both."""
        t = int(self.types[start + blocks - 1])
        memory = shape.costs[t].memory(shape.in_flight[rank])
        closing = self.closing(shape, t, start, blocks)
        return float((memory + closing).min() - memory.min())

    # ------------------------------------------------------------------ search
    def price(self) -> list[Shape]:
        """Price every executable pipeline shape; note the least budget any of them needs; return those that may fit."""
        shapes = []
        for pp in pipeline_degrees(self.W, self.L, self.options, self.model.block_lists):
            for config in pipeline_configs(pp, self.B, self.L, self.options):
                self.considered += 1
                full = self.shape(config)
                if full is None:
                    continue
                self.executable = True
                for shape in self.levels(full):
                    need = self.min_stage_memory(shape)
                    if math.isfinite(need):
                        eps = self.options.memory_tolerance
                        # With cells of eps * capacity / J the DP needs at most eps * capacity more than the minimum.
                        fits_from = (need - eps * self.overhead) / (1 - eps)
                        self.smallest_budget = (
                            fits_from if self.smallest_budget is None else min(self.smallest_budget, fits_from)
                        )
                    if need <= self.budget:
                        shapes.append(shape)
        return shapes

    def run(self, best_throughput: float | None) -> Choice | None:
        """The fastest plan at this batch size, or None; shapes that cannot beat ``best_throughput`` are skipped."""
        shapes = self.price()
        shapes.sort(key=lambda s: s.lower_bound)
        overhead = self.cm.step_overhead()  # per step, whatever the plan: compared without it, counted in throughput
        best_time = math.inf if best_throughput is None else self.B / best_throughput - overhead
        best: tuple[float, Shape, tuple[int, ...], int] | None = None
        for shape in shapes:
            if shape.lower_bound >= best_time * (1 - 1e-12):
                break
            self.solved += 1
            found = self.solve_shape(shape)
            if found is not None and found[0] < best_time:
                best_time = found[0]
                best = (found[0], shape, found[1], found[2])
        if best is None:
            return None
        step, shape, partition, vocab_index = best
        plan = self.build_plan(shape, partition, vocab_index)
        return Choice(self.B / (step + overhead), step + overhead, self.B, plan)

    def cell(self, shape: Shape) -> tuple[float, int]:
        roundings = shape.max_blocks + shape.closes_stages  # the closing reserve is rounded up too
        cell = cell_bytes(self.capacity, roundings, self.options.memory_tolerance)
        return cell, int(cap_cells(self.capacity, cell)) + 1

    def solve_shape(self, shape: Shape) -> tuple[float, tuple[int, ...], int] | None:
        if shape.config.virtual_stages > 1:
            return self.solve_interleaved(shape)
        pp, m = shape.config.pp, shape.config.micro_batches
        cell, M = self.cell(shape)
        J = shape.max_blocks
        k_values = sorted(set(shape.in_flight))
        k_of_stage = np.array([k_values.index(k) for k in shape.in_flight])
        tables: dict[tuple[int, int], NDArray[np.float64]] = {}

        def table(k_idx: int, start: int) -> NDArray[np.float64]:
            key = (k_idx, 0 if self.single_type else start)
            if key not in tables:
                steps_by_type = self.steps(shape, k_values[k_idx])
                first = 0 if self.single_type else start
                seq = self.types[first : first + J]
                steps = [steps_by_type[t] for t in seq]
                closing = [
                    self.closing(shape, int(t), first, j + 1, s.candidates) for j, (t, s) in enumerate(zip(seq, steps))
                ]
                tables[key] = LayerDP(steps, [], cell, M).tables(closing=closing)
            return tables[key]

        def objective(parts: NDArray[np.int64], vocab_index: int | None = None) -> NDArray[np.float64]:
            """Step time of each partition (rows) for each embedding/head strategy (columns), or for one (a value per
            row)."""
            parts = np.atleast_2d(parts)
            N = parts.shape[0]
            vt = shape.vocab_time if vocab_index is None else shape.vocab_time[:, [vocab_index]]
            vm = shape.vocab_memory if vocab_index is None else shape.vocab_memory[:, [vocab_index]]
            V = vt.shape[1]
            starts = np.concatenate([np.zeros((N, 1), dtype=np.int64), np.cumsum(parts, axis=1)[:, :-1]], axis=1)
            stage_time = np.empty((N, V, pp))
            for s in range(pp):
                j, a = parts[:, s], starts[:, s]
                cap = np.broadcast_to(self.capacity - vm[s][None, :], (N, V))  # the reserve is in the tables
                cells = np.minimum(cap_cells(cap, cell), M - 1)
                value = np.full((N, V), np.inf)
                for start in np.unique(a) if not self.single_type else [0]:
                    rows = np.arange(N) if self.single_type else np.nonzero(a == start)[0]
                    tab = table(int(k_of_stage[s]), int(start))
                    c = cells[rows]
                    ok = c >= 0
                    jj = np.repeat(j[rows][:, None] - 1, V, axis=1)
                    got = np.full(c.shape, np.inf)
                    got[ok] = tab[jj[ok], c[ok]]
                    value[rows] = got
                stage_time[:, :, s] = value + vt[s][None, :] + shape.p2p[s]
            step = pipeline_step_time(stage_time, m)
            return step if vocab_index is None else step[:, 0]

        candidates: list[tuple[int, ...]] = [(self.L,)] if pp == 1 else self.partition_candidates(shape, k_values)
        if not candidates:
            return None
        values = objective(np.array(candidates))  # (P, V)
        if not np.isfinite(values).any():
            return None
        best: tuple[float, tuple[int, ...], int] | None = None
        # Refine the best few (partition, embedding/head strategy) pairs block by block.
        flat = np.argsort(values, axis=None)[: 3 if pp > 1 else 1]
        for f in flat:
            p_idx, v_idx = np.unravel_index(int(f), values.shape)
            if not np.isfinite(values[p_idx, v_idx]):
                continue
            if pp > 1:
                part, _ = refine_partition(candidates[p_idx], partial(objective, vocab_index=int(v_idx)), J)
            else:
                part = candidates[p_idx]
            # The refined partition may prefer another embedding/head strategy.
            row = objective(np.array([part]))[0]
            v_best = int(np.argmin(row))
            if row[v_best] < (math.inf if best is None else best[0]):
                best = (float(row[v_best]), tuple(part), v_best)
        return best

    def partition_candidates(self, shape: Shape, k_values: list[float]) -> list[tuple[int, ...]]:
        pp = shape.config.pp
        J = shape.max_blocks
        fastest = np.array([c.step_share(shape.config.span).min() for c in shape.costs])[self.types]
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

    def solve_interleaved(self, shape: Shape) -> tuple[float, tuple[int, ...], int] | None:
        pp, m, v = shape.config.pp, shape.config.micro_batches, shape.config.virtual_stages
        cell, M = self.cell(shape)
        V = shape.vocab_time.shape[1]
        stage_time = np.empty((V, pp))
        for r in range(pp):
            blocks, resets = rank_blocks(even_partition(self.L, pp * v), pp, r)
            steps = self.steps(shape, shape.in_flight[r])
            best = LayerDP([steps[self.types[i]] for i in blocks], resets, cell, M).tables()[-1]
            working = shape.chunks_reserve(blocks)
            cells = np.minimum(cap_cells(self.capacity - working - shape.vocab_memory[r], cell), M - 1)
            value = np.where(cells >= 0, best[np.maximum(cells, 0)], np.inf)
            stage_time[:, r] = value + shape.vocab_time[r] + shape.p2p[r]
        values = pipeline_step_time(stage_time, m, v)
        v_best = int(np.argmin(values))
        if not np.isfinite(values[v_best]):
            return None
        return float(values[v_best]), even_partition(self.L, pp * v), v_best

    # ------------------------------------------------------------------ plan
    def build_plan(self, shape: Shape, partition: tuple[int, ...], vocab_index: int) -> ParallelPlan:
        layers = self.solve_blocks(shape, partition, vocab_index)
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

    def solve_blocks(self, shape: Shape, partition: Sequence[int], vocab_index: int) -> list[LayerStrategy]:
        """Per-block strategies for a fixed pipeline shape, partition (blocks per chunk) and embedding/head
        strategy: the DP of each rank's chunks, then backtracking. Raises :class:`NoAssignment` if a rank's
        blocks fit no assignment."""
        pp = shape.config.pp
        cell, M = self.cell(shape)
        assigned: dict[int, LayerStrategy] = {}
        for r in range(pp):
            blocks, resets = rank_blocks(partition, pp, r)
            steps = self.steps(shape, shape.in_flight[r])
            seq = [steps[self.types[i]] for i in blocks]
            closing, working = self.stage_reserve(shape, blocks, seq[-1].candidates)
            cap = min(int(cap_cells(self.capacity - working - shape.vocab_memory[r, vocab_index], cell)), M - 1)
            _, choices = LayerDP(seq, resets, cell, M).solve(cap, closing)
            if not choices:
                raise NoAssignment(f"stage {r}")
            types = [self.types[i] for i in blocks]
            chosen = [shape.strategies[t].strategies[step.candidate(c)] for t, step, c in zip(types, seq, choices)]
            ordered = canonical_order(chosen, types, resets, self.W // pp, keep_last=closing is not None)
            assigned.update(zip(blocks, ordered))
        return [assigned[i] for i in range(self.L)]  # the ranks' chunks hold every block once

    def stage_reserve(
        self, shape: Shape, blocks: Sequence[int], candidates: ArrayLike | None = None
    ) -> tuple[NDArray[np.float64] | None, float]:
        """The working-memory reserve the search holds back on a rank with these blocks at the shape's level:
        ``(per candidate of the last block, 0.0)`` with one chunk per rank (:meth:`closing`), else
        ``(None, one figure for every choice)`` (:meth:`Shape.chunks_reserve`)."""
        if not shape.closes_stages:
            return None, shape.chunks_reserve(blocks)
        return self.closing(shape, int(self.types[blocks[-1]]), blocks[0], len(blocks), candidates), 0.0

    def stage_memory(self, plan: ParallelPlan) -> list[float]:
        """Peak bytes per pipeline stage of ``plan`` as the search prices it while searching: the overhead, the
        stage's reserve (:meth:`stage_reserve`, at the narrowest reserve level of the plan's strategies), its
        embedding/head and the DP's per-block memory, from this
        solver's own :class:`Shape` (before the DP rounds each block up to whole cells). Raises ``ValueError``
        for a plan outside the search space (another batch size, world size, or a strategy it never considers).
        """
        if plan.world_size != self.W or plan.global_batch_size != self.B:
            raise ValueError(
                f"the plan is for {plan.world_size} devices and global batch {plan.global_batch_size}; "
                f"this solver searches {self.W} and {self.B}"
            )
        config = PipelineConfig(plan.pp, plan.schedule, plan.micro_batches, plan.virtual_stages)
        sizes = plan.chunk_sizes
        shape = self.shape(config, max_blocks=max(len(rank_blocks(sizes, plan.pp, r)[0]) for r in range(plan.pp)))
        if shape is None:
            raise ValueError(f"the search has no executable strategy for the pipeline shape {config}")
        shape = self.at_level(shape, reserve_level(plan.layers))  # the narrowest level the search finds it at
        if shape is None:
            raise ValueError("the plan's block strategies are not among the search's candidates")

        def index(candidates: Sequence[LayerStrategy], strategy: LayerStrategy, what: str) -> int:
            if strategy not in candidates:
                raise ValueError(f"{what} strategy {strategy.short()} is not among the search's candidates")
            return candidates.index(strategy)

        vocab = index(shape.vocab.strategies, plan.vocab, "the embedding/head")
        out = []
        for r in range(plan.pp):
            blocks, _ = rank_blocks(sizes, plan.pp, r)
            states = 0.0
            for i in blocks:
                t = int(self.types[i])
                s = index(shape.strategies[t].strategies, plan.layers[i], f"block {i}'s")
                states += float(shape.costs[t].memory(shape.in_flight[r])[s])
            closing, reserve = self.stage_reserve(shape, blocks, [s])
            reserve += 0.0 if closing is None else float(closing[0])
            out.append(self.overhead + reserve + float(shape.vocab_memory[r, vocab]) + states)
        return out


class NoAssignment(Exception):
    """A stage whose blocks fit no assignment of strategies."""
