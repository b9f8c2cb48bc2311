"""Rank layouts: which ranks form a block's tensor- and data-parallel groups."""

from __future__ import annotations

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.plan.layout import Layout
from lightning_galvatron.runtime.apply import input_shard


def test_consecutive_and_strided_grids():
    consecutive = Layout(world_size=8, pp=2, tp=2, consecutive=True).rank_grid()
    assert consecutive == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # [pp][dp][tp]
    strided = Layout(world_size=8, pp=2, tp=2, consecutive=False).rank_grid()
    assert strided == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]


def test_coordinates_agree_with_the_grid():
    for layout in [Layout(8, 1, 4, True), Layout(8, 1, 4, False), Layout(12, 2, 3, False), Layout(6, 3, 1)]:
        grid = layout.rank_grid()
        for stage in range(layout.pp):
            for dp_rank in range(layout.dp):
                for tp_rank in range(layout.tp):
                    rank = grid[stage][dp_rank][tp_rank]
                    assert layout.coordinates(rank) == (stage, dp_rank, tp_rank)


def test_layouts_with_one_order_share_a_mesh():
    plan = ParallelPlan(
        world_size=4,
        layers=(S(tp=1, tp_consecutive=False), S(tp=4, tp_consecutive=False), S(tp=2, tp_consecutive=False)),
    )
    assert Layout.of(plan, plan.layers[0]) == Layout.of(plan, S())
    assert Layout.of(plan, plan.layers[1]) == Layout.of(plan, S(tp=4))
    assert not Layout.of(plan, plan.layers[2]).consecutive


def test_input_shards_follow_the_vocabulary_layout():
    plan = ParallelPlan(world_size=8, layers=(S(),), vocab=S(tp=2), pp=1)
    assert [input_shard(plan, r) for r in range(8)] == [(4, r // 2) for r in range(8)]
    strided = plan.replace(vocab=S(tp=2, tp_consecutive=False))
    assert [input_shard(strided, r)[1] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    pipelined = ParallelPlan(world_size=8, layers=(S(), S()), pp=2)
    assert [input_shard(pipelined, r) for r in range(8)] == [(4, r % 4) for r in range(8)]
