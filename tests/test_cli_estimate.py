"""``lightning-galvatron estimate`` (issue 8): will a model fit a cluster you do not have, and how?

The model side is analytic (exact shapes; compute and activations scaled from measured blocks), the
hardware side is the imported 8 x A100 profile (``benchmarks/data``). Llama-2-7B's config is in
``tests/data`` (public facts: hidden 4096, 32 layers, 32 heads, FFN 11008, vocabulary 32000).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_galvatron.cli.app import main
from lightning_galvatron.producers.analytic import analytic_profile, architecture_from_hf_config
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import search
from lightning_galvatron.units import parse_bytes

REPO = Path(__file__).resolve().parents[1]
LLAMA_CONFIG = REPO / "tests" / "data" / "llama2-7b-config.json"
A100 = REPO / "benchmarks" / "data" / "llama2-7b-a100-8gpu.json"


def _estimate(*args: str) -> tuple[dict, float, int]:
    """Run the installed command as a user would; return its JSON, wall time and exit status."""
    command = [sys.executable, "-m", "lightning_galvatron.cli", "estimate", "--json", *args]
    started = time.perf_counter()
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    assert out.returncode in (0, 1), out.stderr[-3000:]
    return json.loads(out.stdout), seconds, out.returncode


def test_llama2_7b_on_eight_a100s_of_36gb_fits():
    data, seconds, status = _estimate(
        "--hf-config",
        str(LLAMA_CONFIG),
        "--world-size",
        "8",
        "--memory-per-device",
        "36GB",
        "--seq-length",
        "2048",
        "--hardware",
        str(A100),
    )
    assert status == 0 and data["fits"]
    budget = parse_bytes("36GB")
    assert data["memory_budget_bytes"] == budget
    assert data["search"]["peak_memory_bytes_per_device"] <= budget
    assert data["parameters"] == 6_738_415_616  # Llama-2-7B, counted from the config
    # HF Llama layers (sdpa) run Megatron-SP and Ulysses too: every degree divides the 32 heads and the sequence
    plans = [data["search"]["plan"], *(b["plan"] for b in data["search"]["baselines"] if "plan" in b)]
    assert all(32 % layer["tp"] == 0 and 2048 % layer["tp"] == 0 for plan in plans for layer in plan["layers"])
    plan = data["search"]["plan"]
    assert plan["world_size"] == 8 and len(plan["layers"]) == 32


def test_sixty_four_devices_of_80gb_at_sequence_4096():
    data, seconds, status = _estimate(
        "--hf-config",
        str(LLAMA_CONFIG),
        "--world-size",
        "64",
        "--memory-per-device",
        "80GB",
        "--seq-length",
        "4096",
        "--hardware",
        str(A100),
    )
    assert status == 0 and data["fits"]
    assert data["search"]["peak_memory_bytes_per_device"] <= parse_bytes("80GB")
    assert data["seq_length"] == 4096 and data["search"]["plan"]["world_size"] == 64
    (scaling,) = data["scaling"]
    assert scaling["time_ratio"] > 2 and scaling["activation_ratio"] == pytest.approx(2.0)  # twice the tokens


def test_the_analytic_profile_reproduces_the_measured_one_for_the_measured_model():
    """Scaled from Llama-2-7B to Llama-2-7B at the measured sequence, the estimate is the measurement."""
    measured = Profile.load(A100)
    architecture = architecture_from_hf_config(json.loads(LLAMA_CONFIG.read_text()))
    analytic, _ = analytic_profile(architecture, measured, 2048)
    layer, reference = analytic.model.layer_types[0], measured.model.layer_types[0]
    assert layer.activation_bytes_per_sample == reference.activation_bytes_per_sample
    assert layer.forward_time.per_sample_s == pytest.approx(reference.forward_time.per_sample_s, rel=0.01)
    assert layer.supports_megatron_sp and layer.supports_ulysses  # as the runtime executes HF Llama layers (sdpa)
    assert layer.tensor_parallel_divisors == (32, 32, 11008) and layer.ulysses_divisors == (32,)
    ours = search(analytic, 8, "36GB", global_batch_size=16, baselines=False)
    theirs = search(measured, 8, "36GB", global_batch_size=16, baselines=False)
    assert ours.throughput_samples_per_s == pytest.approx(theirs.throughput_samples_per_s, rel=0.03)


def test_shapes_counted_from_configs_match_the_models_transformers_builds():
    from lightning_galvatron.model.shapes import architecture_of_module, hf_model_on_meta

    configs = [
        dict(
            model_type="llama",
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=1000,
            architectures=["LlamaForCausalLM"],
        ),
        dict(
            model_type="gpt2",
            n_embd=128,
            n_layer=5,
            n_head=4,
            vocab_size=500,
            n_positions=64,
            architectures=["GPT2LMHeadModel"],
        ),
        dict(
            model_type="bert",
            hidden_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=512,
            vocab_size=700,
            max_position_embeddings=64,
            architectures=["BertForSequenceClassification"],
        ),
    ]
    import torch
    import transformers

    for config in configs:
        counted = architecture_from_hf_config(config)
        module, counts = hf_model_on_meta(config)  # few blocks, counts put back by architecture_of_module
        built = architecture_of_module(module, block_counts=counts)
        with torch.device("meta"):
            fields = {k: v for k, v in config.items() if k != "architectures"}
            whole = getattr(transformers, config["architectures"][0])(transformers.AutoConfig.for_model(**fields))
        assert counted.parameters == built.parameters == sum(p.numel() for p in whole.parameters()), config[
            "model_type"
        ]
        assert counted.blocks == built.blocks and counted.vocab == built.vocab
        for field in (
            "parameters",
            "matmul_parameters",
            "num_heads",
            "num_key_value_heads",
            "head_dim",
            "ffn_hidden_size",
            "gated_mlp",
            "supports_tensor_parallel",
            "supports_megatron_sp",
            "supports_ulysses",
        ):
            assert getattr(counted.layer_types[0], field) == getattr(built.layer_types[0], field), (
                config["model_type"],
                field,
            )


def test_a_module_class_with_two_block_lists_gets_no_pipeline(capsys):
    status = main(
        [
            "estimate",
            "--model",
            "tests.helpers.model_families:TorchSeq2Seq",
            "--seq-length",
            "8",
            "--world-size",
            "4",
            "--memory-per-device",
            "1GB",
            "--hardware",
            str(A100),
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert status == 0 and data["fits"]
    assert [s["layer_type"] for s in data["scaling"]] == ["TransformerEncoderLayer", "TransformerDecoderLayer"]
    assert data["search"]["plan"]["pp"] == 1 and len(data["search"]["plan"]["layers"]) == 4


def test_when_nothing_fits_it_says_the_smallest_budget(capsys, tmp_path):
    status = main(
        [
            "estimate",
            "--hf-config",
            str(LLAMA_CONFIG),
            "--world-size",
            "8",
            "--memory-per-device",
            "8GB",
            "--seq-length",
            "2048",
            "--hardware",
            str(A100),
            "-o",
            str(tmp_path / "plan.json"),
        ]
    )
    out = capsys.readouterr().out
    assert status == 1
    assert "Fits: no." in out and "The smallest memory per device that fits:" in out
    assert not (tmp_path / "plan.json").exists()


def test_without_a_hardware_profile_the_local_cache_is_used(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_GALVATRON_CACHE", str(tmp_path))
    args = [
        "estimate",
        "--hf-config",
        str(LLAMA_CONFIG),
        "--world-size",
        "8",
        "--memory-per-device",
        "36GB",
        "--seq-length",
        "2048",
    ]
    assert main(args) == 2
    assert (
        "no --hardware profile given and no profile of cuda devices in the local profile cache"
        in capsys.readouterr().err
    )
    (tmp_path / "cached.json").write_text(A100.read_text())
    assert main([*args, "--profile-output", str(tmp_path / "analytic.json")]) == 0
    out = capsys.readouterr().out
    assert "Fits: yes." in out and "How these numbers were made:" in out and "cached.json" in out
    assert Profile.load(tmp_path / "analytic.json").model.num_blocks == 32
