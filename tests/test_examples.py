"""The drop-in examples (issue 8), each run from its YAML with one command, as a user runs it.

Lightning launches the 4 processes (one pytest process per example run, as Lightning's own tests
do). Runs are short (a few steps): the point is that the commands work as documented; the parity
tests check the numbers.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


def _run(script: str, config: str, logs: Path, cache: Path, *extra: str) -> str:
    command = [
        sys.executable,
        script,
        "fit",
        "--config",
        config,
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(logs),
        *extra,
    ]
    env = {**os.environ, "LIGHTNING_GALVATRON_CACHE": str(cache)}
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout + out.stderr


def _metrics(logs: Path, name: str) -> list[dict[str, str]]:
    (path,) = logs.glob(f"{name}/version_*/metrics.csv")
    return list(csv.DictReader(path.open()))


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def test_hugging_face_causal_lm_fine_tune(tmp_path, profile_cache):
    out = _run(
        "examples/hf_causal_lm.py",
        "configs/hf_causal_lm.yaml",
        tmp_path / "logs",
        profile_cache,
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "6",
        "--trainer.log_every_n_steps",
        "2",
    )
    assert "Galvatron plan for 4 devices" in out
    rows = _metrics(tmp_path / "logs", "hf_causal_lm")
    assert len(_column(rows, "train_loss")) == 3 and len(_column(rows, "val_loss")) == 1


def test_encoder_classifier_before_and_after_differ_in_one_line_and_log_the_same_curve(tmp_path, profile_cache):
    before = yaml.safe_load((REPO / "configs/encoder_classifier_ddp.yaml").read_text())
    after = yaml.safe_load((REPO / "configs/encoder_classifier_galvatron.yaml").read_text())
    assert (before["trainer"].pop("strategy"), after["trainer"].pop("strategy")) == ("ddp", "galvatron")
    assert before == after

    short = ("--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.log_every_n_steps", "2")
    runs = {}
    for name in ("ddp", "galvatron"):
        logs = tmp_path / name
        out = _run(
            "examples/encoder_classifier.py",
            f"configs/encoder_classifier_{name}.yaml",
            logs,
            profile_cache,
            *short,
        )
        runs[name] = _metrics(logs, "encoder_classifier")
        assert ("Galvatron plan for 4 devices" in out) == (name == "galvatron")
    for key in ("train_loss", "train_acc", "val_loss", "val_acc"):
        ddp, galvatron = _column(runs["ddp"], key), _column(runs["galvatron"], key)
        assert len(ddp) == len(galvatron) > 0, key
        assert galvatron == pytest.approx(ddp, abs=1e-5), key
