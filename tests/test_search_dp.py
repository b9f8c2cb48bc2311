"""The DP against exhaustive enumeration: same optimum within the stated tolerance, never over budget.

The oracle enumerates every assignment of (unpruned) candidate strategies to the blocks of a fixed
pipeline shape, partition and embedding/head strategy, and prices each with the cost-model terms
directly (block costs, relocations, embedding/head, transfers, working memory, step formula). The
DP's plan is priced by :func:`evaluate`; both must agree on that plan, and with ``eps`` the memory
tolerance and ``C = budget - overhead``:

    OPT(budget) <= DP(budget) <= OPT(budget - eps * C),     peak_memory(DP plan) <= budget.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lightning_galvatron.plan import even_partition
from lightning_galvatron.search.cost import CostModel, StageContext, block_costs, relocation_matrix, vocab_costs
from lightning_galvatron.search.dp import LayerDP, Step, cap_cells, cell_bytes
from lightning_galvatron.search.engine import search, solve_configuration
from lightning_galvatron.search.pipeline import in_flight_micro_batches, p2p_transfers, pipeline_step_time, step_span
from lightning_galvatron.search.space import (
    SearchOptions,
    StrategyArrays,
    layer_candidates,
    layout_of,
    pipeline_configs,
    pipeline_degrees,
    vocab_candidates,
)
from lightning_galvatron.search.working import RESERVE_LEVELS, level_bounds
from tests.search_profiles import synthetic_profile

ENUMERATION_LIMIT = 120_000
TOLERANCE = 0.01


class Oracle:
    """Exact step time and per-rank peak memory of every assignment, for one fixed configuration."""

    def __init__(self, profile, W, B, config, partition, vocab, options):
        cm = CostModel(profile)
        model = profile.model
        self.types = model.blocks
        pp, m, v = config.pp, config.micro_batches, config.virtual_stages
        n = W // pp
        spans = n > profile.hardware.devices_per_node
        self.candidates = [layer_candidates(lt, n, B // m, spans, options) for lt in model.layer_types]
        layouts = sorted({layout_of(s, n) for c in self.candidates for s in c}, key=str)
        index = {x: i for i, x in enumerate(layouts)}
        starts = np.concatenate([[0], np.cumsum(partition)])
        self.rank_blocks, self.rank_time, self.rank_memory, self.rank_choices = [], [], [], []
        self.pp, self.m, self.v = pp, m, v
        if (
            any(not self.candidates[t] for t in set(model.blocks))
            or math.prod(len(self.candidates[t]) for t in model.blocks) > ENUMERATION_LIMIT
        ):
            self.rank_time = [np.zeros(0)]
            return
        for r in range(pp):
            k = in_flight_micro_batches(config.schedule, pp, m, r, v)
            ctx = StageContext(W, pp, B, m, k)
            blocks, resets = [], []
            for c in range(r, pp * v, pp):
                for i in range(starts[c], starts[c + 1]):
                    blocks.append(int(i))
                    resets.append(i == starts[c])
            per_type = []
            for t, lt in enumerate(model.layer_types):
                sa = StrategyArrays.build(self.candidates[t])
                costs = block_costs(cm, lt, sa, ctx)
                lay = np.array([index[layout_of(s, n)] for s in self.candidates[t]])
                per_type.append(
                    (
                        costs.step_share(step_span(pp, m, v)),
                        costs.memory(k),
                        lay,
                        relocation_matrix(cm, layouts, ctx, lt.hidden_size, lt.seq_length),
                    )
                )
            choices = np.array(list(itertools.product(*[range(len(self.candidates[model.blocks[i]])) for i in blocks])))
            time = np.zeros(len(choices))
            memory = np.zeros(len(choices))
            for pos, i in enumerate(blocks):
                tau, mem, lay, rel = per_type[model.blocks[i]]
                time += tau[choices[:, pos]]
                memory += mem[choices[:, pos]]
                if not resets[pos]:
                    prev_lay = per_type[model.blocks[blocks[pos - 1]]][2]
                    time += rel[prev_lay[choices[:, pos - 1]], lay[choices[:, pos]]]
            va = StrategyArrays.build([vocab])
            for part, present in (("embedding", r == 0), ("head", r == pp - 1)):
                if present:
                    vc = vocab_costs(cm, va, ctx, part)
                    time += vc.step_share(step_span(pp, m, v))[0]
                    memory += vc.memory(k)[0]
            time += p2p_transfers(pp, r, v) * cm.p2p_time(ctx, model.hidden_size, model.seq_length)
            memory += profile.hardware.memory_overhead_bytes
            # The search solves each reserve level apart: a level's assignments hold back its reserve, which with one
            # chunk per rank depends on what the last block stores (the replay only adds what exceeds it).
            rank_types = [model.layer_types[t] for t in sorted({model.blocks[i] for i in blocks})]
            recomputes = np.zeros(len(choices), dtype=bool)
            gathers = np.zeros(len(choices), dtype=bool)
            for pos, i in enumerate(blocks):
                cands = self.candidates[model.blocks[i]]
                recomputes |= np.array([c.recompute for c in cands])[choices[:, pos]]
                gathers |= np.array([c.dp_type == "zero3" for c in cands])[choices[:, pos]]
            last_type = model.blocks[blocks[-1]]
            last_costs = block_costs(
                cm, model.layer_types[last_type], StrategyArrays.build(self.candidates[last_type]), ctx
            )
            last_recomputes = np.array([c.recompute for c in self.candidates[last_type]])[choices[:, -1]]
            last_stores = last_costs.activation_bytes[choices[:, -1]]
            levels = {}
            for level, (recompute, gather) in RESERVE_LEVELS.items():
                admitted = (recompute | ~recomputes) & (gather | ~gathers)
                replay, gathered = level_bounds(cm, rank_types, ctx, level)
                if v == 1:
                    freed = np.where(last_recomputes, 0.0, last_stores)
                    reserve = gathered + replay - np.minimum(replay, freed)
                else:
                    reserve = replay + gathered
                levels[level] = np.where(admitted, memory + reserve, np.inf)
            self.rank_blocks.append(blocks)
            self.rank_time.append(time)
            self.rank_memory.append(levels)
            self.rank_choices.append(choices)

    def best(self, budget: float) -> float:
        """Least step time over the product of all ranks' assignments that fit ``budget`` at one reserve level."""
        best = math.inf
        for level in RESERVE_LEVELS:
            grids = np.meshgrid(
                *[np.where(mem[level] <= budget, t, np.inf) for t, mem in zip(self.rank_time, self.rank_memory)],
                indexing="ij",
            )
            stage_times = np.stack([g.ravel() for g in grids], axis=-1)
            values = pipeline_step_time(stage_times, self.m, self.v)
            best = min(best, float(values.min()) if values.size else math.inf)
        return best

    def step_time_of(self, layers) -> float:
        stage_times = []
        for r, blocks in enumerate(self.rank_blocks):
            row = [self.candidates[self.types[i]].index(layers[i]) for i in blocks]
            hit = np.nonzero((self.rank_choices[r] == np.array(row)).all(axis=1))[0]
            stage_times.append(self.rank_time[r][hit[0]])
        return float(pipeline_step_time(np.array(stage_times), self.m, self.v))

    def size(self) -> int:
        return math.prod(len(t) for t in self.rank_time)


