"""Batch semantics: every optimizer step trains on exactly the samples DDP would.

DDP on ``W`` devices with a DataLoader of ``batch_size=b`` trains each step on ``b * W`` samples:
one contiguous block of the ``DistributedSampler`` permutation. Under a plan, only the ``dp`` data
shards of the input layout read distinct samples (tensor-parallel ranks share theirs), so each
shard must read ``b * W / dp`` samples per step. With the sampler set to ``dp`` replicas, the union
of the shards' batches is again the same contiguous block of the same permutation, so the loss
curve matches DDP's. This module rebuilds the DataLoader with that batch size, and takes the example
batch that ``plan="auto"`` profiles with and pipelines trace the step on.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import BatchSampler, DataLoader


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


def first_dataloader(trainer: Any) -> Any:
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
