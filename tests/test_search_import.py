"""Converting the reference system's profile files."""

from __future__ import annotations

import json
import shutil

import pytest

from lightning_galvatron.producers.galvatron_import import import_galvatron
from lightning_galvatron.profiles import Profile, ProfileError
from tests.search_profiles import A100_PROFILE, GALVATRON_DIR

MIB = 2**20


@pytest.fixture(scope="module")
def imported():
    return import_galvatron(GALVATRON_DIR, hidden_size=4096, seq_length=2048)


def test_import_matches_the_shipped_benchmark_profile(imported):
    assert imported == Profile.load(A100_PROFILE)


def test_model_figures(imported):
    model = imported.model
    assert model.name == "llama2-7b" and model.num_blocks == 32 and len(model.layer_types) == 1
    layer = model.layer_types[0]
    assert layer.parameters == round(778.2236328125 * MIB / 4)  # fp32 MiB -> parameters
    assert (layer.num_heads, layer.ffn_hidden_size, layer.seq_length) == (32, 11008, 2048)
    assert layer.activation_bytes_per_sample.at(1) == pytest.approx(514.5634765625 * MIB)
    assert layer.activation_bytes_per_sample.at(8) == pytest.approx(68.3204345703125 * MIB)
    assert layer.recompute_activation_bytes_per_sample == 32 * MIB
    # Forward ms per sample at batch 1 and 12 (4.40 and 3.92): one line over batch 1..12 fits both within 7%.
    assert layer.forward_time(1) == pytest.approx(4.396e-3, rel=0.08)
    assert layer.forward_time(12) == pytest.approx(12 * 3.918e-3, rel=0.02)
    vocab = model.vocab
    assert vocab.vocab_size == 32000 and vocab.embedding_parameters == vocab.head_parameters == 32000 * 4096
    assert vocab.head_activation_bytes_per_sample.at(2) == pytest.approx(343.3006591796875 * MIB)


def test_hardware_figures(imported):
    hw = imported.hardware
    assert hw.devices_per_node == 8
    assert hw.overlap_coefficient == pytest.approx(1.125552573612729)
    intra8 = hw.collective("all_reduce", 8, 8)
    assert intra8.bandwidth_bytes_per_s == pytest.approx(155.658 * MIB * 1e3)  # the two-node measurement wins
    assert hw.collective("all_reduce", 2, 1).bandwidth_bytes_per_s == pytest.approx(8.13007 * MIB * 1e3)
    a2a = hw.collective("all_to_all", 8, 8)
    assert a2a.kind == "all_to_all"
    # The fit reproduces the measured 1 GiB all-to-all (4.8151 ms) within a few percent.
    assert a2a.time(1024 * MIB) == pytest.approx(4.8151e-3, rel=0.05)
    assert hw.collective("p2p", 2, 2).bandwidth_bytes_per_s == pytest.approx(163.671 * MIB * 1e3)


def test_unknown_model_needs_its_shape(tmp_path):
    for path in GALVATRON_DIR.glob("*.json"):
        shutil.copy(path, tmp_path / path.name.replace("llama2-7b", "mymodel"))
    with pytest.raises(ProfileError, match="--num-heads, --ffn-hidden-size, --vocab-size"):
        import_galvatron(tmp_path, hidden_size=4096, seq_length=2048)
    profile = import_galvatron(
        tmp_path,
        hidden_size=4096,
        seq_length=2048,
        num_heads=32,
        ffn_hidden_size=11008,
        vocab_size=32000,
        tied_embeddings=True,
    )
    assert profile.model.name == "mymodel" and profile.model.num_blocks == 32  # layers from the plan file
    assert profile.model.vocab.tied and profile.model.vocab.head_parameters == 0


def test_clear_errors_for_missing_files_and_sequence_lengths(tmp_path):
    with pytest.raises(ProfileError, match="not a directory"):
        import_galvatron(tmp_path / "nope", hidden_size=4096, seq_length=2048)
    with pytest.raises(ProfileError, match="no computation_profiling"):
        import_galvatron(tmp_path, hidden_size=4096, seq_length=2048)
    with pytest.raises(ProfileError, match="sequence length 4096"):
        import_galvatron(GALVATRON_DIR, hidden_size=4096, seq_length=4096)
    (tmp_path / "computation_profiling_bf16_x_all.json").write_text(json.dumps({"layertype_0_bsz1_seq8": 1.0}))
    (tmp_path / "memory_profiling_bf16_x_all.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        import_galvatron(
            tmp_path, hidden_size=8, seq_length=8, num_layers=1, num_heads=1, ffn_hidden_size=8, vocab_size=8
        )
