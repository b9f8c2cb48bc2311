"""Per-call model state (issue 12): Hugging Face models at their defaults hand every block a KV cache.

The cache belongs to one call of the model; re-running a block with it (the profiler at other batch
sizes, recomputation in backward) would append to it again, and joining micro-batch outputs must not
mix caches of different calls.
"""

from __future__ import annotations

import copy

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiler.model import profile_model
from lightning_galvatron.runtime.recompute import apply_recompute
from tests.helpers.hf_models import hf_gpt2, hf_llama
from tests.helpers.training import dataset

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("factory", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_model_profiler_runs_hugging_face_models_at_their_defaults(factory):
    module = factory()
    assert module.model.config.use_cache  # the default: every forward creates a KV cache
    profile = profile_model(module, find_blocks(module), dataset(4)[0:4], batch_sizes=(1, 4))
    (layer_type,) = profile.layer_types
    assert layer_type.seq_length == 8 and layer_type.hidden_size == 32
    assert layer_type.forward_time(4) > 0  # (the per-sample slope of so tiny a block may be lost in noise)


@pytest.mark.parametrize("factory", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_recomputed_blocks_give_the_gradients_of_plain_blocks(factory):
    plain = factory().model
    recomputed = copy.deepcopy(plain)
    for block in find_blocks(recomputed).blocks:
        apply_recompute(block)
    inputs, _ = dataset(4)[0:4]
    for model in (plain, recomputed):
        model(input_ids=inputs, labels=inputs).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def _predict(plan: ParallelPlan | None) -> list:
    world = 1 if plan is None else plan.world_size
    strategy = "auto" if plan is None else GalvatronStrategy(plan=plan, save_plan=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_progress_bar=False)
    return trainer.predict(hf_llama(), DataLoader(dataset(8), batch_size=8 // world))


PREDICT_PLANS = {
    "micro_batches": ParallelPlan.uniform(4, 4, S(tp=2), vocab=S(tp=4), micro_batches=2),
    "pipeline": ParallelPlan.uniform(4, 4, S(tp=2), vocab=S(tp=2), pp=2, schedule="1f1b", micro_batches=2),
}


@pytest.mark.parametrize("name", list(PREDICT_PLANS))
def test_predictions_are_joined_over_micro_batches(pools, name):
    """One ``ModelOutput`` per batch as on one device: logits joined along the batch (each rank keeps DDP's
    samples of it), the per-call cache dropped."""
    (expected,) = _predict(None)
    for rank, outputs in enumerate(pools(4).run(_predict, PREDICT_PLANS[name])):
        (output,) = outputs
        assert type(output) is type(expected)
        torch.testing.assert_close(output.logits, expected.logits[rank::4], atol=1e-5, rtol=0)
        assert output.past_key_values is None
