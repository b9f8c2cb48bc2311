"""The ddp layers' gradient reducer against gradients computed on one process.

Each rank sees its own data; the reducer must leave every rank with the sum over the ranks, whether it
reduces during backward (overlapped, small buckets so that several are in flight) or once after
deferred backward passes, and whichever ranks used a parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_galvatron.runtime.gradient_sync import GradientReducer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    return model(x).square().mean()


def _reduce_across_ranks(micro_steps: int, defer: bool, bucket_bytes: int) -> list[torch.Tensor]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    reducer = GradientReducer(bucket_bytes=bucket_bytes)
    for layer in model:
        reducer.add(layer.parameters(), dist.group.WORLD)
    reducer.build()
    if defer:
        with reducer.deferred():
            for step in range(micro_steps):
                _loss(model, rank, step).backward()
        reducer.reduce()
    else:
        for step in range(micro_steps):
            _loss(model, rank, step).backward()
    reducer.remove()

    reference = _model()  # one process: the sum of every rank's gradients
    for r in range(world):
        for step in range(micro_steps):
            _loss(reference, r, step).backward()
    return [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())]


def test_overlapped_reduction_sums_gradients_over_ranks(pools):
    for errors in pools(4).run(_reduce_across_ranks, 1, False, 256):  # 256 bytes: one bucket per weight
        assert max(errors) < 1e-6


def test_deferred_backward_passes_reduce_once_to_the_accumulated_sum(pools):
    for errors in pools(4).run(_reduce_across_ranks, 3, True, 2**20):
        assert max(errors) < 1e-6


def _partly_unused() -> dict[str, object]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    used, sometimes, never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    reducer = GradientReducer()
    reducer.add([*used.parameters(), *sometimes.parameters(), *never.parameters()], dist.group.WORLD)
    reducer.build()
    x = torch.ones(2, 4)
    out = used(x)
    if rank == 1:  # only rank 1's data reaches this layer
        out = sometimes(out)
    out.sum().backward()
    reducer.remove()
    return {
        "used": used.weight.grad.clone(),
        "sometimes": None if sometimes.weight.grad is None else sometimes.weight.grad.clone(),
        "never": never.weight.grad,
    }


def test_a_gradient_missing_on_some_ranks_is_summed_and_one_missing_everywhere_stays_none(pools):
    results = pools(4).run(_partly_unused)
    for result in results:
        assert torch.equal(result["used"], results[0]["used"])
        assert result["sometimes"] is not None and torch.equal(result["sometimes"], results[1]["sometimes"])
        assert result["never"] is None


def _second_backward_before_the_step() -> tuple[bool, str]:
    """A second synced backward before the optimizer step would sum the already summed gradients again: refused.
    After the step, the next backward is fine again."""
    rank = dist.get_rank()
    model = _model()
    reducer = GradientReducer()
    for layer in model:
        reducer.add(layer.parameters(), dist.group.WORLD)
    reducer.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: reducer.optimizer_stepped())
    _loss(model, rank, 0).backward()
    message = ""
    try:
        _loss(model, rank, 1).backward()
    except RuntimeError as error:
        message = str(error)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    _loss(model, rank, 2).backward()  # a new step: no error
    optimizer.step()
    reducer.remove()
    return bool(message), message


def test_a_second_backward_before_the_optimizer_step_is_refused_with_what_to_do(pools):
    for refused, message in pools(4).run(_second_backward_before_the_step):
        assert refused and "call backward once" in message and "accumulate_grad_batches" in message
