"""torchmetrics objects logged from the steps (issue 41): under a pipeline with micro-batches, tensor parallelism and
``plan="auto"``, ``trainer.callback_metrics`` hold DDP's values on every rank -- on step (``dist_sync_on_step``) and
on epoch, ``self.log`` and ``self.log_dict(MetricCollection)``, training and validation.

A Hugging Face GPT-2 at its default config (tied embedding and head). Under DDP every rank updates its metrics with
its own samples and ``compute()`` gathers them; under these plans the ranks share one data shard (tp=2 ranks compute
the same outputs; only the last pipeline stage runs the step to its end), and a ``SumMetric`` of tokens shows a
sample counted twice or not at all.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchmetrics import MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.runtime.stage import PipelineUsageError
from lightning_galvatron.strategy.metrics import OneRankPerDataShard, StepMetrics
from lightning_galvatron.strategy.step_logs import LoggedMetric, recording_logs
from tests.helpers.hf_models import HFCausalLM
from tests.helpers.training import _evaluation_data, _trainer, dataset

pytestmark = pytest.mark.timeout(600)

VOCAB = 16
PLANS = {
    "tp2": ParallelPlan.uniform(2, 4, S(tp=2), vocab=S(tp=2)),
    "pp2 1f1b, 2 micro-batches": ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2),
}


class GPT2WithMetrics(HFCausalLM):
    """Next-token accuracy on step (synced) and on epoch in training; accuracy, F1 and a token count in validation."""

    def __init__(self) -> None:
        torch.manual_seed(1234)
        super().__init__("gpt2", vocab_size=VOCAB)
        self.train_acc = MulticlassAccuracy(VOCAB, average="micro", dist_sync_on_step=True)
        self.val_scores = MetricCollection(
            [MulticlassAccuracy(VOCAB, average="micro"), MulticlassF1Score(VOCAB, average="macro")], prefix="val_"
        )
        self.val_tokens = SumMetric()

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        self.train_acc(logits.argmax(-1).flatten(), targets.flatten())
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        self.val_scores.update(logits.argmax(-1).flatten(), targets.flatten())
        self.log_dict(self.val_scores)
        self.val_tokens(torch.tensor(float(targets.numel())))
        self.log("val_tokens", self.val_tokens)


def _fit_and_validate(strategy: object) -> dict[str, float]:
    """Two training steps (one epoch, validated at its end), then ``trainer.validate``: the logged metrics."""
    world = torch.distributed.get_world_size()
    module = GPT2WithMetrics()
    loader = DataLoader(dataset(16), batch_size=8 // world, shuffle=True)
    trainer, _ = _trainer(strategy, world, "32-true", max_steps=-1, max_epochs=1)
    trainer.fit(module, loader, val_dataloaders=_evaluation_data(8, 8 // world))
    logged = {name: float(value) for name, value in trainer.callback_metrics.items()}
    trainer.validate(module, _evaluation_data(8, 8 // world), verbose=False)
    logged |= {f"validate {name}": float(value) for name, value in trainer.callback_metrics.items()}
    if isinstance(trainer.strategy, GalvatronStrategy):
        logged["plan"] = trainer.strategy.plan.to_dict()
    return logged


def _runs(profile_cache: str) -> dict[str, dict[str, float] | str]:
    """Every case in one pool call: DDP, each plan of :data:`PLANS` and ``plan="auto"``; a case that fails gives its
    traceback, and the cases after it do not run (its ranks may have stopped in different places)."""
    cases = {"ddp": "ddp", **{name: GalvatronStrategy(plan=plan, save_plan=False) for name, plan in PLANS.items()}}
    cases["auto"] = GalvatronStrategy(profile_cache=profile_cache, save_plan=False, trials=False)
    logged: dict[str, dict[str, float] | str] = {}
    for name, strategy in cases.items():
        try:
            logged[name] = _fit_and_validate(strategy)
        except Exception:  # noqa: BLE001 - reported by the test of this case
            logged[name] = f"failed: {traceback.format_exc()}"
            return logged | {later: f"not run: {name} failed before it" for later in cases if later not in logged}
    return logged


@pytest.fixture(scope="module")
def runs(pools, tmp_path_factory, linked_profile_cache):
    return pools(2).run(_runs, str(linked_profile_cache(tmp_path_factory.mktemp("metrics") / "cache")))


EXPECTED_NAMES = {
    "train_acc_step",
    "train_acc_epoch",
    "val_MulticlassAccuracy",
    "val_MulticlassF1Score",
    "val_tokens",
    "validate val_MulticlassAccuracy",
    "validate val_MulticlassF1Score",
    "validate val_tokens",
}


@pytest.mark.parametrize("case", [*PLANS, "auto"])
def test_logged_metrics_equal_ddps_on_every_rank(runs, case):
    ddp = runs[0]["ddp"]
    assert EXPECTED_NAMES <= ddp.keys(), ddp.keys()
    assert ddp["val_tokens"] == 16 * 8  # every validation token once
    for rank, result in enumerate(runs):
        assert isinstance(result[case], dict), result[case]
        logged = {name: result[case].get(name) for name in EXPECTED_NAMES}
        assert logged == pytest.approx({name: ddp[name] for name in EXPECTED_NAMES}, abs=1e-6), (rank, case)


def test_a_step_records_a_metric_as_itself_and_options_given_by_position_by_name():
    module = GPT2WithMetrics()
    with recording_logs(module) as logs:
        module.log("val_tokens", module.val_tokens, True)
        module.log("loss", torch.tensor([1.0, 3.0]), False, True)
    assert logs.averaged() == [
        ("val_tokens", LoggedMetric("val_tokens"), {"prog_bar": True}),
        ("loss", 2.0, {"prog_bar": False, "logger": True}),
    ]


def test_a_metric_computed_inside_a_pipelined_step_is_refused_by_name():
    """Its sync would wait for stages that stop before the step's end; the error says what to log instead."""
    module = GPT2WithMetrics()
    with StepMetrics.of(module).running(module, pipeline=True):
        with pytest.raises(PipelineUsageError, match=r"log the Metric object itself \(self.log\(name, metric\)\)"):
            OneRankPerDataShard([1])(torch.zeros(1))
