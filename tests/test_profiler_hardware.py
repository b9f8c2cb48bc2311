"""Hardware profiler: which groups are measured, fits, and a real run on 4 gloo processes."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_galvatron.profiler.hardware import (
    GroupLayout,
    _fit,
    measured_layouts,
    message_sizes,
    profile_hardware,
)
from lightning_galvatron.profiles import COLLECTIVE_KINDS, bus_volume

pytestmark = pytest.mark.timeout(300)


def keys(layouts):
    return sorted((lay.kind, lay.group_size, lay.ranks_per_node) for lay in layouts)


def test_one_node_measures_each_group_size_once():
    assert keys(measured_layouts(4, 4)) == [("collective", 2, 2), ("collective", 4, 4), ("p2p", 2, 2), ("p2p", 4, 2)]
    assert keys(measured_layouts(6, 6, group_sizes=[3])) == [
        ("collective", 3, 3),
        ("p2p", 2, 2),
        ("p2p", 3, 2),
        ("p2p", 6, 2),
    ]
    assert measured_layouts(1, 1) == []


def test_two_nodes_measure_both_layouts_where_they_differ():
    layouts = {(lay.kind, lay.group_size, lay.ranks_per_node): lay for lay in measured_layouts(8, 4)}
    # Two ranks: neighbours (inside a node) or 4 apart (across nodes); four ranks: one node, or two per node.
    for key in [
        ("collective", 2, 2),
        ("collective", 2, 1),
        ("collective", 4, 4),
        ("collective", 4, 2),
        ("collective", 8, 4),
    ]:
        assert key in layouts
    assert layouts[("collective", 2, 1)].groups(8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layouts[("collective", 4, 2)].groups(8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Some pair of neighbouring stages always straddles the node boundary: the slowest pair sets the pace.
    assert {k for k in layouts if k[0] == "p2p"} == {("p2p", 2, 1), ("p2p", 4, 1), ("p2p", 8, 1)}
    for lay in layouts.values():
        if lay.kind == "collective":
            groups = lay.groups(8)
            assert sorted(r for g in groups for r in g) == list(range(8))


def test_message_sizes_go_from_latency_to_bandwidth():
    sizes = message_sizes("cpu")
    assert sizes[0] <= 4096 and sizes[-1] >= 2**22 and all(b == 4 * a for a, b in zip(sizes, sizes[1:]))
    assert len(message_sizes("cpu", max_bytes=1)) >= 3


def test_fit_recovers_latency_and_bandwidth_and_survives_flat_noise():
    layout = GroupLayout("collective", 4, 1, 4)
    sizes = message_sizes("cpu")
    volume = bus_volume("all_reduce", 4)
    times = [2e-4 + volume * s / 1e9 for s in sizes]
    fit = _fit("all_reduce", layout, sizes, times)
    assert fit.latency_s == pytest.approx(2e-4, rel=1e-6) and fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    # Slow small messages and a flat top (noise on a shared machine): never an unbounded bandwidth.
    noisy = [5e-3, 1e-3, 1e-3, 1e-3, 1e-3, 2e-3]
    fit = _fit("all_reduce", layout, sizes, noisy)
    assert fit.time(sizes[-1]) == pytest.approx(noisy[-1], rel=0.5)
    assert fit.bandwidth_bytes_per_s < 1e12
    # Flat times all the way (seen on a loaded machine): latency explains them, and the bandwidth is the
    # lower bound the largest message proves, not an unbounded one.
    flat = [8.3e-4] * len(sizes)
    fit = _fit("all_to_all", GroupLayout("collective", 2, 1, 2), sizes, flat)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bus_volume("all_to_all", 2) * sizes[-1] / 8.3e-4)
    assert fit.latency_s == pytest.approx(8.3e-4)


def _profile_on_rank(budget_s: float) -> dict:
    world = dist.get_world_size()
    return profile_hardware(world, world, budget_s=budget_s).to_dict()


def test_four_processes_measure_every_kind_and_agree(pools):
    results = pools(4).run(_profile_on_rank, 1.5)
    assert all(r == results[0] for r in results)  # the same profile on every rank
    from lightning_galvatron.profiles import HardwareProfile

    hw = HardwareProfile.from_dict(results[0])
    measured = {(c.kind, c.group_size) for c in hw.collectives}
    for kind in COLLECTIVE_KINDS:
        if kind != "p2p":
            assert {(kind, 2), (kind, 4)} <= measured
    assert {("p2p", 2), ("p2p", 4)} <= measured
    for c in hw.collectives:
        assert c.bandwidth_bytes_per_s > 0 and c.latency_s >= 0
        assert c.bandwidth_bytes_per_s < 1e12  # CPU processes on one machine: nowhere near a TB/s
    assert hw.overlap_coefficient >= 1.0
    assert hw.device_memory_bytes is None and hw.memory_overhead_bytes == 0 and hw.devices_per_node == 4
