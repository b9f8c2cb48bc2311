"""The Lightning feature matrix (issue 41): Trainer features in combination, under every plan kind, as under DDP.

One LightningModule turns on at once what real projects use -- ``accumulate_grad_batches=2``, clipping by norm, an
AdamW with two param groups (other weight decay and learning rate) and a per-step LR scheduler with
``LearningRateMonitor``, dict batches (``input_ids``, ``attention_mask``, labels padded with ``-100`` at varied
lengths, to one fixed length) and the model's own token-mean loss, a torchmetrics ``Metric`` logged in
``validation_step`` and ``test_step``, ``val_check_interval`` in the middle of an accumulation window with sanity
steps, ``ModelCheckpoint(save_last=True)`` on the validation loss and an ``EarlyStopping`` that stops the fit, an
``IterableDataset`` that shards itself by ``trainer.strategy.distributed_sampler_kwargs`` for training and
map-style datasets for the rest (a ``LightningDataModule``), then ``trainer.test(ckpt_path="best")`` and
``trainer.predict`` with a per-rank ``BasePredictionWriter`` -- on a tied model (Hugging Face GPT-2 at its default
config: the embedding is the head) and an untied one (Hugging Face Llama, ``tie_word_embeddings=False``, grouped-query
attention).

Plan kinds (:func:`cases`): ``plan="auto"`` (profiled, searched and tried as by default), a 2-stage 1F1B pipeline
with 2 micro-batches, tp=2 in every block with a vocabulary-parallel embedding/head (with 2 micro-batches: one data
shard holds 2 DDP ranks' samples, and a token-mean loss trains as DDP's only with one DDP rank's samples per loss, see
``token_means.py``; its checkpoints saved as one file), and ZeRO-3 with recomputation. Each runs on 2 processes
against ``strategy="ddp"`` on the same data and seed, in one pool call per model: per-batch training losses,
first-step gradients and final parameters (:data:`FP32_TOL`, relative to how far training moved them), every logged
value (``trainer.callback_metrics`` and what the logger received: losses, the metric, both groups' learning rates),
where the callbacks saved and stopped, test metrics from the best checkpoint, and each rank's predictions, written
batches and ``batch_indices``. A combination the runtime refuses by design (:data:`REFUSED`: one-file checkpoints
under a pipeline) must be refused in ``setup``, before any batch, by its message, on every rank.

Found by this matrix (and fixed): steps that read ``self.lr_schedulers()`` failed in setup (profiling, trials, the
pipeline's trace ran them before the optimizers existed: ``lightning_galvatron/strategy/setup_steps.py``), and
``plan="auto"`` chose DDP over 2 micro-batches for these token-mean losses, which then trained differently from DDP
(``token_means`` search option).
"""

from __future__ import annotations

import os
import re
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.search.report import plan_summary
from tests.helpers.hf_models import HFCausalLM
from tests.helpers.training import (
    QUICK_TRIALS,
    RunResult,
    _LossRecorder,
    _mean_over_ranks,
    _merge_over_ranks,
    assert_close_runs,
    gather_full_state,
)
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(600)

WORLD, PER_DEVICE, SEQ, VOCAB, LAYERS = 2, 2, 8, 16, 2
#: 8 batches per rank under DDP; EarlyStopping ends the fit after the second validation (batch 6, step 3).
TRAIN_SAMPLES, HELD_OUT = 32, 8
MAX_STEPS, VAL_EVERY, CLIP = 5, 3, 0.5
IGNORE = -100
#: Predictions (logits of the best checkpoint) agree to rounding.
PREDICTION_TOL = 1e-4
MODELS = ("gpt2", "llama")


