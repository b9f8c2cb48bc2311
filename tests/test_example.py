"""The README's main example, run exactly as a user runs it: Lightning launches 4 processes."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_main_example_prints_the_plan_and_the_loss_falls(tmp_path):
    command = [
        sys.executable,
        "examples/gpt.py",
        "fit",
        "--config",
        "configs/gpt_tiny_cpu.yaml",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
    ]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (
        "Galvatron plan for 4 devices (given: configs/gpt_tiny_plan.json), global batch 16" in out.stdout + out.stderr
    )
    metrics = next(tmp_path.glob("gpt_tiny_cpu/version_*/metrics.csv"))
    losses = [float(row["train_loss"]) for row in csv.DictReader(metrics.open()) if row.get("train_loss")]
    assert len(losses) >= 5
    assert losses[-1] < 0.9 * losses[0], losses
