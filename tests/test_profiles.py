"""The profile format: JSON round trip, validation errors, interpolation and collective look-up."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_galvatron.profiles import (
    PROFILE_VERSION,
    CollectiveFit,
    DegreeTable,
    HardwareProfile,
    LinearFit,
    Profile,
    ProfileError,
    bus_volume,
    load_profile,
    lookup_collective,
)
from tests.search_profiles import A100_PROFILE, synthetic_profile


def test_json_round_trip_is_exact(tmp_path):
    profile = synthetic_profile(np.random.default_rng(0), num_blocks=5, num_types=2)
    path = tmp_path / "p.json"
    profile.save(path)
    again = Profile.load(path)
    assert again == profile
    assert again.to_dict() == profile.to_dict()
    assert load_profile(profile.to_dict()) == profile
    assert Profile.load(A100_PROFILE).model.num_blocks == 32


def test_several_layer_types_and_block_pattern():
    profile = synthetic_profile(np.random.default_rng(1), num_blocks=6, num_types=2)
    assert profile.model.blocks == (0, 0, 0, 1, 1, 1)
    assert profile.model.block_type(4).name == "type1"
    longer = profile.with_num_blocks(9)
    assert longer.model.num_blocks == 9 and longer.model.blocks[:6] == profile.model.blocks


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="something else"), "not a lightning_galvatron profile"),
        (lambda d: d.update(version=PROFILE_VERSION + 1), "newer than this lightning_galvatron"),
        (lambda d: d.pop("hardware"), "lacks its 'hardware' section"),
        (lambda d: d.update(extra=1), "unknown profile keys"),
        (lambda d: d["model"]["layer_types"][0].pop("num_heads"), r"layer_types\[0\]: missing \['num_heads'\]"),
        (lambda d: d["model"]["layer_types"][0].update(heads=3), "unknown keys"),
        (lambda d: d["model"].update(blocks=[0, 5]), r"model.blocks\[1\] = 5"),
        (lambda d: d["hardware"].update(overlap_coefficient=0.5), "overlap_coefficient must be >= 1"),
        (
            lambda d: d["hardware"].update(
                collectives=[c for c in d["hardware"]["collectives"] if c["kind"] != "all_reduce"]
            ),
            "at least one all_reduce",
        ),
        (
            lambda d: d["model"]["layer_types"][0]["forward_time"].update(per_sample_s=-1),
            "per_sample_s must be a finite number",
        ),
        (lambda d: d["model"]["layer_types"][0].update(activation_bytes_per_sample={}), "non-empty object"),
    ],
)
def test_validation_names_the_problem(mutate, message):
    data = json.loads(A100_PROFILE.read_text())
    mutate(data)
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(data)


def test_a_reference_system_file_gets_a_hint(tmp_path):
    path = tmp_path / "computation.json"
    path.write_text(json.dumps({"layertype_0_bsz1_seq2048": 4.0}))
    with pytest.raises(ProfileError, match="import-galvatron"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(tmp_path / "missing.json")


def test_linear_fit_recovers_a_line_and_clamps_noise():
    fit = LinearFit.fit([1, 2, 4, 8], [0.5 + 2 * b for b in (1, 2, 4, 8)])
    assert fit.intercept_s == pytest.approx(0.5) and fit.per_sample_s == pytest.approx(2.0)
    assert fit(3) == pytest.approx(6.5)
    through_zero = LinearFit.fit([1, 2], [3.0, 2.0 * 3.0 + 0.1])  # would give a negative intercept
    assert through_zero.intercept_s == 0.0
    assert LinearFit.fit([4], [2.0]).per_sample_s == pytest.approx(0.5)


def test_degree_table_interpolates_unmeasured_degrees():
    table = DegreeTable(((1, 100.0), (2, 55.0), (4, 32.5), (8, 21.25)))  # 10 + 90/g exactly
    assert table.at(2) == 55.0
    assert table.at(3) == pytest.approx(40.0)
    assert table.at(6) == pytest.approx(25.0)
    assert DegreeTable(((2, 50.0),)).at(4) == pytest.approx(25.0)


def test_collective_fit_recovers_latency_and_bandwidth():
    sizes = [2**20 * s for s in (1, 4, 16, 64, 256, 1024)]
    latency, bandwidth, g = 5e-5, 1.5e11, 8
    times = [latency + bus_volume("all_reduce", g) * s / bandwidth for s in sizes]
    fit = CollectiveFit.fit("all_reduce", g, g, sizes, times)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fit.time(2**30) == pytest.approx(latency + 1.75 * 2**30 / bandwidth)


def test_collective_lookup_prefers_same_side_of_the_node_boundary_and_falls_back_by_kind():
    entries = (
        CollectiveFit("all_reduce", 2, 2, 1e-5, 100e9),
        CollectiveFit("all_reduce", 8, 8, 1e-5, 150e9),
        CollectiveFit("all_reduce", 16, 8, 1e-5, 40e9),
        CollectiveFit("all_reduce", 2, 1, 1e-5, 8e9),
        CollectiveFit("all_to_all", 8, 8, 1e-5, 190e9),
    )
    assert lookup_collective(entries, "all_reduce", 8, 8).bandwidth_bytes_per_s == 150e9
    assert lookup_collective(entries, "all_reduce", 4, 4).bandwidth_bytes_per_s in (
        100e9,
        150e9,
    )  # intra-node, nearest size
    assert lookup_collective(entries, "all_reduce", 64, 8).bandwidth_bytes_per_s == 40e9  # inter-node, 8 per node
    assert lookup_collective(entries, "all_reduce", 32, 1).bandwidth_bytes_per_s == 8e9  # inter-node, 1 per node
    assert lookup_collective(entries, "all_gather", 8, 8).kind == "all_reduce"  # half an all-reduce's volume
    assert lookup_collective(entries, "all_to_all", 8, 8).kind == "all_to_all"
    assert lookup_collective(entries, "p2p", 4, 2).group_size == 2
    assert bus_volume("all_gather", 8) * 2 == bus_volume("all_reduce", 8)


def test_hardware_rejects_duplicate_entries():
    entry = CollectiveFit("all_reduce", 2, 2, 0.0, 1e9)
    with pytest.raises(ProfileError, match="duplicate"):
        HardwareProfile("x", 8, 1.0, (entry, entry))
