"""What every phase of the model profiler shares: block types, the precision it profiles in, restoring the module.

Also the batch helpers (slicing or tiling the example batch to a profiled size).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_galvatron.model.discovery import model_class
from lightning_galvatron.runtime.mesh import reduce_over_ranks
from lightning_galvatron.search.cost import resolve_precision

Step = Callable[[nn.Module, Any], torch.Tensor]

#: Timed repetitions per point at least / at most; :func:`quiet_seconds` summarises them.
MIN_REPEATS, MAX_REPEATS = 3, 20
#: Aim for this much timed work per point (seconds): tiny blocks get more repetitions.
TARGET_POINT_S = 0.05
#: The quantile of a point's repeated timings that the profile keeps. Not the median: where processes share
#: cores, the noise (another process holding this one's core) only ever adds time, and the median moves with it
#: while the low quantile stays near what training measures (docs/performance.md, "Measurements behind the
#: profiler's and the selection's rules"). On a GPU the repeats barely differ, and either is the same.
TIMING_QUANTILE = 0.1


def quiet_seconds(samples: Iterable[float]) -> float:
    """The :data:`TIMING_QUANTILE` of repeated timings of one point (interpolated between the nearest two)."""
    timings = list(samples)
    if not timings:
        raise ValueError("no timings to summarise")
    return float(np.quantile(timings, TIMING_QUANTILE))


def quiet_over_ranks(samples: Sequence[Sequence[float]]) -> list[float]:
    """:func:`quiet_seconds` of each column of ``samples`` (a row per repeat), the quietest over the ranks when a
    process group is initialised. Collective.

    Where ranks share cores, whether one rank's few repeats catch a moment with a core to itself is luck: profiling
    the benchmark GPT four times on 4 processes over 2 cores, rank 0's own timings fitted a block's forward at
    0.30 to 1.86 ms per sample (each rank's quiet end at batch 4 lay between 3.1 and 8.5 ms in one profile), the
    quietest rank's at 0.51 to 0.82 ms. On GPUs the ranks' quiet ends barely differ.
    """
    columns = np.array(samples, dtype=float).reshape(len(samples), -1)
    quiet = [quiet_seconds(columns[:, j]) for j in range(columns.shape[1])]
    return reduce_over_ranks(quiet, dist.ReduceOp.MIN)


def agreed_repeats(warm_s: float, target_s: float) -> int:
    """Timed repetitions of a point that took ``warm_s`` once: enough for about ``target_s`` of them, between
    :data:`MIN_REPEATS` and :data:`MAX_REPEATS`; in a process group the most any rank wants, so that every rank
    makes the same number (the timed calls may hold collectives). Collective when a group is initialised."""
    repeats = int(min(max(target_s / max(warm_s, 1e-9), MIN_REPEATS), MAX_REPEATS))
    return int(reduce_over_ranks([repeats], dist.ReduceOp.MAX)[0])


def block_signature(block: nn.Module) -> tuple:
    """What makes two blocks the same type for profiling: class and parameter names, shapes, dtypes."""
    cls = model_class(block)
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters())
    return (f"{cls.__module__}.{cls.__qualname__}", params)


@dataclass(frozen=True)
class _PrecisionConfig:
    flag: str
    autocast_dtype: torch.dtype | None  # bf16-mixed: compute under autocast
    cast_dtype: torch.dtype | None  # bf16-true and bf16-mixed: the weights the blocks compute with are bf16
    compute_bytes: int

    @classmethod
    def of(cls, precision: str) -> _PrecisionConfig:
        flag = resolve_precision(precision).name
        if flag == "32-true":
            return cls(flag, None, None, 4)
        if flag == "bf16-mixed":
            # As the runtime trains it: FSDP2 gathers bf16 weights (MixedPrecisionPolicy) and autocast runs on top.
            return cls(flag, torch.bfloat16, torch.bfloat16, 2)
        if flag == "bf16-true":
            return cls(flag, None, torch.bfloat16, 2)
        raise ValueError(f"the profiler supports precision 32-true, bf16-mixed and bf16-true, got {precision!r}")

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def place(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        dtype = self.cast_dtype if self.cast_dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=device, dtype=dtype)


@dataclass
class _BlockType:
    name: str
    first: int
    members: list[int] = field(default_factory=list)


def _block_types(blocks: Sequence[nn.Module]) -> list[_BlockType]:
    by_signature: dict[tuple, _BlockType] = {}
    for i, block in enumerate(blocks):
        signature = block_signature(block)
        if signature not in by_signature:
            by_signature[signature] = _BlockType(model_class(block).__name__, i)
        by_signature[signature].members.append(i)
    types = list(by_signature.values())
    names = [t.name for t in types]
    for k, t in enumerate(types):  # same class with other shapes: number them
        if names.count(t.name) > 1:
            t.name = f"{t.name}#{names[:k].count(t.name)}"
    return types


@contextlib.contextmanager
def _profiling(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    types: Sequence[_BlockType],
    device: torch.device,
    prec: _PrecisionConfig,
) -> Iterator[None]:
    """Run the module for profiling and leave no trace: modes, gradients and parameter storage restored.

    The parameters that run (everything outside the blocks, and the first block of each type) are
    placed on ``device`` in the profiled dtype by swapping their ``.data``; the originals come back.
    """
    running = set(range(len(blocks))) - {i for t in types for i in t.members if i != t.first}
    skipped = {id(p) for i, b in enumerate(blocks) if i not in running for p in (*b.parameters(), *b.buffers())}
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if id(t) not in skipped}
    originals = {key: t.data for key, t in tensors.items()}
    grads = {p: p.grad for p in module.parameters()}
    modes = {m: m.training for m in module.modules()}
    try:
        for key, t in tensors.items():
            t.data = prec.place(originals[key], device)
        module.train()
        yield
    finally:
        for key, t in tensors.items():
            t.data = originals[key]
        for p, g in grads.items():
            p.grad = g
        for m, mode in modes.items():
            m.training = mode


# ---------------------------------------------------------------------------------------------- helpers
def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _detach(value: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _module_device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _batch_size(batch: Any) -> int:
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not leaves:
        raise ValueError("the example batch holds no tensors with a batch dimension")
    return int(leaves[0].shape[0])


def _resize_tensor(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` samples, tiling the tensor along dim 0 when it has fewer."""
    if size <= tensor.shape[0]:
        return tensor[:size]
    reps = math.ceil(size / tensor.shape[0])
    return tensor.repeat(reps, *([1] * (tensor.dim() - 1)))[:size]


def _resize_batch(batch: Any, size: int) -> Any:
    """The batch with ``size`` samples: tensors whose first dimension is the batch are sliced or tiled."""
    current = _batch_size(batch)
    return tree_map(
        lambda t: (
            _resize_tensor(t, size) if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == current else t
        ),
        batch,
    )


def _to_device(batch: Any, device: torch.device, prec: _PrecisionConfig) -> Any:
    return tree_map(lambda t: prec.place(t, device) if isinstance(t, torch.Tensor) else t, batch)
