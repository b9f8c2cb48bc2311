"""The ddp layers' gradient sums overlap with backward whatever the order in which gradients become ready.

The reducer first buckets parameters in an assumed order; here that order is the worst one: the first bucket holds a
weight tied between the embedding and the head (its gradient is complete only when backward reaches the embedding,
at its very end) and a parameter no step uses. Launched strictly in that order, no bucket could start before
backward ends. After the first step the buckets follow the order the gradients actually became ready, as rank 0 saw
it (here the ranks run their blocks in different orders), and the gradients still equal PyTorch DDP's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_galvatron.runtime.gradient_sync import GradientReducer

VOCAB, HIDDEN = 16, 8


class _TiedModel(nn.Module):
    """Embedding tied to the head, a block used twice, an unused layer; odd ranks run the blocks in reverse."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.unused = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        a, b, c = self.blocks if dist.get_rank() % 2 == 0 else reversed(self.blocks)
        h = c(torch.tanh(b(torch.tanh(b(torch.tanh(a(h)))))))  # b twice: one gradient, summed in its node
        return h @ self.embedding.weight.t()


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(10 * step + rank))
    return model(tokens).square().mean()


def _train_two_steps() -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _TiedModel()
    reducer = GradientReducer(bucket_bytes=1, first_bucket_bytes=1)  # one parameter per bucket: nine buckets
    for block in model.blocks:
        reducer.add(block.parameters(), dist.group.WORLD)
    # Added last among the blocks, so bucketed first: the tied weight and the unused layer block every other bucket.
    reducer.add([model.embedding.weight, *model.unused.parameters()], dist.group.WORLD)
    reducer.build()
    reference = nn.parallel.DistributedDataParallel(_TiedModel(), find_unused_parameters=True)
    launched, errors = [], []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        _loss(model, rank, step).backward()
        _loss(reference, rank, step).backward()
        launched.append(reducer.launched_during_backward)
        for (name, p), q in zip(model.named_parameters(), reference.module.parameters()):
            if name.startswith("unused"):
                errors.append(0.0 if p.grad is None else float("inf"))  # no rank used it: no gradient, as on one
            else:  # DDP averages, the runtime sums
                errors.append((p.grad - q.grad * world).abs().max().item())
        reducer.optimizer_stepped()
    reducer.remove()
    return {"launched": launched, "buckets": len(reducer.params), "max_error": max(errors), "rank": rank}


def test_buckets_follow_the_ready_order_after_the_first_step_and_sum_as_ddp(pools):
    for result in pools(2).run(_train_two_steps):
        assert result["max_error"] < 1e-5, result
        if result["rank"] == 0:
            # First step: the tied weight's bucket goes first, so nothing starts before backward ends. Then every
            # bucket but the unused layer's two starts while backward still runs.
            assert result["launched"] == [0, 7, 7], result
