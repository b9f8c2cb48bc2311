"""Rank layouts and the device meshes that realise them.

A stage of ``n = world_size / pp`` devices owns the consecutive ranks ``[s*n, (s+1)*n)``. A block
with group size ``tp`` splits them into ``dp = n / tp`` groups; with a consecutive layout the
``tp`` ranks of a group are neighbours, with a strided one they are ``dp`` apart (the ``dp`` ranks
are then neighbours instead, which keeps gradient traffic inside a node).

:func:`layout_coordinates` is the pure arithmetic; :class:`MeshCache` builds one ``DeviceMesh``
with dimensions ``("pp", "dp", "tp")`` per distinct layout, collectively and only once, so that
blocks sharing a layout share process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_galvatron.plan import LayerStrategy, ParallelPlan

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Layout:
    """Where the ranks of one block sit: pipeline degree, group size and rank order."""

    world_size: int
    pp: int
    tp: int
    consecutive: bool = True

    @classmethod
    def of(cls, plan: ParallelPlan, strategy: LayerStrategy) -> Layout:
        n = plan.devices_per_stage
        # With tp of 1 or n both orders give the same groups: normalise so they share one mesh.
        consecutive = strategy.tp_consecutive or strategy.tp in (1, n)
        return cls(plan.world_size, plan.pp, strategy.tp, consecutive)

    @property
    def dp(self) -> int:
        return self.world_size // self.pp // self.tp

    def rank_grid(self) -> torch.Tensor:
        """Ranks arranged as ``[pp, dp, tp]``."""
        ranks = torch.arange(self.world_size).view(self.pp, -1)
        if self.consecutive:
            return ranks.view(self.pp, self.dp, self.tp)
        return ranks.view(self.pp, self.tp, self.dp).transpose(1, 2)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(stage, dp_rank, tp_rank)`` of a global rank."""
        stage, position = divmod(rank, self.world_size // self.pp)
        if self.consecutive:
            dp_rank, tp_rank = divmod(position, self.tp)
        else:
            tp_rank, dp_rank = divmod(position, self.dp)
        return stage, dp_rank, tp_rank


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
            self._meshes[layout] = DeviceMesh(self.device_type, layout.rank_grid(), mesh_dim_names=MESH_DIMS)
        return self._meshes[layout]

    def dp_mesh(self, layout: Layout) -> DeviceMesh:
        return self.mesh(layout)["dp"]

    def tp_mesh(self, layout: Layout) -> DeviceMesh:
        return self.mesh(layout)["tp"]

    def __len__(self) -> int:
        return len(self._meshes)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (itself when it is not a DTensor), sharing its storage."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
