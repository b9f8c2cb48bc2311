"""``lightning-galvatron profile`` under torchrun, then ``search`` on its file; argument handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_galvatron.cli.app import build_parser, main
from lightning_galvatron.cli.profile import _resolve_inputs
from lightning_galvatron.model.sources import load_class
from lightning_galvatron.profiles import Profile

REPO = Path(__file__).resolve().parents[1]
TINY = json.dumps({"vocab_size": 16, "seq_length": 8, "n_layer": 2, "n_head": 4, "n_embd": 32})


@pytest.mark.timeout(240)
def test_profile_under_torchrun_then_search(tmp_path, capsys):
    out = tmp_path / "profile.json"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [
        "torchrun", "--standalone", "--nproc-per-node", "2", "--no-python", "lightning-galvatron", "profile",
        "--model", "examples.gpt:GPTModule", "--model-args", TINY,
        "--datamodule", "examples.gpt:ArithmeticDataModule",
        "--datamodule-args", json.dumps({"seq_length": 8, "batch_size": 2}),
        "--budget", "1", "--no-cache", "-o", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Profiled GPTModule: 2 blocks" in done.stdout and "Next: lightning-galvatron search" in done.stdout
    profile = Profile.load(out)
    assert profile.model.num_blocks == 2 and profile.hardware.devices_per_node == 2

    plans = []
    for _ in range(2):
        code = main(
            [
                "search",
                str(out),
                "--world-size",
                "2",
                "--memory-per-device",
                "1GB",
                "--precision",
                "32-true",
                "--json",
                "--no-baselines",
            ]
        )
        assert code == 0
        plans.append(json.loads(capsys.readouterr().out)["plan"])
    assert plans[0] == plans[1]  # deterministic given a profile


def test_profile_without_a_launcher_says_how_to_run(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO)
    code = main(
        [
            "profile",
            "--model",
            "examples.gpt:GPTModule",
            "--datamodule",
            "examples.gpt:ArithmeticDataModule",
            "-o",
            str(tmp_path / "p.json"),
        ]
    )
    assert code == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err


def test_config_sections_and_command_line_overrides(monkeypatch, tmp_path):
    """The YAML is read by LightningCLI: init arguments are checked, class paths are followed, the command line wins."""
    monkeypatch.chdir(REPO)
    classes = ["--model", "examples.gpt:GPTModule", "--datamodule", "examples.gpt:ArithmeticDataModule"]
    args = build_parser().parse_args([
        "profile", "--config", "configs/gpt_tiny_cpu.yaml", *classes, "--model-args", '{"n_layer": 2}', "-o", "x.json",
    ])  # fmt: skip
    inputs = _resolve_inputs(args)
    model, data = inputs.build()
    assert type(model).__name__ == "GPTModule" and type(data).__name__ == "ArithmeticDataModule"
    assert model.hparams.n_layer == 2 and model.hparams.n_embd == 64  # the command line wins over the YAML
    assert (data.hparams.batch_size, data.hparams.seq_length) == (4, 32) and inputs.precision == "32-true"

    with_paths = tmp_path / "class_paths.yaml"
    with_paths.write_text(
        "trainer:\n  precision: bf16-mixed\nmodel:\n  class_path: examples.gpt.GPTModule\n  init_args:\n    "
        "n_layer: 3\n"
        "data:\n  class_path: examples.gpt.ArithmeticDataModule\n"
    )
    inputs = _resolve_inputs(build_parser().parse_args(["profile", "--config", str(with_paths), "-o", "x.json"]))
    model, _ = inputs.build()
    assert model.hparams.n_layer == 3 and inputs.precision == "bf16-mixed"

    typo = build_parser().parse_args(
        [
            "profile",
            "--config",
            "configs/gpt_tiny_cpu.yaml",
            *classes,
            "--model-args",
            '{"n_layerz": 2}',
            "-o",
            "x.json",
        ]
    )
    with pytest.raises(ValueError, match="n_layerz"):  # LightningCLI checks init arguments against the signature
        _resolve_inputs(typo)


def test_class_paths(monkeypatch):
    monkeypatch.chdir(REPO)
    assert load_class("examples.gpt:GPTModule").__name__ == "GPTModule"
    assert load_class("examples/gpt.py:ArithmeticDataModule").__name__ == "ArithmeticDataModule"
    with pytest.raises(ValueError, match="has no 'Nope'"):
        load_class("examples.gpt:Nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_class("no_such_module:Thing")
    code = main(["profile", "-o", "x.json"])
    assert code == 2
