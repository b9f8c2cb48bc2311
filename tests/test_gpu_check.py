"""``benchmarks/gpu_check.py`` without a GPU: its logic, and its profile and memory sections on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_check  # noqa: E402


def test_cases_plans_and_verdicts() -> None:
    cases = gpu_check.memory_cases()
    assert len(set(cases)) == 8
    assert {c.precision for c in cases} == {"bf16-mixed", "bf16-true"}
    assert {(c.recompute, c.micro_batches) for c in cases} == {(False, 1), (False, 4), (True, 1), (True, 4)}
    config = gpu_check.ModelConfig()
    plan = gpu_check.single_device_plan(gpu_check.MemoryCase("bf16-true", True, 4), config)
    assert plan.world_size == 1 and plan.micro_batches == 4 and all(s.recompute for s in plan.layers)
    assert not plan.vocab.recompute and plan.num_layers == config.n_layer
    assert gpu_check.compare_memory("a", 100.0, 110, 0.15)["passed"]
    assert not gpu_check.compare_memory("a", 100.0, 120, 0.15)["passed"]
    assert not gpu_check.compare_memory("a", 100.0, None, 0.15)["passed"]
    assert gpu_check.loss_fell([3.0, 2.9, 2.5, 2.0, 1.5, 1.2, 1.0, 0.9])
    assert not gpu_check.loss_fell([3.0, 3.0, 3.1, 3.0, 2.9, 3.0, 3.0, 3.1])
    assert not gpu_check.loss_fell([3.0, float("nan"), 1.0, 0.5])


def test_example_command_and_its_losses(tmp_path: Path) -> None:
    command = gpu_check.example_command(tmp_path)
    assert "configs/gpt_tiny_cpu_auto.yaml" in " ".join(command)  # the README's first command
    assert command[command.index("--trainer.accelerator") + 1] == "gpu"
    assert command[command.index("--trainer.devices") + 1] == "1"
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train_loss,val_loss\n0,19,2.5,\n0,9,3.0,\n0,29,,2.4\n0,39,1.5,\n")
    assert gpu_check.read_losses(metrics) == [3.0, 2.5, 1.5]


def test_profile_and_memory_sections_run_on_cpu(tmp_path: Path) -> None:
    """The script itself, on the CPU with a tiny model (in its own process: its Trainers create a process group,
    which must not outlive them in the test process that forks the other tests' workers)."""
    output = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--device",
            "cpu",
            "--tiny",
            "--cases",
            "2",
            "--skip-example",
            "-o",
            str(output),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out = json.loads(output.read_text())
    assert done.returncode == (0 if out["passed"] else 1), done.stderr[-2000:]
    assert set(out["profile"]) == {"bf16-mixed", "bf16-true"} and all(p["passed"] for p in out["profile"].values())
    assert [r["case"] for r in out["memory"]] == ["bf16-mixed no-recompute m1", "bf16-mixed no-recompute m4"]
    for row in out["memory"]:
        assert row["measured_bytes"] > 0 and row["predicted_bytes"] > 0 and 0.5 < row["ratio"] < 2.0
