"""The calibration workflow as a user runs it: ``lightning-galvatron calibrate`` on every rank trains the probe
plans briefly, times them with the runtime profiler and writes the fitted calibration (rank 0)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from examples.gpt import GPTModule
from lightning_galvatron.cli.app import main
from lightning_galvatron.cli.calibrate import probe_plans
from lightning_galvatron.model.shapes import architecture_of_module
from lightning_galvatron.producers.analytic import analytic_profile
from lightning_galvatron.search import evaluate
from lightning_galvatron.search.coefficients import Calibration
from tests.helpers.training import TINY_GPT
from tests.search_profiles import synthetic_profile

MODEL = dict(TINY_GPT)
DATA = {"batch_size": 4, "seq_length": MODEL["seq_length"], "train_samples": 64, "val_samples": 8}


def _main_after_a_trainer(argv: list[str]) -> int:
    """The command in a process where a Trainer ran before: Lightning's environment deleted ``WORLD_SIZE`` when it
    tore down (the process group still knows the world)."""
    os.environ.pop("WORLD_SIZE", None)
    return main(argv)


def test_calibrate_command_fits_the_probe_plans(pools, tmp_path):
    with torch.device("meta"):
        module = GPTModule(**MODEL)
    reference = synthetic_profile(np.random.default_rng(0), 4)
    profile = analytic_profile(architecture_of_module(module), reference, MODEL["seq_length"])[0]
    profile.save(tmp_path / "profile.json")
    output = tmp_path / "calibration.json"
    argv = [
        "calibrate",
        str(tmp_path / "profile.json"),
        "--model",
        "examples.gpt:GPTModule",
        "--model-args",
        json.dumps(MODEL),
        "--datamodule",
        "examples.gpt:ArithmeticDataModule",
        "--datamodule-args",
        json.dumps(DATA),
        "--accelerator",
        "cpu",
        "--warmup-steps",
        "1",
        "--timed-steps",
        "2",
        "-o",
        str(output),
    ]
    assert pools(2).run(_main_after_a_trainer, argv, timeout=600) == [0, 0]
    calibration = Calibration.load(output)
    # Every block each rank held in every probe was timed: a whole model per rank without a pipeline, half with.
    probes = probe_plans(profile, 2, DATA["batch_size"] * 2)
    assert set(probes) == {"probe", "probe-4-micro-batches", "probe-pp2"}
    assert calibration.observations == sum(2 * plan.num_layers // plan.pp for plan in probes.values())
    assert calibration.step_overhead_s >= 0 and calibration.optimizer_s_per_tensor >= 0
    priced = evaluate(profile, probes["probe"], precision="32-true", calibration=calibration)
    assert priced.step_time_s > 0
