"""``plan="auto"`` (issue 6): profile, search and apply inside setup; bad input; the CLI agrees."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiler import profile
from lightning_galvatron.search import evaluate
from lightning_galvatron.selection import Selection
from tests.helpers.training import QUICK_TRIALS, assert_close_runs, dataset, run_distributed, run_single, tiny_gpt
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[1]


def _auto_where_ddp_does_not_fit(cache_dir: str) -> dict:
    """Measure the profile the strategy will use, pick a budget between ZeRO-3's and DDP's needs, train."""
    world = dist.get_world_size()
    module = tiny_gpt()
    measured = profile(
        module, find_blocks(module), dataset(8)[0:2], precision="32-true", devices_per_node=world, cache=cache_dir
    )
    peaks = {
        name: evaluate(
            measured,
            ParallelPlan.uniform(world, 4, S(dp_type=name)),
            global_batch_size=8,
            precision="32-true",
            optimizer="adamw",
        ).peak_memory_bytes
        for name in ("ddp", "zero3")
    }
    budget = int((peaks["ddp"] + peaks["zero3"]) / 2)
    strategy = GalvatronStrategy(memory_budget=budget, profile_cache=cache_dir, save_plan=False, trials=QUICK_TRIALS)
    result = run_distributed(strategy=strategy)
    plan = strategy.plan
    chosen_peak = evaluate(measured, plan, precision="32-true", optimizer="adamw").peak_memory_bytes
    return dict(result=result, plan=plan, budget=budget, peaks=peaks, chosen_peak=chosen_peak)


def test_auto_plan_fits_a_budget_that_excludes_ddp_and_matches_one_process(pools, profile_cache):
    out = pools(4).run(_auto_where_ddp_does_not_fit, str(profile_cache))[0]
    assert out["peaks"]["zero3"] < out["budget"] < out["peaks"]["ddp"]
    plan = out["plan"]
    assert plan != ParallelPlan.uniform(4, 4, S(), global_batch_size=8)  # pure DDP does not fit
    assert out["chosen_peak"] <= out["budget"]
    assert_close_runs(out["result"], run_single(), **FP32_TOL)


def test_budget_nothing_fits_names_the_smallest(pools, profile_cache):
    strategy_kwargs = dict(memory_budget="1KB", profile_cache=str(profile_cache), save_plan=False)
    with pytest.raises(AssertionError, match=r"automatic plan search failed: .*smallest budget"):
        pools(4).run(run_distributed, strategy_kwargs=strategy_kwargs, plan="auto")


def test_corrupt_cache_is_reprofiled_with_a_warning(pools, profile_cache):
    kwargs = dict(
        strategy_kwargs=dict(memory_budget="1GB", profile_cache=str(profile_cache), save_plan=False, trials=False),
        plan="auto",
        max_steps=1,
    )
    pools(4).run(run_distributed, **kwargs)
    (cached,) = list(profile_cache.glob("*.json"))
    cached.write_text("{not json")
    warnings = pools(4).run(_run_collecting_warnings, kwargs)
    assert any(str(cached) in w for w in warnings[0])
    json.loads(cached.read_text())  # rewritten


def _run_collecting_warnings(kwargs: dict) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_distributed(**kwargs)
    return [str(w.message) for w in caught]


def _example(config: str, cache: Path, logs: Path, *extra: str) -> str:
    command = [
        sys.executable,
        "examples/gpt.py",
        "fit",
        "--config",
        config,
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.max_steps",
        "4",
        "--trainer.logger.init_args.save_dir",
        str(logs),
        *extra,
    ]
    env = {**_env(), "LIGHTNING_GALVATRON_CACHE": str(cache)}
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout + out.stderr


def _env() -> dict:
    import os

    return dict(os.environ)


def test_example_auto_caches_its_profile_and_the_cli_search_agrees(tmp_path, profile_cache):
    """Second run reuses the profile and the measured selection; `lightning-galvatron search` on the saved profile
    gives the plan the strategy's search gave (the first candidate of the trials, which chose among them)."""
    first = _example("configs/gpt_tiny_cpu_auto.yaml", profile_cache, tmp_path / "logs")
    assert re.search(r"Profile: lightning_galvatron.profiler: 32-true on 4 x cpu \(gloo\); measured in [\d.]+ s", first)
    assert "Galvatron: measured selection (" in first
    second = _example("configs/gpt_tiny_cpu_auto.yaml", profile_cache, tmp_path / "logs")
    assert re.search(r"Profile: .*; cached \([\d.]+ s to load\)", second)
    assert "Galvatron: measured selection (from the cache" in second
    run = sorted((tmp_path / "logs" / "gpt_tiny_cpu_auto").glob("version_*"))[-1]
    chosen = ParallelPlan.load(run / "galvatron_plan.json")
    (cached,) = (profile_cache / "selections").glob("*.json")
    selection = Selection.from_dict(json.loads(cached.read_text()))
    assert selection.plan == chosen and chosen in [t.plan for t in selection.trials]
    searched = tmp_path / "searched.json"
    command = [
        sys.executable,
        "-m",
        "lightning_galvatron.cli",
        "search",
        str(run / "galvatron_profile.json"),
        "--world-size",
        "4",
        "--memory-per-device",
        "2GB",
        "--global-batch-size",
        str(chosen.global_batch_size),
        "--precision",
        "32-true",
        "-o",
        str(searched),
    ]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=120)
    assert selection.trials[0].name == "searched" and ParallelPlan.load(searched) == selection.trials[0].plan
