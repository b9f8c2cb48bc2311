"""The ranks of one data shard read the same samples, and test/predict are laid out as DDP lays them out (issue 41).

A plan with fewer data shards than ranks (a pipeline's stages, a tensor-parallel group) runs one input on several
ranks. An ``IterableDataset`` that shards itself by ``torch.distributed.get_rank()`` gave each of them its own
samples: stage 0 ran samples [0, 2, 4, 6] while stage 1 computed the loss with the labels of [1, 3, 5, 7], exit 0.
It is now refused at the first batch, on every rank, before any optimizer step; sharded by
``trainer.strategy.distributed_sampler_kwargs`` it trains as under DDP. And ``trainer.predict`` gave every rank all
the samples (a per-rank ``BasePredictionWriter`` wrote each twice); now each rank's return value, written batches and
``batch_indices`` are DDP's, and ``trainer.test`` runs on DDP's samples.

A Hugging Face GPT-2 at its default config (tied embedding and head) on 2 processes, under a 1F1B pipeline with
2 micro-batches and under tensor parallelism with a vocabulary-parallel embedding, each against ``strategy="ddp"``
in the same pool call.
"""

from __future__ import annotations

import re
import tempfile
import traceback
from collections.abc import Callable

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, IterableDataset

from examples.gpt import ArithmeticText
from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.strategy.data import join_batches, rows_of
from tests.helpers.hf_models import HFCausalLM
from tests.helpers.training import SEQ

pytestmark = pytest.mark.timeout(300)

PLANS = {
    "pp2": ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2),
    "tp2": ParallelPlan.uniform(2, 4, S(tp=2), vocab=S(tp=2)),
}
PER_DEVICE = 2
TOL = 1e-5


class GPT2(HFCausalLM):
    """Hugging Face GPT-2 at its defaults, with a test step (the loss, logged as DDP logs it)."""

    def test_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self.model(input_ids=inputs).logits.flatten(0, 1).float(), targets.flatten())
        self.log("test_loss", loss, sync_dist=True)
        return loss


class Tokens(IterableDataset):
    """Windows of ArithmeticText, each rank reading ``range(rank, n, num_replicas)``: by default the usual pattern
    (``torch.distributed``'s rank and world size), or the shards ``shards()`` names."""

    def __init__(self, num_samples: int, shards: Callable[[], dict] | None = None, seed: int = 0) -> None:
        self.data, self.shards = ArithmeticText(num_samples, SEQ, seed=seed), shards

    def __iter__(self):
        shards = self.shards() if self.shards else {"num_replicas": dist.get_world_size(), "rank": dist.get_rank()}
        for index in range(shards["rank"], len(self.data), shards["num_replicas"]):
            yield self.data[index]


class PerRankWriter(BasePredictionWriter):
    """What a per-rank prediction writer would write: logits, batch indices and inputs per batch, or per epoch."""

    def __init__(self, write_interval: str) -> None:
        super().__init__(write_interval)
        self.written: list[tuple] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append((prediction.logits.detach().clone(), list(batch_indices), batch[0].clone()))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.written.append(([p.logits.detach().clone() for p in predictions], batch_indices))


