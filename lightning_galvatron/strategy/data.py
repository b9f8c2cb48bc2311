"""Batch semantics: every optimizer step trains on exactly the samples DDP would.

DDP on ``W`` devices with a DataLoader of ``batch_size=b`` trains each step on ``b * W`` samples:
one contiguous block of the ``DistributedSampler`` permutation. Under a plan, only the ``dp`` data
shards of the input layout read distinct samples (tensor-parallel ranks share theirs), so each
shard must read ``b * W / dp`` samples per step. With the sampler set to ``dp`` replicas, the union
of the shards' batches is again the same contiguous block of the same permutation, so the loss
curve matches DDP's. This module rebuilds the DataLoader with that batch size, and takes the example
batch that ``plan="auto"`` profiles with and pipelines trace the step on.

Two contracts keep this honest (:class:`DataShards`):

- **The ranks of one data shard must read the same samples** (tensor-parallel ranks and the pipeline stages of a
  shard compute one loss on one input). A sampler is told the plan's shards (``distributed_sampler_kwargs``); an
  ``IterableDataset`` that shards itself by ``torch.distributed.get_rank()`` is not, so the first training and
  validation batch of every run is compared (a digest) over each shard, and a difference is refused on every rank.
- **Test and predict are laid out as DDP lays them out**: every rank reads DDP's samples (prediction writers write
  per-rank files; code gathers ranks' outputs), the step runs on the shard's batch (its ranks' batches joined) and
  each rank keeps the outputs of its own samples.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import BatchSampler, DataLoader

from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.runtime.apply import input_shard, input_shard_group

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
from lightning_galvatron.runtime.mesh import MeshCache
from lightning_galvatron.runtime.relocate import tensor_digest
from lightning_galvatron.runtime.structure import is_kv_cache
from lightning_galvatron.runtime.sync import values_differing_within_groups

#: Stages whose loaders give every rank DDP's samples (the others: the plan's data shards).
DDP_LAYOUT_STAGES = (RunningStage.TESTING, RunningStage.PREDICTING)


def shard_batch_size(global_batch_size: int, num_shards: int) -> int:
    if global_batch_size % num_shards:
        raise ValueError(
            f"the global batch size {global_batch_size} cannot be split evenly over {num_shards} data shards; "
            f"use a multiple of {num_shards} (DataLoader batch_size x devices, or global_batch_size=)"
        )
    return global_batch_size // num_shards


def loader_batch_size(dataloader: object) -> int | None:
    """Samples per batch of a DataLoader, also of Lightning's prediction loaders (which batch through a
    wrapper around the user's ``BatchSampler`` that records the indices)."""
    size = getattr(dataloader, "batch_size", None)
    if size is None and isinstance(getattr(dataloader, "batch_sampler", None), _IndexBatchSamplerWrapper):
        size = getattr(dataloader.batch_sampler._batch_sampler, "batch_size", None)
    return size


def example_batch(loader: object) -> object:
    """The loader's first batch, without moving the random state training will use (a shuffling sampler draws
    its seed from it)."""
    with torch.random.fork_rng():
        return next(iter(loader))  # type: ignore[call-overload]


def rebatch(dataloader: object, batch_size: int) -> object:
    """A copy of ``dataloader`` that yields ``batch_size`` samples per batch, same sampler and options.

    Lightning's prediction loader is its own fresh copy whose index-recording wrapper holds the batch
    sampler: the wrapper is given a batch sampler of the new size (the loader cannot be re-made with it).
    """
    if not isinstance(dataloader, DataLoader) or loader_batch_size(dataloader) == batch_size:
        return dataloader
    wrapper = dataloader.batch_sampler
    if isinstance(wrapper, _IndexBatchSamplerWrapper) and type(wrapper._batch_sampler) is BatchSampler:
        inner = wrapper._batch_sampler
        wrapper._batch_sampler = BatchSampler(inner.sampler, batch_size, inner.drop_last)
        wrapper.batch_size = batch_size
        return dataloader
    if dataloader.batch_size is None or type(dataloader.batch_sampler) not in (BatchSampler, type(None)):
        raise ValueError(
            f"the plan needs {batch_size} samples per data shard and step, but this DataLoader batches through a "
            f"custom {type(dataloader.batch_sampler).__name__}; give it batch_size= (and a sampler) instead"
        )
    args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, dataloader.sampler)
    arg_names = getattr(dataloader, "__pl_saved_arg_names", ())
    if "batch_size" in arg_names[: len(args)]:
        args = list(args)
        args[arg_names.index("batch_size")] = batch_size
    else:
        kwargs["batch_size"] = batch_size
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


def first_dataloader(trainer: Trainer) -> Any:
    """The DataLoader of the stage being set up (its first one), to take an example batch from."""
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }[trainer.state.fn]
    loaders = loop._data_source.dataloader()
    while isinstance(loaders, (list, tuple, dict)):
        loaders = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0]
    return loaders


