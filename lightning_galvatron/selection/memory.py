"""Peak memory of one training step on this rank, for trials.

On CUDA: ``torch.cuda.max_memory_allocated`` over the step. On CPU there is no such counter, so the step runs
under the PyTorch profiler with ``profile_memory=True``, which reports every allocation and free of the CPU
allocator: the peak is what is live at the step's start -- parameters (local shards), gradients, optimizer
states and buffers, each storage once -- plus the largest running sum of what the step allocates minus what it
frees. The profiler does not report frees of memory allocated before it started; a trial's step starts and ends
with the gradients released, so little of that is freed in the step, and what is makes the peak err high.
Memory outside PyTorch's allocator (gloo's buffers, the interpreter) is not counted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

_MARKER_BYTES = 7_777_773  # an allocation of this odd size marks the start of the measured step


def step_peak_bytes(
    step: Callable[[], None], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], device: torch.device
) -> int:
    """Run ``step`` once and return the peak bytes it needed on this rank."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints a line to stderr at every profiler start and stop unless told otherwise before its first use.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    live = live_bytes(module, optimizers)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
        del marker
        step()
    events = [
        e
        for e in profiler.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    ]
    events.sort(key=lambda e: e.start_ns())
    start = next((i for i, e in enumerate(events) if e.nbytes() == _MARKER_BYTES), None)
    if start is None:
        raise RuntimeError("the memory profile lost its marker allocation")
    running = peak = 0
    for event in events[start + 2 :]:  # after the marker's allocation and its free
        running += event.nbytes()
        peak = max(peak, running)
    return live + peak


def live_bytes(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes of the distinct storages of parameters (local shards), gradients, buffers and optimizer states."""
    from torch.distributed.tensor import DTensor

    seen: dict[tuple[str, int], int] = {}

    def add(t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.is_meta:
            return
        storage = local.untyped_storage()
        if storage.data_ptr():
            seen[(local.device.type, storage.data_ptr())] = storage.nbytes()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for b in module.buffers():
        add(b)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return sum(seen.values())


__all__ = ["live_bytes", "step_peak_bytes"]