class SeenTestBatches(L.Callback):
    """The samples each rank's test steps got, as callbacks see them."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append(batch[0].clone())


def _gpt2() -> GPT2:
    torch.manual_seed(1234)
    return GPT2()


def _trainer(strategy: object, **kwargs: object) -> L.Trainer:
    return L.Trainer(
        default_root_dir=tempfile.gettempdir(),
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _strategy(name: str) -> object:
    return "ddp" if name == "ddp" else GalvatronStrategy(plan=PLANS[name], save_plan=False, trials=False)


def _train_evaluate_predict(name: str) -> dict:
    """Fit 2 steps on an IterableDataset sharded by the strategy's sampler kwargs, then test and predict (a
    map-style loader with two per-rank writers, and an IterableDataset sharded by rank)."""
    writers = [PerRankWriter("batch"), PerRankWriter("epoch")]
    tested = SeenTestBatches()
    trainer = _trainer(_strategy(name), max_steps=2, callbacks=[*writers, tested])
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Losses())
    model = _gpt2()
    train = Tokens(16, shards=lambda: trainer.strategy.distributed_sampler_kwargs)
    trainer.fit(model, DataLoader(train, batch_size=PER_DEVICE))
    held_out = ArithmeticText(12, SEQ, seed=1)
    test_loss = trainer.test(model, DataLoader(held_out, batch_size=PER_DEVICE), verbose=False)[0]["test_loss"]
    predicted = trainer.predict(model, DataLoader(held_out, batch_size=PER_DEVICE))
    written = [list(w.written) for w in writers]
    from_iterable = trainer.predict(model, DataLoader(Tokens(12, seed=1), batch_size=PER_DEVICE))
    return {
        "losses": losses,
        "test_loss": test_loss,
        "tested": tested.seen,
        "predicted": [p.logits for p in predicted],
        "written": written,
        "from_iterable": [p.logits for p in from_iterable],
    }


def _refusal(run: Callable[[], object]) -> dict:
    """The error ``run`` raised (and whether an optimizer stepped first), or the traceback of another failure."""
    stepped: list[int] = []
    try:
        run(stepped)
    except PlanError as error:
        return {"error": str(error), "optimizer_steps": len(stepped)}
    except Exception:  # noqa: BLE001 - reported by the test
        return {"error": f"failed: {traceback.format_exc()}", "optimizer_steps": len(stepped)}
    return {"error": None, "optimizer_steps": len(stepped)}


class _Steps(L.Callback):
    def __init__(self, stepped: list[int]) -> None:
        self.stepped = stepped

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.stepped.append(trainer.global_step)


def _fit_rank_sharded(name: str, stepped: list[int]) -> None:
    _trainer(_strategy(name), max_steps=2, callbacks=[_Steps(stepped)]).fit(
        _gpt2(), DataLoader(Tokens(16), batch_size=PER_DEVICE)
    )


def _validate_rank_sharded(name: str, stepped: list[int]) -> None:
    _trainer(_strategy(name)).validate(_gpt2(), DataLoader(Tokens(8, seed=1), batch_size=PER_DEVICE), verbose=False)


def _predict_uneven(name: str, stepped: list[int]) -> None:
    """9 samples over 2 ranks in batches of 2: DDP gives rank 0 three batches and rank 1 two."""
    _trainer(_strategy(name)).predict(_gpt2(), DataLoader(ArithmeticText(9, SEQ, seed=1), batch_size=PER_DEVICE))


def _all_cases() -> dict:
    out = {name: _train_evaluate_predict(name) for name in ("ddp", *PLANS)}
    for name in PLANS:
        out[f"refused_fit_{name}"] = _refusal(lambda stepped, name=name: _fit_rank_sharded(name, stepped))
    out["refused_validate_pp2"] = _refusal(lambda stepped: _validate_rank_sharded("pp2", stepped))
    out["refused_predict_tp2"] = _refusal(lambda stepped: _predict_uneven("tp2", stepped))
    return out


_RESULTS: list[dict] = []


def _results(pools) -> list[dict]:
    if not _RESULTS:
        _RESULTS.extend(pools(2).run(_all_cases))
    return _RESULTS


@pytest.mark.parametrize("name", list(PLANS))
def test_a_rank_sharded_iterable_dataset_is_refused_at_the_first_batch_on_every_rank(pools, name):
    for rank_out in _results(pools):
        refused = rank_out[f"refused_fit_{name}"]
        assert refused["error"] is not None and not refused["error"].startswith("failed"), refused["error"]
        assert re.search(r"ranks 0, 1 read one data shard of this plan .* different train batches", refused["error"])
        assert "trainer.strategy.distributed_sampler_kwargs" in refused["error"]
        assert refused["optimizer_steps"] == 0


def test_a_rank_sharded_validation_set_is_refused_too(pools):
    for rank_out in _results(pools):
        error = rank_out["refused_validate_pp2"]["error"]
        assert error is not None and "different validate batches" in error, error


@pytest.mark.parametrize("name", list(PLANS))
def test_an_iterable_dataset_sharded_by_the_sampler_kwargs_trains_as_under_ddp(pools, name):
    def mean_over_ranks(run: str) -> torch.Tensor:  # DDP's ranks log their own batch's loss
        return torch.tensor([rank_out[run]["losses"] for rank_out in _results(pools)]).mean(0)

    torch.testing.assert_close(mean_over_ranks(name), mean_over_ranks("ddp"), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", list(PLANS))
def test_predict_gives_every_rank_its_ddp_samples(pools, name):
    """The return value, ``batch_indices`` and what per-rank writers write (per batch and per epoch) are DDP's."""
    for rank_out in _results(pools):
        ours, ddp = rank_out[name], rank_out["ddp"]
        assert [p.shape for p in ours["predicted"]] == [p.shape for p in ddp["predicted"]]
        for actual, expected in zip(ours["predicted"], ddp["predicted"]):
            torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
        by_batch, by_epoch = ours["written"]
        ddp_by_batch, ddp_by_epoch = ddp["written"]
        assert len(by_batch) == len(ddp_by_batch) and len(by_epoch) == len(ddp_by_epoch) == 1
        for (logits, indices, inputs), (ddp_logits, ddp_indices, ddp_inputs) in zip(by_batch, ddp_by_batch):
            assert indices == ddp_indices and torch.equal(inputs, ddp_inputs)
            torch.testing.assert_close(logits, ddp_logits, atol=1e-4, rtol=0)
        assert by_epoch[0][1] == ddp_by_epoch[0][1]  # batch_indices per dataloader
        for logits, ddp_logits in zip(by_epoch[0][0], ddp_by_epoch[0][0]):
            torch.testing.assert_close(logits, ddp_logits, atol=1e-4, rtol=0)
        # An IterableDataset sharded by rank is what DDP gives each rank, here too.
        assert len(ours["from_iterable"]) == len(ddp["from_iterable"])
        for actual, expected in zip(ours["from_iterable"], ddp["from_iterable"]):
            torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(PLANS))