def batch_index(args: tuple, kwargs: dict) -> int:
    """The ``batch_idx`` of a Lightning step's arguments (0 where the step takes none)."""
    index = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
    return index if isinstance(index, int) else 0


def sampler_kwargs(plan: ParallelPlan | None, rank: int, world_size: int, stage: RunningStage | None) -> dict[str, int]:
    """How ``stage``'s loaders are sharded: over the plan's data shards, or as DDP shards them (test and predict, and
    while there is no plan yet: ``plan="auto"`` profiling, pricing a given plan)."""
    if plan is None or stage in DDP_LAYOUT_STAGES:
        return {"num_replicas": world_size, "rank": rank}
    num_shards, shard = input_shard(plan, rank)
    return {"num_replicas": num_shards, "rank": shard}


class DataShards:
    """The data shards of a plan's input layout, seen from one rank: what its loaders read and how its steps get it.

    Collective where it compares or gathers (every rank calls it in the same order, as Lightning's loops do).
    """

    def __init__(self, plan: ParallelPlan, rank: int, meshes: MeshCache, device: torch.device) -> None:
        self.plan, self.rank, self.device = plan, rank, device
        self.num_shards, self.shard = input_shard(plan, rank)
        self.shared = self.num_shards < plan.world_size  # some ranks read one shard together
        self._meshes = meshes
        self._checked: set[tuple[Any, int]] = set()  # (stage, dataloader_idx) whose first batch was compared

    def process_dataloader(self, dataloader: object, stage: RunningStage | None) -> object:
        """Training and validation: each shard reads DDP's samples of its ranks per step (the global batch, or
        ``global_batch_size``), in one batch. Test and predict: the loader as DDP has it."""
        per_device = loader_batch_size(dataloader)
        if stage in DDP_LAYOUT_STAGES:
            if self.shared:
                self._check_equal_batch_counts(dataloader, stage)
                input_shard_group(self.plan, self._meshes)  # made now, on every rank (collective)
            return dataloader
        if per_device is None:
            return dataloader
        ddp_batch = per_device * self.plan.world_size
        global_batch = ddp_batch
        if stage == RunningStage.TRAINING:
            global_batch = self.plan.global_batch_size or ddp_batch
            self.plan.check_batch_size(global_batch)
            if global_batch != ddp_batch:
                rank_zero_info(
                    f"Galvatron: training on a global batch of {global_batch} samples per step (the DataLoader's "
                    f"batch_size {per_device} x {self.plan.world_size} devices would give {ddp_batch})"
                )
        return rebatch(dataloader, shard_batch_size(global_batch, self.num_shards))

    def check_first_batch(
        self, batch: Any, stage: RunningStage | str | None, dataloader_idx: int, front: str = "trainer"
    ) -> None:
        """The ranks of each shard got the same first batch of this loader (training, validation), else the same
        refusal on every rank, before any step runs on it. One all-gather of a digest per loader and run.
        ``front``: what the user's code calls the strategy through (``trainer``, ``fabric``)."""
        if not self.shared or stage in DDP_LAYOUT_STAGES or (stage, dataloader_idx) in self._checked:
            return
        self._checked.add((stage, dataloader_idx))
        differing = values_differing_within_groups(self.shard, batch_digest(batch))
        if not differing:
            return
        shard, members = sorted(differing.items())[0]
        ranks = ", ".join(str(rank) for rank, _ in members)
        what = getattr(stage, "value", stage)
        raise PlanError(
            f"ranks {ranks} read one data shard of this plan (shard {shard} of {self.num_shards}: tensor-parallel "
            f"ranks and pipeline stages share their input) but were given different {what} batches, so each would "
            "train on another rank's samples. An IterableDataset that shards itself by torch.distributed.get_rank() "
            "and get_world_size() does this; shard it by the plan's data shards instead: "
            f"{front}.strategy.distributed_sampler_kwargs gives num_replicas (the number of data shards) and rank "
            "(this rank's shard), e.g. range(rank, len(data), num_replicas). A sampler or random augmentation seeded "
            "per rank does the same"
        )

    def _check_equal_batch_counts(self, dataloader: object, stage: RunningStage) -> None:
        """Ranks that run their steps together need as many batches each (a loader without a length is trusted)."""
        try:
            count = float(len(dataloader))  # type: ignore[arg-type]
        except TypeError:
            count = -1.0
        differing = values_differing_within_groups(self.shard, count)
        if not differing or any(value < 0 for members in differing.values() for _, value in members):
            return
        _, members = sorted(differing.items())[0]
        counts = ", ".join(f"rank {rank}: {int(value)}" for rank, value in members)
        raise PlanError(
            f"trainer.{'predict' if stage == RunningStage.PREDICTING else 'test'} under this plan runs each step on "
            "the batches of the ranks that share a data shard together, so they need as many batches each, but DDP's "
            f"sampler gives them different numbers ({counts}). Use a number of samples that every rank gets as many "
            "batches of (a multiple of devices x batch_size), or a plan with one data shard per device (pp=1, vocab "
            "tp=1)"
        )

    def step_on_shard_batch(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Test and predict: ``step`` on the shard's batch (its ranks' batches joined), this rank's outputs back."""
        if not self.shared:
            return step(*args, **kwargs)
        group = input_shard_group(self.plan, self._meshes)
        batches: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(batches, _on_cpu(args[0]), group=group)
        joined, rows = join_batches(batches, dist.get_rank(group))
        outputs = step(move_data_to_device(joined, self.device), *args[1:], **kwargs)
        return rows_of(outputs, rows, _leading_size(joined))


