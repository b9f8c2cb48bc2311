"""Relocation plans: every rank receives exactly its new region, from ranks that hold it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.runtime.mesh import Layout
from lightning_galvatron.runtime.relocate import ActivationLayout, exchange_plan


def layouts(world: int):
    for tp in [d for d in range(1, world + 1) if world % d == 0]:
        for consecutive in (True, False):
            for seq_sharded in (False, True) if tp > 1 else (False,):
                yield ActivationLayout(Layout(world, 1, tp, consecutive), seq_sharded)


@pytest.mark.parametrize("world", [2, 4, 6, 8])
def test_every_target_region_is_covered_exactly_once_by_holders(world):
    batch, seq = 2 * world, 24
    for source, target in itertools.product(list(layouts(world)), repeat=2):
        plan = exchange_plan(source, target, batch, seq)
        for position in range(world):
            (b0, b1), (s0, s1) = target.region(position, batch, seq)
            cover = np.zeros((batch, seq), dtype=int)
            for t in plan:
                if t.target != position:
                    continue
                (r0, r1), (c0, c1) = t.region
                held = source.region(t.source, batch, seq)
                assert held[0][0] <= r0 and r1 <= held[0][1] and held[1][0] <= c0 and c1 <= held[1][1]
                cover[r0:r1, c0:c1] += 1
            assert (cover[b0:b1, s0:s1] == 1).all() and cover.sum() == (b1 - b0) * (s1 - s0)


def test_splitting_a_tensor_parallel_group_into_data_parallel_ranks_moves_nothing():
    source = ActivationLayout(Layout(4, 1, 2, True))  # dp=2, each tp pair holds the same rows
    target = ActivationLayout(Layout(4, 1, 1))  # dp=4: each rank keeps half of what it holds
    assert all(t.source == t.target for t in exchange_plan(source, target, 8, 16))


def test_gathering_spreads_the_sends_over_the_holders():
    source = ActivationLayout(Layout(4, 1, 1))
    target = ActivationLayout(Layout(4, 1, 4))  # everyone needs everything
    plan = exchange_plan(source, target, 4, 8)
    sent = [sum(t.source == r and t.target != r for t in plan) for r in range(4)]
    assert sent == [3, 3, 3, 3]


def test_uneven_batches_split_into_balanced_rows():
    layout = ActivationLayout(Layout(4, 1, 1))
    assert [layout.region(p, 6, 8)[0] for p in range(4)] == [(0, 1), (1, 3), (3, 4), (4, 6)]


def test_sequence_that_does_not_split_is_refused():
    layout = ActivationLayout(Layout(4, 1, 4), seq_sharded=True)
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by the sequence-parallel degree 4"):
        layout.region(0, 4, 6)


def test_ranks_that_stop_agreeing_on_a_mask_in_a_later_step_get_an_error_not_a_hang(pools):
    """The ranks agree on their per-sample inputs once per forward, not once per block: a step whose inputs differ
    between ranks after steps where they agreed is still refused on every rank (a check skipped on some ranks only
    would leave the others waiting in it)."""
    from tests.helpers.masked_model import masked_on_every_rank_in_the_first_step
    from tests.helpers.training import run_distributed

    # Strided vocabulary groups read shards r % 2, the blocks' dp=4 needs quarter r: samples cross ranks.
    plan = ParallelPlan(world_size=4, layers=(S(), S()), vocab=S(tp=2, tp_consecutive=False))
    with pytest.raises(AssertionError, match="passed different inputs to MaskedBlock: some a per-sample tensor"):
        pools(4).run(run_distributed, plan, model=masked_on_every_rank_in_the_first_step)
