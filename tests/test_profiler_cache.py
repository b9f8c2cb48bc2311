"""Profile cache: round trip, corrupt files, keys that change with what the profile depends on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.profiler.cache import (
    ENV_VAR,
    ProfileCache,
    cache_key,
    cluster_fingerprint,
    default_cache_dir,
    model_signature,
)
from lightning_galvatron.profiles import OptimizerProbe
from tests.helpers.training import tiny_gpt
from tests.search_profiles import synthetic_profile

KEY_ARGS = dict(precision="32-true", sample_shapes=[[[8], "torch.int64"]], device_kind="cpu", world_size=4)


def test_round_trip_and_atomic_write(tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    profile = synthetic_profile(np.random.default_rng(0), num_blocks=3)
    assert cache.load("abc") is None
    path = cache.save("abc", profile)
    assert cache.load("abc") == profile
    assert [p.name for p in path.parent.iterdir()] == ["abc.json"]  # no temporary file left behind
    cache.save("abc", profile)  # overwriting is fine
    assert cache.load("abc") == profile


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"format": "lightning_galvatron.profile", "version": 1}), ""]
)
def test_corrupt_file_warns_with_its_name_and_is_treated_as_missing(tmp_path, content):
    cache = ProfileCache(tmp_path)
    (tmp_path / "k1.json").write_text(content)
    with pytest.warns(UserWarning, match=r"corrupt cached profile .*k1\.json.*profiling again"):
        assert cache.load("k1") is None
    cache.save("k1", synthetic_profile(np.random.default_rng(1), num_blocks=2))  # re-profiled and overwritten
    assert cache.load("k1") is not None


def test_key_changes_with_structure_dtype_sequence_device_and_world():
    model = tiny_gpt()
    signature = model_signature(model, find_blocks(model))
    base = cache_key(signature, **KEY_ARGS)
    assert base == cache_key(signature, **KEY_ARGS) and len(base) == 32
    variants = [
        cache_key(model_signature(tiny_gpt(n_layer=5)), **KEY_ARGS),
        cache_key(model_signature(tiny_gpt(n_embd=64)), **KEY_ARGS),
        cache_key(model_signature(model.bfloat16()), **KEY_ARGS),
        cache_key(signature, **{**KEY_ARGS, "precision": "bf16-mixed"}),
        cache_key(signature, **{**KEY_ARGS, "sample_shapes": [[[16], "torch.int64"]]}),
        cache_key(signature, **{**KEY_ARGS, "device_kind": "NVIDIA H100"}),
        cache_key(signature, **{**KEY_ARGS, "world_size": 8}),
        cache_key(signature, **KEY_ARGS, devices_per_node=2),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_signature_ignores_values():
    a, b = tiny_gpt(), tiny_gpt()
    for p in b.parameters():
        p.data.add_(1.0)
    assert model_signature(a, find_blocks(a)) == model_signature(b, find_blocks(b))


def test_default_directory_and_env_override(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert default_cache_dir().parts[-3:] == (".cache", "lightning_galvatron", "profiles")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert ProfileCache().directory == tmp_path


def test_keys_are_file_names():
    with pytest.raises(ValueError, match="cache key"):
        ProfileCache("/tmp").path("../escape")


def _cluster(**changes):
    what = dict(device_kind="cpu", world_size=4, devices_per_node=4, backend="gloo", hosts=["a"] * 4) | changes
    return cluster_fingerprint(**what)


def test_cluster_measurements_round_trip_and_belong_to_their_cluster(tmp_path):
    """The model-independent part (interconnect, optimizer probes) is stored apart and found only for the very
    cluster it was measured on: another host, world size or backend is another file; a corrupt file is named."""
    cache = ProfileCache(tmp_path)
    profile = synthetic_profile(np.random.default_rng(0), num_blocks=3)
    optimizer = (OptimizerProbe(8, 2048, False, 1e-4), OptimizerProbe(8, 2048, True, 3e-4))
    assert cache.load_cluster(_cluster()) is None
    path = cache.save_cluster(_cluster(), profile.hardware, optimizer)
    assert path.parent == tmp_path / "clusters" and [p.name for p in path.parent.iterdir()] == [path.name]
    assert cache.load_cluster(_cluster()) == (profile.hardware, optimizer)
    for other in (dict(hosts=["a", "a", "b", "b"]), dict(world_size=2, hosts=["a"] * 2), dict(backend="nccl")):
        assert cache.cluster_path(_cluster(**other)) != path and cache.load_cluster(_cluster(**other)) is None
    path.write_text("{")
    with pytest.warns(UserWarning, match=r"ignoring the cached cluster measurements .*clusters.*measuring again"):
        assert cache.load_cluster(_cluster()) is None
    path.write_text(json.dumps({"fingerprint": _cluster(hosts=["b"] * 4)}))  # copied from another machine
    with pytest.warns(UserWarning, match=r"measured on another cluster"):
        assert cache.load_cluster(_cluster()) is None
