"""Token-mean losses over dynamically padded batches (labels -100, what Hugging Face models compute) train as under
DDP: the mean over DDP ranks of each rank's token mean. Checked on Hugging Face GPT-2 (its default architecture,
tied embedding and head, at a small size) against a single-process DDP reference; plans that cannot be exact warn,
and dynamic padding where blocks gather samples from ranks of other lengths is refused naming the padding."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan, PlanError
from tests.helpers.training import _mean_over_ranks, _trainer, assert_parameters_moved_alike, gather_full_state

WORLD, PER_DEVICE, LAYERS, STEPS, MAX_LEN = 2, 4, 2, 3, 8


class PaddedText(torch.utils.data.Dataset):
    """Random token sequences of varied lengths (2 to ``MAX_LEN``)."""

    def __init__(self, num_samples: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, MAX_LEN + 1, (num_samples,), generator=generator)
        self.samples = [torch.randint(1, 16, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.samples[index]


def pad_to_longest(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dynamic padding, as ``DataCollatorForLanguageModeling`` pads: to the batch's longest sample."""
    longest = max(len(s) for s in samples)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample)], attention_mask[row, : len(sample)] = sample, 1
    labels = input_ids.masked_fill(~attention_mask.bool(), -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PaddedGPT2(L.LightningModule):
    """The user code of a Hugging Face causal LM: the model's own loss, a mean over the labelled tokens."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(
            vocab_size=16, n_positions=MAX_LEN, n_embd=32, n_layer=LAYERS, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def padded_gpt2() -> PaddedGPT2:
    torch.manual_seed(1234)
    return PaddedGPT2()


def ddp_reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """DDP by hand: each rank's batch (Lightning's ``DistributedSampler(shuffle=True, seed=0)``) padded on its own,
    its token-mean loss, the mean of those over ranks; AdamW. Returns losses, initial and final states."""
    module = padded_gpt2()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    optimizer = module.configure_optimizers()
    loaders = [
        iter(DataLoader(PaddedText(), PER_DEVICE, sampler=DistributedSampler(PaddedText(), WORLD, rank, seed=0),
                        collate_fn=pad_to_longest))
        for rank in range(WORLD)
    ]  # fmt: skip
    losses = []
    for _ in range(STEPS):
        loss = sum(module.model(**next(loader)).loss for loader in loaders) / WORLD
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, initial, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _train(plan: ParallelPlan, steps: int = STEPS) -> tuple[list[float], dict | None, list[str]]:
    """In every worker: fit the plan on dynamically padded batches. Returns the losses (mean over ranks), the full
    state (rank 0) and the warnings about token means."""
    loader = DataLoader(PaddedText(), batch_size=PER_DEVICE, shuffle=True, collate_fn=pad_to_longest)
    trainer, recorder = _trainer(GalvatronStrategy(plan=plan, save_plan=False), WORLD, "32-true", max_steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(padded_gpt2(), loader)
    said = [str(w.message) for w in caught if "ignored tokens" in str(w.message)]
    return _mean_over_ranks(recorder.losses), gather_full_state(trainer.lightning_module), said


def _cases() -> dict[str, object]:
    pipeline = dict(world_size=WORLD, layers=(S(),) * LAYERS, pp=2, schedule="1f1b")
    out: dict[str, object] = {
        "pp2 1f1b m2": _train(ParallelPlan(**pipeline, micro_batches=2)),
        "zero3 recompute": _train(ParallelPlan.uniform(WORLD, LAYERS, S(dp_type="zero3", recompute=True))),
        "pp2 m4": _train(ParallelPlan(**pipeline, micro_batches=4), steps=1),
        "tp2 with vocab tp2": _train(ParallelPlan.uniform(WORLD, LAYERS, S(tp=2)), steps=1),
    }
    try:  # each rank pads its own samples (vocab dp=2) to their longest: 7 positions on one rank, 6 on the other
        _train(ParallelPlan(world_size=WORLD, layers=(S(tp=2),) * LAYERS, vocab=S()), steps=1)
        out["tp2 blocks, dynamic padding"] = "trained"
    except PlanError as error:
        out["tp2 blocks, dynamic padding"] = str(error)
    return out


def test_token_mean_losses_train_as_ddp_or_warn(pools):
    results = pools(WORLD).run(_cases)[0]
    losses, initial, expected = ddp_reference()
    for name in ("pp2 1f1b m2", "zero3 recompute"):
        actual_losses, state, said = results[name]
        torch.testing.assert_close(torch.tensor(actual_losses), torch.tensor(losses), atol=1e-5, rtol=0, msg=name)
        assert_parameters_moved_alike(state, expected, initial, rtol=2e-2, mean_rtol=2e-3)
        assert not said, (name, said)
    # Each micro-batch holds half a DDP rank's samples; without micro-batches one loss holds both ranks' samples.
    assert "1/2 of one DDP rank's samples" in results["pp2 m4"][2][0]
    assert "the samples of 2 DDP ranks at once" in results["tp2 with vocab tp2"][2][0]
    assert "give the plan micro_batches=2" in results["tp2 with vocab tp2"][2][0]
    refusal = results["tp2 blocks, dynamic padding"]
    assert "batches have sequences of different lengths" in refusal and "Pad every batch to one fixed length" in refusal


def test_the_search_for_token_means_offers_only_plans_with_one_ddp_rank_per_micro_batch():
    """``plan="auto"`` searches with ``token_means`` when the batch has labels -100 (it chose DDP over 2 micro-batches
    for a Llama, whose losses then differed from DDP's by 1.6e-2): the plan, the baselines and every trial candidate
    have ``micro_batches = pp x vocab tp``; without it, some do not."""
    from lightning_galvatron.plan.rules import token_mean_problem
    from lightning_galvatron.search import search
    from lightning_galvatron.search.candidates import diverse_candidates
    from tests.test_search_cost import tiny_profile

    profile = tiny_profile().with_num_blocks(8)
    arguments = dict(world_size=4, memory_budget_bytes="64GB", global_batch_size=16, precision="bf16-mixed")

    def plans(**knobs: object) -> list[ParallelPlan]:
        result = search(profile, **arguments, **knobs)
        offered = [b.estimate.plan for b in result.baselines if b.estimate is not None]
        candidates = diverse_candidates(profile, result, {**arguments, **knobs}, max_candidates=20)
        return [result.plan, *offered, *(c.plan for c in candidates)]

    def exact(plan: ParallelPlan) -> bool:
        return token_mean_problem(plan.pp, plan.micro_batches, plan.vocab.tp) is None

    restricted = plans(token_means=True)
    assert all(exact(plan) for plan in restricted), [plan for plan in restricted if not exact(plan)]
    assert any(plan.pp > 1 for plan in restricted) and any(plan.vocab.tp > 1 for plan in restricted)
    assert not all(exact(plan) for plan in plans())