def shard_batch_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """A strategy's test or predict step that runs on the shard's batch (:meth:`DataShards.step_on_shard_batch`)."""

    @functools.wraps(step)
    def on_shard_batch(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        return strategy.data_shards.step_on_shard_batch(functools.partial(step, strategy), args, kwargs)

    return on_shard_batch


def batch_digest(batch: Any) -> float:
    """48 bits of a hash of a batch: its structure, its tensors' shapes and bytes, its strings and numbers."""
    leaves, spec = tree_flatten(batch)
    parts = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(repr(tensor_digest(leaf)))
        elif isinstance(leaf, (str, bytes, int, float, bool, type(None))):
            parts.append(repr(leaf))
        else:  # an object's repr may hold its address: only its type is compared
            parts.append(type(leaf).__name__)
    return float(int.from_bytes(hashlib.blake2b("\0".join(parts).encode(), digest_size=6).digest(), "big"))


def join_batches(batches: list[Any], position: int) -> tuple[Any, slice]:
    """The ranks' batches as one, and the rows of the batch at ``position``.

    Where the batches are equally large their samples are interleaved (sample ``i`` is batch ``i % n``'s), as a
    sampler over the plan's shards orders a shard's batch; else (predict's last batches) they follow each other.
    Tensors and lists of strings are joined along the batch; other values must be equal.
    """
    flat = [tree_flatten(batch, is_leaf=_is_string_list) for batch in batches]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        raise PlanError("the ranks that share a data shard were given test or predict batches of different structures")
    sizes = [_leading_size(batch) for batch in batches]
    interleaved = len(set(sizes)) == 1
    joined = []
    for leaves in zip(*(leaves for leaves, _ in flat)):
        first = leaves[0]
        if isinstance(first, torch.Tensor) and first.dim():
            if any(leaf.shape[1:] != first.shape[1:] for leaf in leaves):
                shapes = ", ".join(str(tuple(leaf.shape)) for leaf in leaves)
                raise PlanError(
                    "the ranks that share a data shard run a test or predict step on their batches together, but "
                    f"their batches differ in shape beyond the batch dimension ({shapes}): pad every batch to one "
                    "length (e.g. padding='max_length' in the collate function)"
                )
            joined.append(torch.stack(leaves, 1).flatten(0, 1) if interleaved else torch.cat(leaves))
        elif _is_string_list(first):
            joined.append([s for row in zip(*leaves) for s in row] if interleaved else sum(leaves, []))
        elif all(_equal(leaf, first) for leaf in leaves[1:]):
            joined.append(first)
        else:
            raise PlanError(
                f"the ranks that share a data shard were given test or predict batches whose {type(first).__name__} "
                "values differ; they can be joined only where they hold tensors (or lists of strings) with one row "
                "per sample"
            )
    n = len(batches)
    rows = slice(position, None, n) if interleaved else slice(sum(sizes[:position]), sum(sizes[: position + 1]))
    return tree_unflatten(joined, spec), rows


def rows_of(outputs: Any, rows: slice, batch_size: int) -> Any:
    """The part of a step's outputs for ``rows`` of its batch: tensors and lists of strings with one row per sample
    are sliced, a KV cache (one per call of the model) is dropped, everything else is kept."""

    def part(value: Any) -> Any:
        if (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch_size) or (
            _is_string_list(value) and len(value) == batch_size
        ):
            return value[rows]
        return None if is_kv_cache(value) else value

    return tree_map(part, outputs, is_leaf=_is_string_list)


def _is_string_list(value: Any) -> bool:
    """A list of strings: what the default collate function makes of a string per sample."""
    return isinstance(value, list) and bool(value) and all(isinstance(item, (str, bytes)) for item in value)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality differ
        return False


def _leading_size(batch: Any) -> int:
    leaves, _ = tree_flatten(batch, is_leaf=_is_string_list)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return leaf.shape[0]
        if _is_string_list(leaf):
            return len(leaf)
    raise PlanError("a test or predict batch without tensors cannot be shared by the ranks of a data shard")


def _on_cpu(batch: Any) -> Any:
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, batch)
