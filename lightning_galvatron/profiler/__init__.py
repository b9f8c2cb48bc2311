"""Profilers: measure a model and a cluster into a :class:`~lightning_galvatron.profiles.Profile`.

:func:`profile` is the entry point the strategy calls on every rank (it is collective): it looks
the profile up in the on-disk cache on rank 0, otherwise measures the hardware
(:mod:`.hardware`) and the model (:mod:`.model`) on all ranks, stores rank 0's result and
broadcasts it, so every rank returns the very same profile and the search that follows picks the
same plan everywhere. What does not depend on the model (the interconnect, the optimizer probes) is
looked up in the cache's cluster part first (:meth:`ProfileCache.load_cluster`): a new model on the
same cluster measures only itself.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.profiler.cache import (
    ProfileCache,
    cache_key,
    cluster_fingerprint,
    contradiction,
    default_cache_dir,
    fingerprint,
    model_signature,
)
from lightning_galvatron.profiler.hardware import profile_hardware
from lightning_galvatron.profiler.model import Step, measure_model, profile_model
from lightning_galvatron.profiles import HardwareProfile, OptimizerProbe, Profile

log = logging.getLogger(__name__)

OVERHEADS_VERSION = 5  # of what the overhead probes measure: a new one re-profiles cached models


def profile(
    module: nn.Module,
    structure: ModelStructure,
    example_batch: Any,
    *,
    world_size: int | None = None,
    devices_per_node: int | None = None,
    precision: str = "32-true",
    cache: ProfileCache | str | os.PathLike | bool | None = True,
    step: Step | None = None,
    batch_sizes: Sequence[int] = (1, 4),
    degrees: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    hardware_budget_s: float = 3.0,
    info: dict[str, Any] | None = None,
    measure: bool = True,
    pipelines: bool = True,
) -> Profile | None:
    """Profile ``module`` on the live process group; call on every rank, get the same profile on each.

    Args:
        module, structure, example_batch, step, precision, batch_sizes, degrees: see
            :func:`~lightning_galvatron.profiler.model.profile_model`.
        world_size: ranks of the default process group (default: its size; checked against it).
        devices_per_node: ranks per node (default: ``$LOCAL_WORLD_SIZE``, else the world size).
        cache: ``True`` for the default :class:`ProfileCache`, a directory or a cache to use,
            ``False``/``None`` to always measure.
        device: where to run the model (default: the current CUDA device under NCCL, else the
            module's device).
        hardware_budget_s: time bound of the collective measurements (:func:`profile_hardware`).
        info: filled with ``cached`` (whether the profile came from the cache) and ``cache_file``.
        measure: ``False`` only looks the profile up in the cache: ``None`` (on every rank) when it is not there.
        pipelines: probe pipeline schedules (:mod:`~lightning_galvatron.profiler.model.overheads`); ``False`` where
            no pipeline can be chosen (such a profile is cached apart: it has no pipeline probes).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "profile() measures the cluster and must run on every rank of an initialised process group "
            "(e.g. under torchrun); for the model alone on one process use profile_model()"
        )
    world_size = world_size or dist.get_world_size()
    devices_per_node = devices_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = str(dist.get_backend())
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else _module_device(module)
    device = torch.device(device)
    device_kind = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    store = _cache(cache)
    rank = dist.get_rank()

    key = None
    found: list[Any] = [None]
    measured_on: dict[str, Any] | None = None
    if rank == 0:
        what = dict(
            precision=precision,
            sample_shapes=_sample_shapes(example_batch),
            device_kind=device_kind,
            world_size=world_size,
            devices_per_node=devices_per_node,
            backend=backend,
            # "overheads": profiles cached before the per-call probes are measured again, with them.
            extra={
                "batch_sizes": sorted(batch_sizes),
                "degrees": sorted(degrees) if degrees else None,
                "overheads": OVERHEADS_VERSION,
                **({} if pipelines else {"pipelines": False}),
            },
        )
        signature = model_signature(module, structure)
        measured_on = fingerprint(signature, **what)
    if store is not None and rank == 0:
        key = cache_key(signature, **what)
        cached = store.load(key, fingerprint=measured_on)
        problem = None
        if cached is not None:
            problem = contradiction(cached, structure, devices_per_node, type(module).__name__)
        if problem is not None:
            again = "; profiling again and overwriting it" if measure else ""
            warnings.warn(f"ignoring the cached profile {store.path(key)}: {problem}{again}", stacklevel=2)
            cached = None
        found = [cached.to_dict() if cached is not None else None]
        if cached is not None:
            log.info("using the cached profile %s", store.path(key))
    _broadcast(found, device)
    if info is not None:
        info.update(cached=found[0] is not None, cache_file=str(store.path(key)) if store is not None and key else None)
    if found[0] is not None:
        return Profile.from_dict(found[0])
    if not measure:
        return None

    started = time.perf_counter()
    known: list[Any] = [None]
    if store is not None:  # the same on every rank (from ``cache``)
        cluster_on = _cluster_fingerprint(device_kind, world_size, devices_per_node, backend, hardware_budget_s)
        known = [_cached_cluster(store, cluster_on) if rank == 0 else None]
        _broadcast(known, device)
    if known[0] is not None:
        hardware = HardwareProfile.from_dict(known[0]["hardware"])
        optimizer = tuple(OptimizerProbe.from_dict(o, "optimizer") for o in known[0]["optimizer"])
        log.info("using the cached measurements of the cluster %s", store.cluster_path(cluster_on))
    else:
        hardware = profile_hardware(world_size, devices_per_node, device_type=device.type, budget_s=hardware_budget_s)
        optimizer = None
    model, overheads = measure_model(
        module,
        structure,
        example_batch,
        step=step,
        precision=precision,
        batch_sizes=batch_sizes,
        degrees=degrees,
        device=device,
        overheads=True,
        optimizer_probes=optimizer,
        pipelines=pipelines,
    )
    result = Profile(
        model,
        hardware,
        source=f"lightning_galvatron.profiler: {precision} on {world_size} x {device_kind} ({backend})",
        fingerprint=measured_on,
        overheads=overheads,
    )
    log.info("profiled %s in %.1f s", model.name, time.perf_counter() - started)
    chosen = [result.to_dict() if rank == 0 else None]
    if store is not None and rank == 0 and key is not None:
        store.save(key, result)
        if known[0] is None and overheads is not None and overheads.optimizer:
            store.save_cluster(cluster_on, hardware, overheads.optimizer)
    _broadcast(chosen, device)
    return Profile.from_dict(chosen[0])


