"""The tests' pools of forked gloo workers (:class:`~benchmarks.pool.WorkerPool`, shared with the benchmarks):
one live pool per world size, reused across tests."""

from __future__ import annotations

from benchmarks.pool import DistributedFailure, WorkerPool

__all__ = ["DistributedFailure", "PoolManager", "WorkerPool"]


class PoolManager:
    """One live pool per world size, re-forked after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
