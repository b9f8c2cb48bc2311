"""Device meshes that realise rank layouts.

The arithmetic of a layout (degrees, strides, coordinates, groups) lives in
:mod:`lightning_galvatron.plan.layout`; :class:`MeshCache` only turns a :class:`~lightning_galvatron.plan.layout.Layout`
into one ``DeviceMesh`` with dimensions ``("pp", "dp", "tp")``, collectively and only once, so that
blocks sharing a layout share process groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_galvatron.plan.layout import Layout

MESH_DIMS = ("pp", "dp", "tp")

__all__ = ["MESH_DIMS", "Layout", "MeshCache", "collective_device", "local_tensor", "reduce_over_ranks"]


class MeshCache:
    """One ``DeviceMesh`` per distinct :class:`Layout`, created on first use by every rank.

    :meth:`shared` returns the cache of the current default process group, so that trainers created
    one after another in a process (fit, then test; or many runs in a test suite) reuse the groups.
    """

    _shared: dict[tuple[int, str], MeshCache] = {}

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._meshes: dict[Layout, DeviceMesh] = {}

    @classmethod
    def shared(cls, device_type: str) -> MeshCache:
        key = (id(dist.distributed_c10d._get_default_group()), device_type)
        if key not in cls._shared:
            cls._shared = {k: v for k, v in cls._shared.items() if k[0] == key[0]}  # drop caches of dead groups
            cls._shared[key] = cls(device_type)
        return cls._shared[key]

    def mesh(self, layout: Layout) -> DeviceMesh:
        if layout not in self._meshes:
            grid = torch.tensor(layout.rank_grid())
            self._meshes[layout] = DeviceMesh(self.device_type, grid, mesh_dim_names=MESH_DIMS)
        return self._meshes[layout]

    def dp_mesh(self, layout: Layout) -> DeviceMesh:
        return self.mesh(layout)["dp"]

    def tp_mesh(self, layout: Layout) -> DeviceMesh:
        return self.mesh(layout)["tp"]

    def __len__(self) -> int:
        return len(self._meshes)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: NCCL reduces only CUDA tensors, gloo CPU ones."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def values_travel(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group``'s collectives carry values: not on the dry run's fake backend, whose ranks exchange none (a
    check comparing values across ranks would read garbage there)."""
    return "fake" not in str(dist.get_backend(group))


def reduce_over_ranks(
    values: torch.Tensor | Sequence[float],
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> list[Any]:
    """Small host values (timings, counts, flags) reduced with ``op`` over ``group``'s ranks, as (nested) Python
    lists, so that every rank takes the same decision from them; unchanged where no process group runs (no tensor
    is made then: the model profiler also runs under ``FakeTensorMode``). Collective.

    Numbers travel as float64 (a tensor keeps its dtype), through :func:`collective_device`.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return values.tolist() if isinstance(values, torch.Tensor) else list(values)
    tensor = values.detach() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
    on_device = tensor.to(collective_device(group))
    dist.all_reduce(on_device, op=op, group=group)
    return on_device.cpu().tolist()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (itself when it is not a DTensor), sharing its storage."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
