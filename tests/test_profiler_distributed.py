"""``profile()`` on 4 gloo processes: the example GPT, real per-degree measurements, the cache, the search."""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.profiler import ProfileCache, profile
from lightning_galvatron.profiler.model import profile_model
from lightning_galvatron.profiler.model.setup import quiet_over_ranks, quiet_seconds
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import search
from tests.helpers.training import dataset, tiny_gpt

pytestmark = pytest.mark.timeout(300)


def _example():
    model = tiny_gpt()
    data = dataset(8)
    return model, find_blocks(model), (data.inputs[:2], data.targets[:2])


def _profile_cached_then_corrupted(cache_dir: str) -> tuple[dict, dict, list[str], dict]:
    """Measure; hit the cache; corrupt the file and profile again (rank 0 warns and re-measures)."""
    model, structure, batch = _example()
    cache = ProfileCache(cache_dir)
    first = profile(model, structure, batch, cache=cache, hardware_budget_s=1.0)
    again = profile(model, structure, batch, cache=cache, hardware_budget_s=1.0)
    if dist.get_rank() == 0:
        for path in Path(cache_dir).glob("*.json"):
            path.write_text('{"format": "lightning_galvatron.profile", "version": 1, "model": {')
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remeasured = profile(model, structure, batch, cache=cache, hardware_budget_s=1.0)
    return first.to_dict(), again.to_dict(), [str(w.message) for w in caught], remeasured.to_dict()


def test_four_ranks_get_one_profile_that_the_search_accepts(pools, tmp_path):
    results = pools(4).run(_profile_cached_then_corrupted, str(tmp_path))
    first = results[0][0]
    assert all(
        r[0] == first and r[1] == first for r in results
    )  # every rank; the second call is a cache hit (a measurement would differ)
    # A corrupt cache file: rank 0 names it in a warning, everyone re-profiles, the file is rewritten.
    (path,) = tmp_path.glob("*.json")
    assert any("corrupt cached profile" in m and path.name in m for m in results[0][2])
    assert all(r[3] == results[0][3] for r in results)
    assert Profile.load(path).to_dict() == results[0][3]
    # The model was measured again, the cluster (interconnect, optimizer) came from its own cache file.
    remeasured = results[0][3]
    assert remeasured["overheads"]["calls"] != first["overheads"]["calls"]
    assert remeasured["hardware"] == first["hardware"]
    assert remeasured["overheads"]["optimizer"] == first["overheads"]["optimizer"]
    (cluster,) = (tmp_path / "clusters").glob("*.json")
    assert json.loads(cluster.read_text())["fingerprint"]["hosts"] == [socket.gethostname()] * 4

    result = Profile.from_dict(first)
    (layer,) = result.model.layer_types
    assert result.model.blocks == (0, 0, 0, 0)
    assert set(dict(layer.activation_bytes_per_sample.values)) == {1, 2, 4}
    # Measured on real TP/SP groups of 2 and 4 ranks: the same bytes the single-process derivation predicts
    # (DTensor sequence parallelism keeps the gathered inputs of the column-parallel projections whole).
    model, structure, batch = _example()
    derived = profile_model(model, structure, batch, degrees=(1, 2, 4)).layer_types[0]
    for g in (1, 2, 4):
        assert layer.activation_bytes_per_sample.at(g) == pytest.approx(
            derived.activation_bytes_per_sample.at(g), rel=0.05
        )
    assert layer.replicated_activation_bytes_per_sample == pytest.approx(
        derived.replicated_activation_bytes_per_sample, rel=0.05
    )

    plan = search(result, 4, "1GB", precision="32-true", baselines=False).plan
    assert plan.world_size == 4 and plan.num_layers == 4
    assert search(result, 4, "1GB", precision="32-true", baselines=False).plan == plan  # deterministic


def _profile_without_group() -> str:
    model, structure, batch = _example()
    try:
        profile(model, structure, batch, world_size=dist.get_world_size() + 1, cache=False)
    except ValueError as err:
        return str(err)
    return "no error"


def test_wrong_world_size_is_refused_on_every_rank(pools):
    messages = pools(2).run(_profile_without_group)
    assert all("world_size=3 but the process group has 2 ranks" in m for m in messages)


def _quiet_on_ranks() -> list[float]:
    """Rank 1 caught quiet moments for the first quantity, rank 0 for the second."""
    rank = dist.get_rank()
    return quiet_over_ranks([[2.0 - r, 1.0 + r] for r in (rank + 0.0, rank + 0.1, rank + 0.2)])


def test_every_rank_keeps_the_quietest_ranks_timing_of_each_quantity(pools):
    """Where ranks share cores, one rank's few repeats may all be preempted: each quantity keeps the quiet end of
    the rank that had a core to itself, and every rank profiles with the same figure."""
    results = pools(2).run(_quiet_on_ranks)
    quietest = [quiet_seconds([1.0, 0.9, 0.8]), quiet_seconds([1.0, 1.1, 1.2])]
    assert results[0] == results[1] == pytest.approx(quietest)
    assert quiet_over_ranks([[3.0], [2.0]]) == [quiet_seconds([3.0, 2.0])]  # no group here
