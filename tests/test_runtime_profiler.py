"""The runtime profiler times blocks, the optimizer and steps of a running model (one process, no groups)."""

from __future__ import annotations

import time

import torch
from torch import nn

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiler.runtime import RuntimeProfiler


class Sleepy(nn.Module):
    """A block whose forward takes at least ``seconds`` and whose backward takes at least twice that."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return _SlowBackward.apply(self.linear(x), 2 * self.seconds)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def test_blocks_optimizer_and_steps_are_timed_without_double_counting():
    blocks = nn.ModuleList([Sleepy(0.02), Sleepy(0.04)])
    optimizer = torch.optim.SGD(blocks.parameters(), lr=0.1)
    profiler = RuntimeProfiler(ParallelPlan.uniform(1, 2, global_batch_size=4), dict(enumerate(blocks)), [optimizer])

    def gather_before_backward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        # Like FSDP's pre-backward all-gather: work hooked on block 0's output after the profiler's hook,
        # before block 1's input gradient hook. It belongs to block 0's backward, not to block 1's too.
        output.register_hook(lambda grad: time.sleep(0.06))

    blocks[0].register_forward_hook(gather_before_backward)
    profiler.start()
    backwards = []
    for _ in range(3):
        profiler.step_started()
        x = torch.randn(4, 8, requires_grad=True)
        for block in blocks:
            x = block(x)
        started = time.perf_counter()
        x.sum().backward()
        backwards.append(time.perf_counter() - started)
        profiler.optimizer_started()
        optimizer.step()
        optimizer.zero_grad()
    profiler.stop()
    profiler.step_started()
    profiler.remove()
    observation = profiler.observation(rank=0)
    first, second = observation.blocks
    assert 0.02 <= first.forward_s < 0.04 <= second.forward_s < 0.08
    assert 0.10 <= first.backward_s and 0.08 <= second.backward_s < 0.14
    # The shared boundary is counted once: counted twice, the 0.06 s gathered there would be in both blocks. (The
    # blocks' times are medians over the steps, the whole backward one step's: compared with slack, not exactly.)
    assert first.backward_s + second.backward_s < max(backwards) + 0.03
    assert first.calls_per_step == second.calls_per_step == 1.0
    assert first.parameter_tensors == 2 and observation.optimizer_tensors == 4
    assert observation.optimizer_elements == 2 * (64 + 8)
    # A step holds its forward, backward and optimizer (medians of each over the steps: a little slack).
    assert observation.step_s + 0.01 >= observation.forward_backward_s + observation.optimizer_s > 0.18
