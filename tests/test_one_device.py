"""One device (issue 12, symptom 5): ``plan="auto"`` plans without a hardware profile, explicit plans for another
world size are refused, and fit, validate, test and predict work as on one process (checkpoints on one device:
tests/test_checkpoint_resume.py).

Lightning's ``ModelParallelStrategy`` (which ``GalvatronStrategy`` extends) creates a process group of
one rank for ``devices=1``; these tests run in a forked worker of a one-rank pool, so the test process
itself never holds a process group. Tolerances of test_parity_data_parallel (fp32).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiler import profile
from lightning_galvatron.profiles import Profile, ProfileError
from lightning_galvatron.search import evaluate, search
from tests.helpers.pipeline_models import lm_head_first_gpt
from tests.helpers.training import (
    QUICK_TRIALS,
    assert_close_runs,
    dataset,
    run_distributed,
    run_single,
)
from tests.search_profiles import llama_profile
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[1]


def test_readme_command_on_one_device_trains(tmp_path, profile_cache):
    command = [
        sys.executable,
        "examples/gpt.py",
        "fit",
        "--config",
        "configs/gpt_tiny_cpu_auto.yaml",
        "--trainer.devices",
        "1",
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
    ]
    env = {**os.environ, "LIGHTNING_GALVATRON_CACHE": str(profile_cache)}
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=500, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Galvatron: one device: nothing communicates, so no hardware profile is measured" in out.stdout + out.stderr
    assert "Galvatron plan for 1 device (searched" in out.stdout + out.stderr
    assert "Galvatron: measured selection (" in out.stdout + out.stderr  # recomputation and micro-batches, tried
    rows = list(csv.DictReader(next(tmp_path.glob("gpt_tiny_cpu_auto/version_*/metrics.csv")).open()))
    assert len([r for r in rows if r.get("train_loss")]) == 4 and len([r for r in rows if r.get("val_loss")]) == 2


def test_a_one_device_profile_prices_one_device_only():
    """A profile made on one device measured no collectives: it plans one device and refuses to price more."""
    profile = llama_profile()
    one_device = Profile(profile.model, dataclasses.replace(profile.hardware, collectives=()))
    assert search(one_device, 1, "200GB", global_batch_size=8).plan.world_size == 1
    with pytest.raises(ProfileError, match=r"measured no collectives \(it was made on one device\)"):
        search(one_device, 8, "200GB", global_batch_size=8)


def _auto_plan_with_tight_memory(cache_dir: str) -> dict:
    """A budget below what the plain plan (no recomputation, one micro-batch) needs: the search must save memory."""
    module = lm_head_first_gpt()
    measured = profile(
        module, find_blocks(module), dataset(8)[0:8], precision="32-true", devices_per_node=1, cache=cache_dir
    )
    plain, saving = (
        evaluate(
            measured,
            ParallelPlan.uniform(1, 4, S(recompute=r), micro_batches=m),
            global_batch_size=8,
            precision="32-true",
            optimizer="adamw",
        ).peak_memory_bytes
        for r, m in ((False, 1), (True, 2))
    )
    budget = int((plain + saving) / 2)
    strategy = GalvatronStrategy(memory_budget=budget, profile_cache=cache_dir, save_plan=False, trials=QUICK_TRIALS)
    result = run_distributed(strategy=strategy, model=lm_head_first_gpt, evaluate=True)
    return dict(result=result, plan=strategy.plan, budget=budget, plain=plain)


def test_auto_plan_on_one_device_saves_memory_and_matches_one_process(pools, profile_cache):
    out = pools(1).run(_auto_plan_with_tight_memory, str(profile_cache))[0]
    plan = out["plan"]
    assert plan.world_size == 1 and out["budget"] < out["plain"]
    assert plan.micro_batches > 1 or any(s.recompute for s in plan.layers), plan
    expected = run_single(model=lm_head_first_gpt, evaluate=True)
    assert_close_runs(out["result"], expected, **FP32_TOL)
    assert out["result"].val_loss == pytest.approx(expected.val_loss, abs=1e-5)
    assert out["result"].test_loss == pytest.approx(expected.test_loss, abs=1e-5)
    torch.testing.assert_close(out["result"].predictions, expected.predictions, atol=1e-5, rtol=0)


def test_plan_for_another_world_size_names_both_sizes(pools):
    plan = ParallelPlan.uniform(4, 4, S())
    with pytest.raises(AssertionError, match="the plan is for world_size=4 but 1 device is running; launch with 4"):
        pools(1).run(run_distributed, plan)