def _random_case(rng: np.random.Generator):
    """A small random instance: world size, blocks, options, shape, partition, embedding/head strategy."""
    W = int(rng.choice([1, 2, 3, 4, 6, 8, 12], p=[0.05, 0.15, 0.1, 0.2, 0.2, 0.15, 0.15]))
    L = int(rng.choice([1, 2, 3, 4, 5, 6], p=[0.05, 0.1, 0.2, 0.25, 0.2, 0.2]))
    num_types = 2 if L >= 2 and rng.random() < 0.25 else 1
    profile = synthetic_profile(rng, L, num_types, devices_per_node=int(rng.choice([2, 4, 8])))
    pool = ["ulysses", "tp_without_sp", "zero2", "megatron_sp", "recompute", "strided", "ddp"]
    disable = frozenset(x for x in pool if rng.random() < 0.45)
    max_tp = int(rng.choice([2, 4, 12])) if rng.random() < 0.5 else None
    options = SearchOptions(disable=disable, max_tp=max_tp, memory_tolerance=TOLERANCE)
    B = W * int(rng.choice([1, 2, 4]))
    pp = int(rng.choice(pipeline_degrees(W, L, options)))
    configs = pipeline_configs(pp, B, L, options)
    if not configs:
        return None
    config = configs[int(rng.integers(len(configs)))]
    if config.virtual_stages > 1:
        partition = even_partition(L, pp * config.virtual_stages)
    else:
        cuts = sorted(rng.choice(np.arange(1, L), size=pp - 1, replace=False)) if pp > 1 else []
        partition = tuple(int(x) for x in np.diff([0, *cuts, L]))
    n = W // pp
    vocab = vocab_candidates(profile.model.vocab, profile.model.seq_length, n, B // config.micro_batches, options)
    if not vocab:
        return None
    return profile, W, B, options, config, partition, vocab[int(rng.integers(len(vocab)))]


def _cases(count: int, seed: int):
    rng = np.random.default_rng(seed)
    made = 0
    while made < count:
        case = _random_case(rng)
        if case is None:
            continue
        profile, W, B, options, config, partition, vocab = case
        oracle = Oracle(profile, W, B, config, partition, vocab, options)
        if oracle.size() == 0 or oracle.size() > ENUMERATION_LIMIT:
            continue
        lowest = min(max(float(m[level].min()) for m in oracle.rank_memory) for level in RESERVE_LEVELS)
        highest = max(float(m["all"].max()) for m in oracle.rank_memory)
        budget = int(rng.uniform(0.97 * lowest, 1.05 * highest))
        made += 1
        yield profile, W, B, options, config, partition, vocab, oracle, budget


def test_dp_matches_exhaustive_enumeration_within_tolerance():
    checked = exact = solved = 0
    world_sizes, pipelines = set(), set()
    for profile, W, B, options, config, partition, vocab, oracle, budget in _cases(300, seed=1234):
        estimate = solve_configuration(profile, W, budget, B, config, partition, vocab, options=options)
        capacity = budget - profile.hardware.memory_overhead_bytes
        optimum = oracle.best(budget)
        relaxed = oracle.best(budget - TOLERANCE * capacity)
        checked += 1
        world_sizes.add(W)
        pipelines.add((config.pp > 1, config.schedule))
        if estimate is None:
            assert relaxed == math.inf, (W, config, partition, budget, relaxed)
            continue
        solved += 1
        assert estimate.peak_memory_bytes <= budget
        assert estimate.step_time_s >= optimum * (1 - 1e-9)
        assert estimate.step_time_s <= relaxed * (1 + 1e-9)
        # The oracle's assembly of the cost terms and the evaluator agree on the DP's plan.
        assert estimate.step_time_s == pytest.approx(oracle.step_time_of(estimate.plan.layers), rel=1e-9)
        exact += math.isclose(estimate.step_time_s, optimum, rel_tol=1e-9)
    assert checked >= 300
    assert solved >= 200
    assert {1, 6, 12} <= world_sizes
    assert len(pipelines) >= 3
    assert exact >= 0.9 * solved  # the tolerance is rarely needed in practice


def test_search_without_pipeline_matches_enumeration_over_micro_batches_and_embedding():
    """pp = 1: the engine enumerates micro-batch counts and embedding/head strategies itself."""
    rng = np.random.default_rng(7)
    checked = 0
    while checked < 25:
        W = int(rng.choice([2, 4, 6]))
        L = int(rng.integers(1, 4))
        profile = synthetic_profile(rng, L)
        options = SearchOptions(disable={"ulysses", "tp_without_sp", "strided"}, max_tp=2, memory_tolerance=TOLERANCE)
        B = W * int(rng.choice([1, 2]))
        best = {}
        for config in pipeline_configs(1, B, L, options):
            vocab = vocab_candidates(
                profile.model.vocab, profile.model.seq_length, W, B // config.micro_batches, options
            )
            for v in vocab:
                best[(config, v)] = Oracle(profile, W, B, config, (L,), v, options)
        if any(o.size() > ENUMERATION_LIMIT for o in best.values()):
            continue
        lowest = min(
            max(float(m[level].min()) for m in o.rank_memory) for o in best.values() for level in RESERVE_LEVELS
        )
        budget = int(lowest * rng.uniform(1.0, 1.6))
        capacity = budget - profile.hardware.memory_overhead_bytes
        optimum = min(o.best(budget) for o in best.values())
        relaxed = min(o.best(budget - TOLERANCE * capacity) for o in best.values())
        try:
            result = search(
                profile, W, budget, global_batch_size=B, max_pp=1, max_tp=2, disable=options.disable, baselines=False
            )
        except ValueError:
            assert relaxed == math.inf
            continue
        assert result.peak_memory_bytes_per_device <= budget
        assert optimum * (1 - 1e-9) <= result.step_time_s <= relaxed * (1 + 1e-9)
        checked += 1


def _random_step(rng: np.random.Generator, strategies: int, layouts: int) -> Step:
    """A block of 1 to ``strategies - 1`` candidates with random time and memory (up to 10 bytes), spread over
    1 to ``layouts - 1`` layouts; staying in a layout costs nothing to relocate."""
    S, K = int(rng.integers(1, strategies)), int(rng.integers(1, layouts))
    relocation = rng.random((K, K))
    np.fill_diagonal(relocation, 0.0)
    return Step(rng.random(S), rng.random(S) * 10, rng.integers(0, K, S), relocation)


def test_prefix_tables_answer_every_length_and_cap():
    """One DP run serves every stage length and memory cap (what lets stages and embeddings share it)."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        step, L = _random_step(rng, 6, 4), int(rng.integers(1, 6))
        cell = cell_bytes(10.0 * L, L, 0.05)
        M = int(cap_cells(10.0 * L, cell)) + 1
        tables = LayerDP([step] * L, [], cell, M).tables()
        for j in range(1, L + 1):
            for cap in rng.integers(0, M, size=4):
                expected, _ = LayerDP([step] * j, [], cell, M).solve(int(cap))
                if math.isfinite(expected):
                    assert tables[j - 1, cap] == pytest.approx(expected)
                else:
                    assert tables[j - 1, cap] == math.inf


def test_a_prefix_pays_its_closing_memory_where_it_ends():
    """The closing memory (the search's working reserve, charged on a stage's last block) counts for the prefix that
    ends at a block, not for the blocks after it: the prefix tables and a backtracked solve agree with enumeration."""
    from lightning_galvatron.search.dp import cells_for

    rng = np.random.default_rng(5)
    for _ in range(40):
        step, L = _random_step(rng, 4, 3), int(rng.integers(1, 5))
        time, memory, layout, relocation, S = step.time, step.memory, step.layout, step.relocation, len(step.time)
        closing = [rng.random(S) * 8 * (j % 2) for j in range(L)]  # no closing memory on every other prefix
        cell = cell_bytes(10.0 * L, L + 1, 0.05)
        M = int(cap_cells(10.0 * L, cell)) + 1
        tables = LayerDP([step] * L, [], cell, M).tables(closing=closing)
        cells, extra = cells_for(memory, cell), [cells_for(c, cell) for c in closing]
        for j in range(1, L + 1):
            choices = np.array(list(itertools.product(range(S), repeat=j)))
            total = time[choices].sum(axis=1) + sum(
                relocation[layout[choices[:, i - 1]], layout[choices[:, i]]] for i in range(1, j)
            )
            used = cells[choices].sum(axis=1) + extra[j - 1][choices[:, -1]]
            for cap in rng.integers(0, M, size=4):
                fits = used <= cap
                expected = float(total[fits].min()) if fits.any() else math.inf
                assert tables[j - 1, cap] == pytest.approx(expected)
                value, chosen = LayerDP([step] * j, [], cell, M).solve(int(cap), closing[j - 1])
                assert value == pytest.approx(expected)
                if chosen:
                    row = np.array(chosen)
                    assert cells[row].sum() + extra[j - 1][row[-1]] <= cap
                    assert float(time[row].sum()) + sum(
                        relocation[layout[row[i - 1]], layout[row[i]]] for i in range(1, j)
                    ) == pytest.approx(expected)


def test_dp_backtracking_reproduces_its_value_with_chunk_resets():
    rng = np.random.default_rng(11)
    for _ in range(50):
        step, L = _random_step(rng, 5, 4), int(rng.integers(2, 6))
        time, memory, layout, relocation = step.time, step.memory, step.layout, step.relocation
        resets = [False] * L
        resets[int(rng.integers(1, L))] = True
        cap_bytes = float(rng.uniform(0.3, 1.0) * 10 * L)
        cell = cell_bytes(cap_bytes, L, 0.02)
        M = int(cap_cells(cap_bytes, cell)) + 1
        value, choices = LayerDP([step] * L, resets, cell, M).solve(M - 1)
        if not choices:
            continue
        recomputed = sum(time[c] for c in choices) + sum(
            relocation[layout[choices[i - 1]], layout[choices[i]]] for i in range(1, L) if not resets[i]
        )
        assert value == pytest.approx(recomputed)
        assert sum(memory[c] for c in choices) <= cap_bytes
