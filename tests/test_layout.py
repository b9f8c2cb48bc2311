"""The plan's geometry (torch-free): groups, coordinates, chunks, nodes -- checked against brute force."""

from __future__ import annotations

import itertools

import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.plan.layout import (
    ActivationForm,
    ActivationLayout,
    Layout,
    activation_form,
    p2p_ranks_per_node,
    rank_chunks,
    ranks_per_node,
    stage_neighbours_share_node,
)


def _layouts(max_world: int = 12):
    for world in range(1, max_world + 1):
        for pp in (p for p in range(1, world + 1) if world % p == 0):
            n = world // pp
            for tp in (t for t in range(1, n + 1) if n % t == 0):
                for consecutive in (True, False):
                    yield Layout(world, pp, tp, consecutive)


def test_groups_partition_the_world_and_meet_once():
    for layout in _layouts():
        tp_groups = [tuple(layout.tp_group(r)) for r in range(layout.world_size)]
        dp_groups = [tuple(layout.dp_group(r)) for r in range(layout.world_size)]
        assert sorted(set(tp_groups)) == sorted(tuple(g) for g in layout.tp_groups())
        for rank in range(layout.world_size):
            assert rank in tp_groups[rank] and rank in dp_groups[rank]
            assert set(tp_groups[rank]) & set(dp_groups[rank]) == {rank}  # a grid: one rank per (dp, tp)
            stage = layout.stage_ranks(rank // layout.stage_size)
            assert set(tp_groups[rank]) | set(dp_groups[rank]) <= set(stage)
        assert sorted(itertools.chain(*layout.tp_groups())) == list(range(layout.world_size))


def test_strides_and_coordinates():
    for layout in _layouts():
        for rank in range(layout.world_size):
            stage, dp_rank, tp_rank = layout.coordinates(rank)
            assert layout.rank(stage, dp_rank, tp_rank) == rank
            group = layout.tp_group(rank)
            assert all(b - a == layout.tp_stride for a, b in itertools.pairwise(group))
            dp_group = layout.dp_group(rank)
            assert all(b - a == layout.dp_stride for a, b in itertools.pairwise(dp_group))
    # consecutive: tp ranks adjacent; strided: dp apart
    assert Layout(8, 1, 2, True).tp_group(5) == [4, 5]
    assert Layout(8, 1, 2, False).tp_group(5) == [1, 5]
    assert Layout(8, 2, 2, False).dp_group(6) == [6, 7]


def test_layout_of_a_plan_normalises_orders_that_give_the_same_groups():
    plan = ParallelPlan(world_size=8, layers=(S(), S()), pp=2)
    assert Layout.of(plan, S(tp=4, tp_consecutive=False)) == Layout.of(plan, S(tp=4))  # the whole stage
    assert Layout.of(plan, S(tp=2, tp_consecutive=False)).consecutive is False
    assert Layout.stage(plan).dp_group(5) == [4, 5, 6, 7]


def test_group_layouts_tile_the_world_with_the_given_stride():
    for world, g, stride in [(8, 2, 1), (8, 2, 4), (8, 4, 2), (12, 3, 2), (6, 2, 3)]:
        groups = Layout.of_group(world, g, stride).tp_groups()
        assert len(groups) == world // g
        assert all(len(gr) == g and all(b - a == stride for a, b in itertools.pairwise(gr)) for gr in groups)
    with pytest.raises(ValueError, match="do not tile"):
        Layout.of_group(8, 3, 1)


def test_rank_chunks_cover_every_chunk_once():
    for pp, v in itertools.product(range(1, 6), range(1, 4)):
        held = [c for stage in range(pp) for c in rank_chunks(stage, pp, v)]
        assert sorted(held) == list(range(pp * v))
        assert all(c % pp == stage for stage in range(pp) for c in rank_chunks(stage, pp, v))


def test_ranks_per_node():
    assert ranks_per_node(4, 1, 8, 64) == 4
    assert ranks_per_node(8, 4, 8, 64) == 2
    assert ranks_per_node(8, 8, 8, 64) == 1
    assert ranks_per_node(8, 4, 8, 8) == 8  # the whole world is one node
    # Brute force where strides and nodes align (one divides the other): the most ranks of a group on a node.
    for world, per_node in [(16, 4), (16, 8), (32, 8), (32, 4)]:
        for g in (d for d in range(2, world + 1) if world % d == 0):
            for stride in (s for s in range(1, world // g + 1) if (world // g) % s == 0):
                groups = Layout.of_group(world, g, stride).tp_groups()
                nodes = range(world // per_node)
                most = max(max(sum(r // per_node == node for r in gr) for node in nodes) for gr in groups)
                assert ranks_per_node(g, stride, per_node, world) == most


def test_stage_neighbours_share_a_node_only_when_the_world_does():
    """The closed form agrees with the pairwise definition (every rank and its next-stage peer on one node)."""
    for world in range(2, 33):
        for per_node in range(1, 34):
            for pp in (p for p in range(2, world + 1) if world % p == 0):
                stage = world // pp
                pairwise = all(r // per_node == (r + stage) // per_node for r in range(world - stage))
                assert stage_neighbours_share_node(world, pp, per_node) == pairwise
                assert p2p_ranks_per_node(world, pp, per_node) == (2 if pairwise else 1)


def test_activation_regions_tile_the_micro_batch():
    for layout in _layouts(8):
        if layout.pp != 1:
            continue
        for seq_sharded in (False, True):
            act = ActivationLayout(layout, seq_sharded)
            batch, seq = 2 * layout.dp, 2 * layout.tp
            cells = {}
            for position in range(layout.world_size):
                (b0, b1), (s0, s1) = act.region(position, batch, seq)
                for cell in itertools.product(range(b0, b1), range(s0, s1)):
                    cells[cell] = cells.get(cell, 0) + 1
            copies = layout.tp if not seq_sharded else 1
            assert cells == {cell: copies for cell in itertools.product(range(batch), range(seq))}
    with pytest.raises(ValueError, match="not divisible"):
        ActivationLayout(Layout(4, 1, 4), seq_sharded=True).region(0, 4, 6)


def test_activation_forms_of_the_search_and_the_runtime_agree():
    kinds = [(t, sp) for t in (1, 2, 4) for sp in ("none", "megatron", "ulysses") if t > 1 or sp == "none"]
    strategies = [S(tp=t, sp=sp, tp_consecutive=c) for t, sp in kinds for c in (True, False)]
    plan = ParallelPlan(world_size=8, layers=(S(), S()), pp=2)
    for a, b in itertools.product(strategies, repeat=2):
        same_form = activation_form(a, 4) == activation_form(b, 4)
        assert same_form == (ActivationLayout.of(plan, a) == ActivationLayout.of(plan, b))
    assert activation_form(S(tp=2), 4) == ActivationForm(2, True, True)
    assert activation_form(S(tp=2, sp="ulysses"), 4) == activation_form(S(tp=2, sp="megatron"), 4)
    assert activation_form(S(tp=4, tp_consecutive=False), 4).consecutive  # one group: the order is moot