def _cache(cache: ProfileCache | str | os.PathLike | bool | None) -> ProfileCache | None:
    if cache is True:
        return ProfileCache()
    if cache is False or cache is None:
        return None
    if isinstance(cache, ProfileCache):
        return cache
    return ProfileCache(cache)


def _cluster_fingerprint(
    device_kind: str, world_size: int, devices_per_node: int, backend: str, budget_s: float
) -> dict[str, Any]:
    """What the model-independent measurements (the interconnect, the optimizer) were taken on; collective (every
    rank's host name: another set of nodes is another cluster)."""
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return cluster_fingerprint(
        device_kind=device_kind,
        world_size=world_size,
        devices_per_node=devices_per_node,
        backend=backend,
        hosts=hosts,
        extra={"hardware_budget_s": budget_s, "overheads": OVERHEADS_VERSION},
    )


def _cached_cluster(store: ProfileCache, measured_on: dict[str, Any]) -> dict[str, Any] | None:
    """The cached cluster measurements as plain data (to broadcast), or ``None``."""
    found = store.load_cluster(measured_on)
    if found is None:
        return None
    hardware, optimizer = found
    return {"hardware": hardware.to_dict(), "optimizer": [o.to_dict() for o in optimizer]}


def _broadcast(objects: list[Any], device: torch.device) -> None:
    dist.broadcast_object_list(objects, src=0, device=device if device.type == "cuda" else None)


def _sample_shapes(batch: Any) -> list[Any]:
    """Shapes (without the batch dimension) and dtypes of the batch's tensors: carries the sequence length."""
    return [[list(t.shape[1:]), str(t.dtype)] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]


def _module_device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


__all__ = [
    "ProfileCache",
    "cache_key",
    "default_cache_dir",
    "model_signature",
    "profile",
    "profile_hardware",
    "profile_model",
]
