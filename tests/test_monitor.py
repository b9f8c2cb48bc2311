"""The plan, its prediction and measured step time reach the user's loggers (issue 16): CSVLogger's ``hparams.yaml``
and ``metrics.csv``, for a searched plan and for a given one (priced with the cached profile, or said not to be)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch.distributed as dist
import yaml
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import evaluate
from tests.helpers.training import dataset, tiny_gpt

pytestmark = pytest.mark.timeout(600)
GIVEN = ParallelPlan(world_size=2, layers=(S(dp_type="zero3"), S(tp=2, recompute=True), S(), S(dp_type="zero2")))


class FileTakingLogger(CSVLogger):
    """A logger that takes files, by LitLogger's ``log_file`` (a user's own logger can offer the same)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.files: dict[str, str] = {}

    def log_file(self, path: str) -> None:
        self.files[Path(path).name] = Path(path).read_text()


def _train(save_dir: str, plan: Any, cache: Any, accumulate: int = 1) -> dict[str, Any] | None:
    """Three optimizer steps with a CSVLogger (and a file-taking logger) logging every step; rank 0 reports."""
    loggers = [CSVLogger(save_dir, name="csv"), FileTakingLogger(save_dir, name="files")]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=GalvatronStrategy(plan=plan, profile_cache=cache),
        logger=loggers,
        max_steps=3,
        log_every_n_steps=1,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(tiny_gpt(), DataLoader(dataset(64), batch_size=4))
    log_dir = trainer.log_dir  # collective
    if dist.get_rank() != 0:
        return None
    return {"log_dir": log_dir, "files": loggers[1].files, "files_hparams": loggers[1].log_dir}


def _read(log_dir: str) -> tuple[dict, list[dict[str, str]]]:
    hparams = yaml.safe_load((Path(log_dir) / "hparams.yaml").read_text())
    with (Path(log_dir) / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("galvatron/step_time_s")]
    return hparams, rows


def test_plan_prediction_and_measurements_reach_the_csv_logger(pools, tmp_path, profile_cache):
    pool, cache = pools(2), str(profile_cache)

    # plan="auto": hparams.yaml records the searched plan (not "plan: auto"), metrics.csv both step times
    searched = pool.run(_train, str(tmp_path / "auto"), "auto", cache)[0]
    hparams, rows = _read(searched["log_dir"])
    galvatron = hparams["galvatron"]
    # searched (measured selection may have chosen another of the search's candidates)
    assert galvatron["plan_source"].startswith("searched") and hparams["n_layer"] == 4  # next to the module's own
    plan = ParallelPlan.from_dict(galvatron["plan"])
    assert plan == ParallelPlan.load(Path(searched["log_dir"]) / "galvatron_plan.json")
    assert plan.global_batch_size == 8
    assert len(rows) == 3
    for row in rows:
        assert float(row["galvatron/step_time_s"]) > 0 and float(row["galvatron/peak_memory_bytes"]) > 0
        assert float(row["galvatron/samples_per_s"]) == pytest.approx(8 / float(row["galvatron/step_time_s"]))
        assert float(row["galvatron/predicted_step_time_s"]) == pytest.approx(galvatron["predicted"]["step_time_s"])
    # every logger got the hyperparameters; the one that takes files got the plan and the profile
    assert yaml.safe_load((Path(searched["files_hparams"]) / "hparams.yaml").read_text())["galvatron"] == galvatron
    assert json.loads(searched["files"]["galvatron_plan.json"]) == plan.to_dict()
    profile = Profile.from_json(searched["files"]["galvatron_profile.json"])
    assert galvatron["profile"]["blocks"] == 4 and galvatron["profile"]["source"] == profile.source

    # a given plan is priced with the profile the search cached, by the same cost model
    given = pool.run(_train, str(tmp_path / "given"), GIVEN, cache, 2)[0]
    hparams, rows = _read(given["log_dir"])
    galvatron = hparams["galvatron"]
    assert galvatron["plan_source"] == "a ParallelPlan"
    budget = galvatron["memory_budget_bytes"]
    expected = evaluate(
        profile, GIVEN, global_batch_size=8, precision="32-true", optimizer="adamw", memory_budget_bytes=budget
    )
    assert galvatron["predicted"]["step_time_s"] == pytest.approx(expected.step_time_s)
    assert galvatron["predicted"]["peak_memory_bytes"] == pytest.approx(expected.peak_memory_bytes)
    assert len(rows) == 3
    for row in rows:  # an optimizer step is two batches of the plan (accumulate_grad_batches=2)
        assert float(row["galvatron/predicted_step_time_s"]) == pytest.approx(2 * expected.step_time_s)
        predicted_peak = float(row["galvatron/predicted_peak_memory_bytes"])
        assert predicted_peak == pytest.approx(expected.stages[0].peak_memory_bytes)
        assert float(row["galvatron/samples_per_s"]) == pytest.approx(16 / float(row["galvatron/step_time_s"]))

    # without a cached profile: no prediction, and the reason; measured values are still logged
    unpriced = pool.run(_train, str(tmp_path / "unpriced"), GIVEN, False)[0]
    hparams, rows = _read(unpriced["log_dir"])
    assert hparams["galvatron"]["predicted"] == {"missing": "profile_cache=False, so no profile is looked up"}
    assert len(rows) == 3 and not any(row.get("galvatron/predicted_step_time_s") for row in rows)
    assert sorted(unpriced["files"]) == ["galvatron_plan.json"]
