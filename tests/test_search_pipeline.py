"""Stage partitions: min-max balancing is exact, the Galvatron-BMW middle ground and block-by-block refinement."""

from __future__ import annotations

import itertools

import numpy as np

from lightning_galvatron.search.pipeline import (
    balanced_partition,
    interpolate_partitions,
    partition_neighbours,
    refine_partition,
)


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield tuple(np.diff((0, *cuts, total)))


def stage_costs(partition, weights, constants):
    starts = np.concatenate([[0], np.cumsum(partition)])
    return [constants[s] + weights[s, starts[s] : starts[s + 1]].sum() for s in range(len(partition))]


def test_balanced_partition_is_the_min_max_optimum():
    rng = np.random.default_rng(0)
    for _ in range(200):
        L = int(rng.integers(2, 9))
        pp = int(rng.integers(1, L + 1))
        weights = rng.random((pp, L))  # per-stage weights, e.g. more micro-batches in flight early in 1F1B
        constants = rng.random(pp)
        limit = int(rng.integers(-(-L // pp), L - pp + 2))
        found = balanced_partition(pp, weights, constants, limit)
        feasible = [p for p in compositions(L, pp) if max(p) <= limit]
        best = min(max(stage_costs(p, weights, constants)) for p in feasible)
        assert found is not None and max(found) <= limit and sum(found) == L
        assert max(stage_costs(found, weights, constants)) <= best * (1 + 1e-6)


def test_interpolation_lies_between_and_refinement_climbs_to_a_local_optimum():
    a, b = (2, 2, 2, 10), (8, 4, 2, 2)
    middle = interpolate_partitions(a, b)
    assert middle and all(sum(p) == 16 and min(p) >= 1 for p in middle)
    bounds_a, bounds_b = np.cumsum(a)[:-1], np.cumsum(b)[:-1]
    for p in middle:
        bounds = np.cumsum(p)[:-1]
        assert ((bounds >= np.minimum(bounds_a, bounds_b)) & (bounds <= np.maximum(bounds_a, bounds_b))).all()
    target = np.cumsum([5, 3, 4, 4])[:-1]
    objective = lambda parts: ((np.cumsum(parts, axis=1)[:, :-1] - target) ** 2).sum(axis=1).astype(float)  # noqa: E731
    found, value = refine_partition(a, objective, max_blocks=16)
    assert found == (5, 3, 4, 4) and value == 0.0
    assert all(objective(q[None, :])[0] > 0 for q in partition_neighbours(found, 16))
    capped, _ = refine_partition((4, 4, 4, 4), objective, max_blocks=4)
    assert max(capped) <= 4
