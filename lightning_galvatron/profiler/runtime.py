"""Runtime profiler: how long each block, the optimizer and the whole step take in a running plan.

The model profiler times one block alone; this one measures the plan as it trains, everything
included that the cost model's terms leave out or cannot know on a given machine: the hooks of FSDP2,
DTensor's dispatch under tensor parallelism, relocations, contention between processes sharing cores,
the optimizer and the training loop. :class:`RuntimeProfiler` hooks into the already parallelised
blocks and the optimizer; :meth:`RuntimeProfiler.observation` turns what it saw into a torch-free
:class:`~lightning_galvatron.search.calibration.Observation` that
:func:`~lightning_galvatron.search.calibration.fit_calibration` turns into a calibration of the cost
model.

What is timed (wall clock, per call, on this rank):

* a block's **forward**: from before its first forward pre-hook (relocation of its input, FSDP's
  all-gather) to before its first forward hook (FSDP's reshard is not included);
* a block's **backward**: from the arrival of the gradient of its output (before FSDP's pre-backward
  all-gather) to the arrival of the gradient of its input (after its gradient reduction); a recomputed
  block's replay is part of it. Where one block's input is the previous block's output, the end of the
  one and the start of the other are the same moment, so nothing is counted twice;
* the **optimizer step** (its step pre- and post-hooks);
* the **forward and backward** of a step: from its start to :meth:`optimizer_started`;
* the **step**: from one :meth:`step_started` to the next.

CPU collectives are synchronous, so wall-clock spans are what they cost. On CUDA every boundary
synchronises the device, which serialises the overlap of communication with computation: use the
numbers as an upper bound there.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.runtime.mesh import local_tensor
from lightning_galvatron.runtime.recompute import is_recomputing
from lightning_galvatron.search.calibration import BlockTiming, Observation


class RuntimeProfiler:
    """Times the local blocks, the optimizer and whole steps of a parallelised model.

    Args:
        plan: the plan the model runs.
        blocks: global block index -> the (parallelised) block, for the blocks on this rank.
        optimizers: optimizers whose ``step`` is timed.
        device: synchronised at every boundary when it is a CUDA device.
    """

    def __init__(
        self,
        plan: ParallelPlan,
        blocks: Mapping[int, nn.Module],
        optimizers: Iterable[torch.optim.Optimizer] = (),
        device: torch.device | None = None,
    ) -> None:
        self.plan = plan
        self.blocks = dict(blocks)
        self.device = device or torch.device("cpu")
        self.recording = False
        self._forward: dict[int, list[float]] = defaultdict(list)
        self._backward: dict[int, list[float]] = defaultdict(list)
        self._optimizer: list[float] = []
        self._steps: list[float] = []
        self._forward_backward: list[float] = []
        self._step_start: float | None = None
        self._optimizer_start: float | None = None
        self._opened: dict[int, float] = {}
        self._backward_open: dict[int, list[float]] = defaultdict(list)
        self._handles: list[Any] = []
        self._parameters = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        for index, block in self.blocks.items():
            self._handles.append(
                block.register_forward_pre_hook(self._pre_forward(index), prepend=True, with_kwargs=True)
            )
            self._handles.append(block.register_forward_hook(self._post_forward(index), prepend=True))
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._optimizer_pre_hook))
            self._handles.append(opt.register_step_post_hook(self._optimizer_post_hook))

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Record from the next :meth:`step_started` on (call between steps)."""
        self.recording = True

    def stop(self) -> None:
        """Stop recording; the step in progress is recorded up to the next :meth:`step_started`."""
        self.recording = False

    def step_started(self) -> None:
        """Call at the start of every training step: a step lasts from one call to the next."""
        now = self._now()
        if self._step_start is not None:
            self._steps.append(now - self._step_start)
        self._step_start = now if self.recording else None

    def optimizer_started(self) -> None:
        """Call when the optimizer step begins (Lightning: ``on_before_optimizer_step``); the time from
        the step's start is its forward and backward. Without it the optimizer's step pre-hook is used."""
        if self.recording and self._step_start is not None:
            now = self._now()
            self._forward_backward.append(now - self._step_start)
            self._optimizer_start = now

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hooks
    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _pre_forward(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.recording or is_recomputing(module):
                return
            self._opened[index] = self._now()
            hidden = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
            if hidden is not None and hidden.requires_grad:
                self._on_gradient(hidden, self._backward_done(index))

        return hook

    def _post_forward(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self.recording or is_recomputing(module) or index not in self._opened:
                return
            self._forward[index].append(self._now() - self._opened.pop(index))
            hidden = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)), None)
            if hidden is not None and hidden.requires_grad:
                self._on_gradient(hidden, self._backward_begins(index))

        return hook

    def _on_gradient(self, tensor: torch.Tensor, callback: Any) -> None:
        """Call ``callback(time)`` when ``tensor``'s gradient arrives; callbacks of one tensor share one
        moment, taken by the first hook registered on it.

        A block's input is usually the previous block's output: the end of the later block's backward and
        the start of the earlier one's must be the same moment, or work done between the two hooks (FSDP's
        pre-backward all-gather, registered between them) would be counted in both blocks.
        """
        callbacks = getattr(tensor, "_runtime_profiler_callbacks", None)
        if callbacks is not None:
            callbacks.append(callback)
            return
        callbacks = [callback]
        tensor._runtime_profiler_callbacks = callbacks

        def hook(grad: torch.Tensor) -> None:
            now = self._now()
            for call in callbacks:
                call(now)

        tensor.register_hook(hook)

    def _backward_begins(self, index: int):
        def begins(now: float) -> None:
            self._backward_open[index].append(now)

        return begins

    def _backward_done(self, index: int):
        def done(now: float) -> None:
            if self._backward_open[index]:
                self._backward[index].append(now - self._backward_open[index].pop())

        return done

    def _optimizer_pre_hook(self, *args: Any) -> None:
        self._optimizer_start = self._now()

    def _optimizer_post_hook(self, *args: Any) -> None:
        if self.recording and self._optimizer_start is not None:
            self._optimizer.append(self._now() - self._optimizer_start)
        self._optimizer_start = None

    # ------------------------------------------------------------------ result
    def observation(self, rank: int) -> Observation:
        """What this rank measured, per step (medians over the recorded steps)."""
        steps = len(self._steps)
        timings = []
        for index in sorted(self.blocks):
            forward, backward = self._forward.get(index, []), self._backward.get(index, [])
            if not forward or not backward:
                continue
            timings.append(
                BlockTiming(
                    index=index,
                    forward_s=statistics.median(forward),
                    backward_s=statistics.median(backward),
                    calls_per_step=len(forward) / steps if steps else float(self.plan.micro_batches),
                    parameter_tensors=sum(1 for _ in self.blocks[index].parameters()),
                )
            )
        from torch.distributed.tensor import DTensor

        local = [local_tensor(p) for p in self._parameters]
        return Observation(
            plan=self.plan,
            rank=rank,
            step_s=statistics.median(self._steps) if self._steps else 0.0,
            forward_backward_s=statistics.median(self._forward_backward) if self._forward_backward else 0.0,
            optimizer_s=statistics.median(self._optimizer) if self._optimizer else 0.0,
            optimizer_tensors=len(local),
            optimizer_elements=sum(t.numel() for t in local),
            optimizer_dtensors=sum(isinstance(p, DTensor) for p in self._parameters),
            blocks=tuple(timings),
            compute_slots=_cpu_cores() if self.device.type == "cpu" else None,
        )


def _cpu_cores() -> int:
    """Cores this process may run on (shared by the node's ranks on a CPU machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


__all__ = ["RuntimeProfiler"]
