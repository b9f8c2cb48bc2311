"""One convention for every subcommand of ``lightning-galvatron`` (issue 16): exit status 0 success, 1 a well-formed
question answered "no" (or a run-time failure), 2 a usage error; under ``--json`` errors are JSON on stdout; memory
sizes need units; defaults come from the profile. ``consolidate``'s are in ``test_hf_export.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_galvatron import __version__, reference_profiles
from lightning_galvatron.cli.app import main
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from tests.search_profiles import A100_PROFILE, GALVATRON_DIR, REFERENCE_PLAN

REPO = Path(__file__).resolve().parents[1]
LLAMA_CONFIG = REPO / "tests" / "data" / "llama2-7b-config.json"
GPT2_SMALL = {
    "model_type": "gpt2",
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "vocab_size": 50257,
    "n_positions": 1024,
    "architectures": ["GPT2LMHeadModel"],
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def json_error(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


@pytest.fixture
def cpu_profile(tmp_path) -> Path:
    """The A100 profile relabelled as measured on CPUs in fp32: what a CPU `profile` run records."""
    data = json.loads(A100_PROFILE.read_text())
    data["hardware"]["device_type"], data["model"]["precision"] = "cpu", "32-true"
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    return path


def test_version_help_and_usage_errors(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"lightning-galvatron {__version__}"
    code, out, _ = run(capsys, "search", "--help")
    assert code == 0 and "--memory-budget" in out
    code, _, err = run(capsys, "no-such-command")
    assert code == 2 and "invalid choice" in err
    code, data = json_error(capsys, "search", str(A100_PROFILE))  # --world-size missing
    assert code == 2 and data["error"]["kind"] == "usage" and "--world-size" in data["error"]["message"]
    assert data["error"]["command"] == "search" and data["error"]["exit_code"] == 2


def test_search_exit_codes_and_json(capsys, cpu_profile):
    base = ("search", str(A100_PROFILE), "--world-size", "8", "--global-batch-size", "8", "--no-baselines")
    code, out, _ = run(capsys, *base, "--memory-budget", "36GB", "--json")
    assert code == 0 and json.loads(out)["precision"] == "bf16-mixed"  # the profile's, not a fixed default
    code, data = json_error(capsys, *base, "--memory-budget", "4GB")
    assert code == 1 and data["fits"] is False and data["error"]["kind"] == "no_plan"
    assert data["error"]["smallest_budget_bytes"] > 4e9 and "smallest budget that fits" in data["error"]["message"]
    code, data = json_error(capsys, *base, "--memory-budget", "36")
    assert code == 2 and "'36' has no unit: write e.g. '36GB'" in data["error"]["message"]
    code, _, err = run(capsys, *base, "--memory-per-device", "36")  # the old name is an alias
    assert code == 2 and "has no unit" in err
    code, data = json_error(
        capsys, "search", str(cpu_profile), "--world-size", "8", "--memory-budget", "36GB", "--no-baselines"
    )
    assert code == 0 and data["precision"] == "32-true"
    code, out, _ = run(capsys, "search", "a100", "--world-size", "8", "--memory-budget", "36GB", "--no-baselines")
    assert code == 0 and "bf16-mixed (the profile's)" in out and "budget 33.5 GiB per device" in out


def test_evaluate_exit_codes_and_json(capsys, tmp_path):
    code, out, _ = run(
        capsys, "evaluate", str(A100_PROFILE), "--plan", str(REFERENCE_PLAN), "--memory-budget", "36GB", "--json"
    )
    assert code == 0 and json.loads(out)["fits"] is True
    code, out, _ = run(capsys, "evaluate", str(A100_PROFILE), "--plan", str(REFERENCE_PLAN), "--memory-budget", "8GB")
    assert code == 1 and "DOES NOT FIT" in out  # the answer is "no"
    ParallelPlan.uniform(8, 6, S()).save(tmp_path / "six.json")
    code, data = json_error(
        capsys, "evaluate", str(A100_PROFILE), "--plan", str(tmp_path / "six.json"), "--global-batch-size", "8"
    )
    assert code == 2 and data["error"]["kind"] == "usage" and "six.json" in data["error"]["message"]


def test_import_galvatron_exit_codes_and_json(capsys, tmp_path):
    code, data = json_error(
        capsys,
        "import-galvatron",
        str(GALVATRON_DIR),
        "--hidden-size",
        "4096",
        "--seq-length",
        "2048",
        "-o",
        str(tmp_path / "p.json"),
    )
    assert code == 0 and data["blocks"] == 32
    imported = Profile.load(tmp_path / "p.json")
    assert imported.measured_precision == "bf16-mixed" and imported.device_type == "cuda"
    code, data = json_error(
        capsys,
        "import-galvatron",
        str(tmp_path / "none"),
        "--hidden-size",
        "4096",
        "--seq-length",
        "2048",
        "-o",
        str(tmp_path / "q.json"),
    )
    assert code == 2 and "is not a directory of Hetu-Galvatron profile files" in data["error"]["message"]
    code, data = json_error(
        capsys,
        "import-galvatron",
        str(GALVATRON_DIR),
        "--hidden-size",
        "4096",
        "--seq-length",
        "2048",
        "--device-memory",
        "80",
        "-o",
        str(tmp_path / "q.json"),
    )
    assert code == 2 and "has no unit" in data["error"]["message"]


def test_profile_exit_codes_and_json(capsys, tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO)
    code, data = json_error(
        capsys,
        "profile",
        "--model",
        "examples.gpt:GPTModule",
        "--datamodule",
        "examples.gpt:ArithmeticDataModule",
        "-o",
        str(tmp_path / "p.json"),
    )
    assert code == 2 and "torchrun --nproc-per-node" in data["error"]["message"]
    code, data = json_error(capsys, "profile", "--model", "examples.gpt:Nope", "-o", str(tmp_path / "p.json"))
    assert code == 2 and "has no 'Nope'" in data["error"]["message"]


def test_dry_run_usage_errors_as_json(capsys, tmp_path):
    code, data = json_error(
        capsys,
        "dry-run",
        "--hf-config",
        str(LLAMA_CONFIG),
        "--seq-length",
        "16",
        "--plan",
        str(tmp_path / "missing.json"),
    )
    assert code == 2 and "does not exist" in data["error"]["message"] and data["error"]["command"] == "dry-run"
    code, data = json_error(
        capsys, "dry-run", "--hf-config", str(LLAMA_CONFIG), "--plan", "auto", "--memory-budget", "1"
    )
    assert code == 2 and "has no unit" in data["error"]["message"]


# ---------------------------------------------------------------------------------------------- estimate
def _estimate(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, "estimate", "--world-size", "8", "--seq-length", "2048", *argv, "--json")
    return code, json.loads(out)


def test_estimate_with_the_shipped_reference_profile_names_it(capsys):
    assert "a100" in reference_profiles.names()
    assert Profile.load(reference_profiles.path("a100")).model.blocks == Profile.load(A100_PROFILE).model.blocks
    code, data = _estimate(capsys, "--hf-config", str(LLAMA_CONFIG), "--memory-budget", "36GB", "--hardware", "a100")
    assert code == 0 and data["fits"] and data["sources"]["hardware"] == "a100" and data["precision"] == "bf16-mixed"
    assert data["warnings"] == []  # the measured model itself: no extrapolation
    code, data = _estimate(capsys, "--hf-config", str(LLAMA_CONFIG), "--memory-budget", "8GB", "--hardware", "a100")
    assert code == 1 and not data["fits"] and data["smallest_budget_bytes"] > 8e9
    code, out, _ = run(
        capsys,
        "estimate",
        "--hf-config",
        str(LLAMA_CONFIG),
        "--world-size",
        "8",
        "--memory-budget",
        "36GB",
        "--hardware",
        "a100",
    )
    assert "Profiles: hardware a100, measured blocks a100; precision bf16-mixed" in out and "A100" in out
    code, data = _estimate(capsys, "--hf-config", str(LLAMA_CONFIG), "--memory-budget", "36GB", "--hardware", "h999")
    assert code == 2 and "neither a profile file nor the name of a reference profile" in data["error"]["message"]


def test_estimate_refuses_a_profile_of_another_device_unless_asked(capsys, cpu_profile):
    question = ("--hf-config", str(LLAMA_CONFIG), "--memory-budget", "36GB")
    code, data = _estimate(capsys, *question, "--hardware", str(cpu_profile))
    assert code == 2
    assert "was measured on cpu devices but the question is about cuda devices" in data["error"]["message"]
    assert "a100" in data["error"]["message"] and "--allow-other-device" in data["error"]["message"]
    code, data = _estimate(capsys, *question, "--hardware", "a100", "--reference", str(cpu_profile))  # CPU blocks
    assert code == 2 and "reference profile" in data["error"]["message"]
    code, data = _estimate(capsys, *question, "--hardware", str(cpu_profile), "--allow-other-device")
    assert code == 0 and any("measured on cpu devices" in w for w in data["warnings"])
    code, data = _estimate(capsys, *question, "--hardware", str(cpu_profile), "--accelerator", "cpu")
    assert code == 0 and data["warnings"] == [] and data["precision"] == "32-true"


def test_estimate_warns_on_a_large_flop_extrapolation(capsys, tmp_path):
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps(GPT2_SMALL))
    code, data = _estimate(capsys, "--hf-config", str(config), "--memory-budget", "36GB", "--hardware", "a100")
    assert code == 0
    (warning,) = data["warnings"]
    (scaling,) = data["scaling"]
    assert scaling["time_ratio"] < 0.1 and f"x{scaling['time_ratio']:.3g} in FLOPs" in warning


def test_the_newest_cached_profile_of_the_asked_device_is_used(capsys, tmp_path, monkeypatch, cpu_profile):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LIGHTNING_GALVATRON_CACHE", str(cache))
    (cache / "gpu.json").write_text(A100_PROFILE.read_text())
    (cache / "cpu.json").write_text(cpu_profile.read_text())  # newer, but of CPUs
    code, data = _estimate(capsys, "--hf-config", str(LLAMA_CONFIG), "--memory-budget", "36GB")
    assert code == 0 and data["sources"]["hardware"].endswith("gpu.json")
    (cache / "gpu.json").unlink()
    code, data = _estimate(capsys, "--hf-config", str(LLAMA_CONFIG), "--memory-budget", "36GB")
    assert code == 2 and "only profiles of other devices: cpu.json (cpu)" in data["error"]["message"]