def test_test_runs_on_ddp_samples(pools, name):
    for rank_out in _results(pools):
        ours, ddp = rank_out[name], rank_out["ddp"]
        assert ours["test_loss"] == pytest.approx(ddp["test_loss"], abs=TOL)
        assert len(ours["tested"]) == len(ddp["tested"])
        for inputs, ddp_inputs in zip(ours["tested"], ddp["tested"]):
            assert torch.equal(inputs, ddp_inputs)


def test_predict_refuses_ranks_with_different_numbers_of_batches(pools):
    for rank_out in _results(pools):
        error = rank_out["refused_predict_tp2"]["error"]
        assert error is not None and "trainer.predict under this plan" in error, error
        assert "rank 0: 3, rank 1: 2" in error


def test_batches_of_different_sizes_are_joined_one_after_another():
    """Equal batches interleave (as a sampler over the plan's shards orders a shard's batch); the last batches of
    predict, of different sizes, follow each other; each rank gets its rows back, strings included."""
    batches = [(torch.tensor([0, 2]), ["a", "c"]), (torch.tensor([1, 3]), ["b", "d"])]
    joined, rows = join_batches(batches, 1)
    assert joined[0].tolist() == [0, 1, 2, 3] and joined[1] == ["a", "b", "c", "d"]
    out = rows_of({"x": joined[0] * 10, "names": joined[1], "mean": torch.tensor(1.0)}, rows, 4)
    assert out["x"].tolist() == [10, 30] and out["names"] == ["b", "d"] and out["mean"].item() == 1.0
    joined, rows = join_batches([(torch.tensor([0, 2]),), (torch.tensor([1]),)], 1)
    assert joined[0].tolist() == [0, 2, 1] and rows_of(joined[0], rows, 3).tolist() == [1]
