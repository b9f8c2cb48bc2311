"""``lightning-galvatron search / evaluate / import-galvatron``."""

from __future__ import annotations

import json

import pytest

from lightning_galvatron.cli.app import main
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from tests.search_profiles import A100_PROFILE, GALVATRON_DIR, REFERENCE_PLAN


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_search_prints_a_table_and_writes_the_plan(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    code, out, _ = run(
        capsys,
        "search",
        str(A100_PROFILE),
        "--world-size",
        "8",
        "--memory-per-device",
        "36GB",
        "--global-batch-size",
        "16",
        "-o",
        str(plan_path),
    )
    assert code == 0
    assert "blocks" in out and "strategy" in out and "memory/device" in out and "time/micro-batch" in out
    assert "Uniform baselines" in out and "zero3" in out and "Search took" in out
    plan = ParallelPlan.load(plan_path)
    assert plan.world_size == 8 and plan.global_batch_size == 16


def test_search_json(capsys):
    code, out, _ = run(
        capsys,
        "search",
        str(A100_PROFILE),
        "--world-size",
        "8",
        "--memory-per-device",
        "36GB",
        "--global-batch-size",
        "16",
        "--json",
        "--no-baselines",
    )
    assert code == 0
    data = json.loads(out)
    for key in ("throughput_samples_per_s", "step_time_s", "peak_memory_bytes_per_device", "plan"):
        assert key in data
    assert data["peak_memory_bytes_per_device"] <= 36e9
    assert ParallelPlan.from_dict(data["plan"]).num_layers == 32


def test_evaluate_a_reference_format_plan(capsys):
    code, out, _ = run(
        capsys, "evaluate", str(A100_PROFILE), "--plan", str(REFERENCE_PLAN), "--memory-per-device", "36GB", "--json"
    )
    assert code == 0  # the world size (8) comes from the file name
    data = json.loads(out)
    assert data["plan"]["world_size"] == 8 and data["fits"] is True
    assert data["throughput_samples_per_s"] == pytest.approx(15.12, rel=0.01)
    code, out, _ = run(capsys, "evaluate", str(A100_PROFILE), "--plan", str(REFERENCE_PLAN))
    assert code == 0 and "Predicted: step" in out and "tp1-zero3-rc" in out


def test_evaluate_our_plan_round_trips(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    run(
        capsys,
        "search",
        str(A100_PROFILE),
        "--world-size",
        "8",
        "--memory-per-device",
        "36GB",
        "--global-batch-size",
        "16",
        "-o",
        str(plan_path),
        "--no-baselines",
        "--json",
    )
    capsys.readouterr()
    code, out, _ = run(capsys, "evaluate", str(A100_PROFILE), "--plan", str(plan_path), "--json")
    assert code == 0 and json.loads(out)["global_batch_size"] == 16


def test_import_galvatron(capsys, tmp_path):
    out_path = tmp_path / "profile.json"
    code, out, _ = run(
        capsys,
        "import-galvatron",
        str(GALVATRON_DIR),
        "--hidden-size",
        "4096",
        "--seq-length",
        "2048",
        "-o",
        str(out_path),
    )
    assert code == 0 and "32 blocks" in out
    assert Profile.load(out_path) == Profile.load(A100_PROFILE)


def test_errors_are_messages_not_tracebacks(capsys, tmp_path):
    code, _, err = run(
        capsys, "search", str(A100_PROFILE), "--world-size", "8", "--memory-budget", "4GB", "--global-batch-size", "8"
    )
    assert code == 1 and "smallest budget that fits is" in err  # a well-formed question answered "no"
    code, _, err = run(capsys, "search", str(tmp_path / "missing.json"), "--world-size", "8", "--memory-budget", "4GB")
    assert code == 2 and "does not exist" in err
    code, _, err = run(capsys, "search", str(A100_PROFILE), "--world-size", "8")
    assert code == 2 and "--memory-budget" in err
    code, _, err = run(capsys, "search", str(A100_PROFILE), "--world-size", "8", "--memory-per-device", "lots")
    assert code == 2 and "cannot read 'lots' as a byte size" in err
    code, _, err = run(capsys, "search", str(A100_PROFILE), "--world-size", "8", "--disable", "magic")
    assert code == 2 and "invalid choice: 'magic'" in err


def test_search_options_reach_the_engine(capsys):
    code, out, _ = run(
        capsys,
        "search",
        str(A100_PROFILE),
        "--world-size",
        "8",
        "--memory-per-device",
        "36GB",
        "--global-batch-size",
        "16",
        "--max-tp",
        "2",
        "--disable",
        "zero2",
        "zero3",
        "--schedules",
        "1f1b",
        "--json",
        "--no-baselines",
    )
    plan = ParallelPlan.from_dict(json.loads(out)["plan"])
    assert all(s.tp <= 2 and s.dp_type == "ddp" for s in plan.layers)
    assert plan.pp > 1 and plan.schedule == "1f1b"