# ---------------------------------------------------------------------------------------------- data
class PaddedTokens(Dataset):
    """Token sequences of varied lengths (3 to ``SEQ``), padded to ``SEQ``: a dict per sample, labels ``-100``
    where padded (a fixed length, so that tensor-parallel ranks can gather their samples)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, SEQ + 1, (num_samples,), generator=generator).tolist()
        self.tokens = torch.randint(1, VOCAB, (num_samples, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(SEQ) < self.lengths[index]).long()
        input_ids = self.tokens[index] * mask
        return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, IGNORE)}


class ShardedStream(IterableDataset):
    """A stream that shards itself as a DistributedSampler would: by ``trainer.strategy.distributed_sampler_kwargs``
    (read when iterated: the plan is known only after the strategy's setup)."""

    def __init__(self, data: Dataset, shards: Callable[[], dict[str, int]]) -> None:
        self.data, self.shards = data, shards

    def __iter__(self):
        shards = self.shards()
        for index in range(shards["rank"], len(self.data), shards["num_replicas"]):
            yield self.data[index]


class TokenData(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        stream = ShardedStream(PaddedTokens(TRAIN_SAMPLES, 0), lambda: self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(stream, batch_size=PER_DEVICE)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(PaddedTokens(HELD_OUT, 1), batch_size=PER_DEVICE)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(PaddedTokens(HELD_OUT, 2), batch_size=PER_DEVICE)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(PaddedTokens(HELD_OUT, 3), batch_size=PER_DEVICE)


# ---------------------------------------------------------------------------------------------- the module
class FeatureLM(HFCausalLM):
    """A Hugging Face causal LM trained on dict batches with its own loss (a mean over the labelled tokens)."""

    def __init__(self, family: str) -> None:
        torch.manual_seed(1234)
        super().__init__(family, vocab_size=VOCAB, seq_length=SEQ, layers=LAYERS)
        self.val_acc = MulticlassAccuracy(VOCAB, average="micro", ignore_index=IGNORE)
        self.test_acc = MulticlassAccuracy(VOCAB, average="micro", ignore_index=IGNORE)

    def _accuracy(self, metric: MulticlassAccuracy, logits: torch.Tensor, labels: torch.Tensor) -> None:
        metric.update(logits[:, :-1].argmax(-1).flatten(), labels[:, 1:].flatten())  # next-token predictions

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def validation_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.log("val_loss", out.loss, sync_dist=True)
        self._accuracy(self.val_acc, out.logits, batch["labels"])
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.log("test_loss", out.loss, sync_dist=True)
        self._accuracy(self.test_acc, out.logits, batch["labels"])
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]  # norms and biases: no weight decay, half the rate
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


# ---------------------------------------------------------------------------------------------- callbacks
class RecordingLogger(Logger):
    """What a logger receives (every rank's; Lightning's loggers write rank 0's)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        # The strategy's own measurements (galvatron/...) have no DDP counterpart.
        kept = {name: float(value) for name, value in metrics.items() if not name.startswith("galvatron/")}
        if kept:
            self.metrics.append((step, kept))


class PerRankWriter(BasePredictionWriter):
    """A per-rank prediction writer: each batch's logits, ``batch_indices`` and inputs, as a file per rank would."""

    def __init__(self) -> None:
        super().__init__("batch")
        self.written: list[tuple[torch.Tensor, list[int], torch.Tensor]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append((prediction.detach().float().clone(), list(batch_indices), batch["input_ids"].clone()))


class Progress(L.Callback):
    """Batches started (sanity validation, training) and optimizer steps: a refusal must come before any."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.batches += 1

    def on_validation_batch_start(self, *args: Any) -> None:
        self.batches += 1


# ---------------------------------------------------------------------------------------------- one run
def _strategy(case: dict[str, Any], cache_dir: str) -> Any:
    if case.get("ddp"):
        return "ddp"
    if case.get("auto"):
        return GalvatronStrategy(profile_cache=cache_dir, save_plan=False, trials=QUICK_TRIALS)
    sharded = case.get("save_distributed_checkpoint", True)
    return GalvatronStrategy(plan=case["plan"], save_plan=False, save_distributed_checkpoint=sharded)


def run_features(family: str, case: dict[str, Any], cache_dir: str, progress: Progress, checkpoints: str) -> dict:
    """Fit, test (best checkpoint) and predict with every feature on; what each rank saw and logged."""
    module, data = FeatureLM(family), TokenData()
    initial = {k: v.detach().float().clone() for k, v in module.state_dict().items()} if dist.get_rank() == 0 else None
    recorder, writer, logger = _LossRecorder(), PerRankWriter(), RecordingLogger()
    checkpoint = ModelCheckpoint(dirpath=checkpoints, monitor="val_loss", save_last=True, save_top_k=1)
    stopping = EarlyStopping("val_loss", min_delta=10.0, patience=1)  # stops at the second validation
    trainer = L.Trainer(
        default_root_dir=tempfile.gettempdir(),
        accelerator="cpu",
        devices=WORLD,
        strategy=_strategy(case, cache_dir),
        max_steps=MAX_STEPS,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        val_check_interval=VAL_EVERY,  # in the middle of the second accumulation window
        log_every_n_steps=1,
        num_sanity_val_steps=1,
        logger=logger,
        callbacks=[recorder, writer, progress, LearningRateMonitor("step"), checkpoint, stopping],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    # The strategy's own measurements (galvatron/...) have no DDP counterpart.
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith("galvatron/")}
    result = RunResult(
        losses=_mean_over_ranks(recorder.losses),
        grads=_merge_over_ranks(recorder.grads),
        initial=initial,
        state=gather_full_state(trainer.lightning_module),
    )
    callbacks = {
        "global_step": trainer.global_step,
        "stopped_at": stopping.stopped_epoch,
        "stopping_wait": stopping.wait_count,
        "best_score": float(checkpoint.best_model_score),
        "best": os.path.basename(checkpoint.best_model_path),
        "saved": sorted(os.listdir(checkpoint.dirpath)),
    }
    tested = trainer.test(module, datamodule=data, ckpt_path="best", verbose=False)[0]
    predicted = trainer.predict(module, datamodule=data)
    return {
        "run": result,
        "fitted": fitted,
        "logged": logger.metrics,
        "callbacks": callbacks,
        "tested": tested,
        "predicted": [p.detach().float().clone() for p in predicted],
        "written": writer.written,
        "plan": getattr(trainer.strategy, "plan", None),
    }


def run_matrix(family: str, cases: dict[str, dict[str, Any]], directory: str) -> dict[str, Any]:
    """Every case of one model in one pool call. A refusal gives its message and how far the run got; another
    failure its traceback, and the cases after it do not run (ranks may have stopped in different places)."""
    out: dict[str, Any] = {}
    for name, case in cases.items():
        progress = Progress()
        try:
            checkpoints = os.path.join(directory, "checkpoints", f"{family}-{name}")
            out[name] = run_features(family, case, os.path.join(directory, "profiles"), progress, checkpoints)
        except PlanError as error:
            out[name] = {"refused": f"PlanError: {error}", "batches": progress.batches}
        except Exception:  # noqa: BLE001 - reported by the test of this case
            out[name] = f"failed: {traceback.format_exc()}"
            return out | {later: f"not run: {name} failed before it" for later in cases if later not in out}
    return out


# ---------------------------------------------------------------------------------------------- the matrix
PP2_1F1B = ParallelPlan.uniform(WORLD, LAYERS, S(), pp=2, schedule="1f1b", micro_batches=2)


def cases() -> dict[str, dict[str, Any]]:
    """The plan kinds (tp2 saves its checkpoints as one file, gathered on rank 0, which the test loads back), and
    a pipeline with one-file checkpoints, which is refused (rank 0 holds only the first stage)."""
    return {
        "ddp": {"ddp": True},
        "pp2_1f1b": {"plan": PP2_1F1B},
        "tp2": {
            "plan": ParallelPlan.uniform(WORLD, LAYERS, S(tp=2), vocab=S(tp=2), micro_batches=2),
            "save_distributed_checkpoint": False,
        },
        "zero3_recompute": {
            "plan": ParallelPlan.uniform(WORLD, LAYERS, S(dp_type="zero3", recompute=True), vocab=S(dp_type="zero3"))
        },
        "pp2_1f1b_one_file": {"plan": PP2_1F1B, "save_distributed_checkpoint": False},
        "auto": {"auto": True},  # last: a failure stops the cases after it (its ranks may be out of step)
    }


CASES = [name for name in cases() if name != "ddp"]
_ONE_FILE_UNDER_A_PIPELINE = r"save_distributed_checkpoint=False gathers the model on rank 0, which holds only pipeline"
#: (model, case) -> what the refusal says, for combinations the runtime cannot run exactly.
REFUSED: dict[tuple[str, str], str] = {(model, "pp2_1f1b_one_file"): _ONE_FILE_UNDER_A_PIPELINE for model in MODELS}
_RESULTS: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def matrix_dirs(tmp_path_factory, linked_profile_cache) -> str:
    """``profiles/`` (this module's profile cache, with the session's cluster measurements) and ``checkpoints/``."""
    directory = tmp_path_factory.mktemp("feature-matrix")
    linked_profile_cache(directory / "profiles")
    return str(directory)
    return str(linked_profile_cache(tmp_path_factory.mktemp("feature-profiles")))


def _matrix(pools, directory: str, family: str) -> list[dict[str, Any]]:
    """Every rank's results of every case of ``family``, computed once (the model's first test pays for all)."""
    if family not in _RESULTS:
        results = pools(WORLD).run(run_matrix, family, cases(), directory, timeout=300)
        if any(isinstance(r, str) for r in results[0].values()):
            pools(WORLD).shutdown()  # a failed case may leave ranks out of step
        _RESULTS[family] = results
    return _RESULTS[family]


def _outcomes(pools, directory: str, family: str, case: str) -> list[tuple[dict, dict]]:
    """(the case's results, DDP's) per rank."""
    ranks = _matrix(pools, directory, family)
    for rank_out in ranks:
        for name in ("ddp", case):
            outcome = rank_out[name]
            assert not isinstance(outcome, str), outcome
            assert "refused" not in outcome, outcome["refused"]
    plan = ranks[0][case]["plan"]
    print(f"{family} {case}: {plan_summary(plan) if plan is not None else 'DDP'}")  # shown when a check fails
    return [(rank_out[case], rank_out["ddp"]) for rank_out in ranks]


PARAMS = [pytest.param(m, c, id=f"{m}-{c}") for m in MODELS for c in CASES if (m, c) not in REFUSED]


@pytest.mark.parametrize("family, case", [pytest.param(m, c, id=f"{m}-{c}") for m, c in REFUSED])
def test_refused_in_setup_by_message(pools, matrix_dirs, family, case):
    """On every rank, with the message of :data:`REFUSED`, before any batch (sanity validation included) ran."""
    for rank_out in _matrix(pools, matrix_dirs, family):
        outcome = rank_out[case]
        assert isinstance(outcome, dict) and "refused" in outcome, outcome
        assert re.search(REFUSED[(family, case)], outcome["refused"]), outcome["refused"]
        assert outcome["batches"] == 0, f"refused after {outcome['batches']} batches, not in setup"


@pytest.mark.parametrize("family, case", PARAMS)
def test_training_matches_ddp(pools, matrix_dirs, family, case):
    """Per-batch losses (DDP: the mean of its ranks' token means), first-step gradients (accumulated over the
    window, before clipping) and final parameters; the callbacks saved and stopped where DDP's did."""
    outcomes = _outcomes(pools, matrix_dirs, family, case)
    ours, ddp = outcomes[0]
    expected = ddp["run"]
    # EarlyStopping ended the fit at the second validation, before max_steps.
    assert len(expected.losses) == 2 * 3 and ddp["callbacks"]["global_step"] == 3 < MAX_STEPS
    norm = torch.cat([g.flatten() for g in expected.grads.values()]).norm()
    assert norm > 2 * CLIP, f"clipping is not active (gradient norm {float(norm):.3g})"
    assert_close_runs(ours["run"], expected, **FP32_TOL)
    for own, theirs in outcomes:
        assert own["callbacks"] | {"best_score": None} == theirs["callbacks"] | {"best_score": None}
        assert own["callbacks"]["best_score"] == pytest.approx(theirs["callbacks"]["best_score"], abs=1e-5)


@pytest.mark.parametrize("family, case", PARAMS)
def test_logged_values_match_ddp(pools, matrix_dirs, family, case):
    """``trainer.callback_metrics`` after the fit (training and validation loss, the validation metric, the learning
    rate) and everything the logger received (with ``LearningRateMonitor``'s rates of both param groups), on every
    rank."""
    outcomes = _outcomes(pools, matrix_dirs, family, case)
    for own, theirs in outcomes:
        assert {"train_loss", "val_loss", "val_acc", "lr"} <= theirs["fitted"].keys(), theirs["fitted"].keys()
        assert own["fitted"] == pytest.approx(theirs["fitted"], abs=1e-5)
        assert [step for step, _ in own["logged"]] == [step for step, _ in theirs["logged"]]
        for (_, values), (step, expected) in zip(own["logged"], theirs["logged"]):
            assert values == pytest.approx(expected, abs=1e-5), step
    names = {name for _, values in outcomes[0][1]["logged"] for name in values}
    assert {"lr-AdamW/pg1", "lr-AdamW/pg2", "train_loss", "val_loss", "val_acc"} <= names, names


@pytest.mark.parametrize("family, case", PARAMS)
def test_test_and_predict_match_ddp(pools, matrix_dirs, family, case):
    """``trainer.test`` from the best checkpoint: its metrics; ``trainer.predict``: each rank's return value, and
    what its writer wrote per batch (logits, ``batch_indices``, inputs), as DDP's rank."""
    outcomes = _outcomes(pools, matrix_dirs, family, case)
    for own, theirs in outcomes:
        assert own["tested"] == pytest.approx(theirs["tested"], abs=1e-5)
        assert [p.shape for p in own["predicted"]] == [p.shape for p in theirs["predicted"]]
        for actual, expected in zip(own["predicted"], theirs["predicted"]):
            torch.testing.assert_close(actual, expected, atol=PREDICTION_TOL, rtol=0)
        assert len(own["written"]) == len(theirs["written"])
        for (logits, indices, inputs), (ddp_logits, ddp_indices, ddp_inputs) in zip(own["written"], theirs["written"]):
            assert indices == ddp_indices and torch.equal(inputs, ddp_inputs)
            torch.testing.assert_close(logits, ddp_logits, atol=PREDICTION_TOL, rtol=0)
