"""Activation bytes counted, not estimated: every tensor autograd saves, each storage once.

The counter backs every byte figure of the profile (blocks, embedding and head, per degree).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from lightning_galvatron.runtime.mesh import local_tensor


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, per phase, each storage once.

    Use as ``with counter: <forward>``. Storages in ``exclude`` (parameters, buffers, the batch)
    are not counted; when one of them is saved, its phase is noted in ``used`` (which part of the
    model uses which parameters). DTensors are counted by their local shard.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self.excluded = {_storage_key(t) for t in exclude}
        self.seen: set[tuple] = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.used: dict[str, set[tuple]] = defaultdict(set)
        self.phase = "forward"
        # CUDA, for comparison: memory the forward left allocated, and its peak above the start.
        self.allocator_bytes: int | None = None
        self.allocator_peak_bytes: int | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key in self.excluded:
            self.used[self.phase].add(key)
        elif key not in self.seen:
            self.seen.add(key)
            self.bytes[self.phase] += _storage_bytes(tensor)
        # Detached: a saved output packed as itself points back, through its grad_fn, at the node that holds it, a
        # cycle through C++ that the garbage collector cannot free (it kept every profiled block copy, and the
        # parameters its graph reached, alive in the process). Fake tensors (the dry run) stay as they were: freeing
        # their graphs after their fake mode is gone crashed the interpreter at a later collection (torch 2.13).
        return tensor if isinstance(local_tensor(tensor), FakeTensor) else tensor.detach()

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> Any:
    """The storage's identity (not its data pointer: fake tensors have none, so a dry run can count them too)."""
    local = local_tensor(tensor)
    try:
        return StorageWeakRef(local.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: count it by identity
        return ("object", id(local))


def _storage_bytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    try:
        return local.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return local.numel() * local.element_size()


def _per_sample(points: Sequence[tuple[int, float]]) -> float:
    """Bytes per sample from counts at two or more batch sizes: the slope (a batch-independent part drops out)."""
    if len(points) == 1:
        ((b, v),) = points
        return v / b
    (b0, v0), (b1, v1) = points[0], points[-1]
    return max((v1 - v0) / (b1 - b0), 0.0)


def _attribute_to_submodules(block: nn.Module, counter: SavedTensorCounter, roles: Mapping[str, str]) -> list[Any]:
    """Hooks that set the counter's phase to a submodule's role while it runs (``other`` outside them)."""
    counter.phase = "other"
    handles = []
    for name, role in roles.items():
        try:
            sub = block.get_submodule(name)
        except AttributeError:
            continue

        def enter(mod: nn.Module, args: Any, role: str = role) -> None:
            counter.phase = role

        def leave(mod: nn.Module, args: Any, out: Any) -> None:
            counter.phase = "other"

        handles += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]
    return handles


def _output_bytes(out: Any) -> int:
    return sum(_storage_bytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


def _allocated(device: torch.device, reset_peak: bool = False) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)
