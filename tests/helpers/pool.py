"""The tests' pools of forked gloo workers (:class:`~benchmarks.pool.WorkerPool`, shared with the benchmarks):
one live pool per world size, reused across tests."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from benchmarks.pool import DistributedFailure, WorkerDied, WorkerPool

__all__ = ["DistributedFailure", "PoolManager", "WorkerDied", "WorkerPool"]


class PoolManager:
    """One live pool per world size, re-forked after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> _TestPool:
        return _TestPool(self, world_size)

    def live(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def shutdown(self, world_size: int | None = None) -> None:
        """Shut down the pool of ``world_size`` (the next request forks a fresh one), or every pool."""
        for size, pool in self._pools.items():
            if world_size is None or size == world_size:
                pool.shutdown()


class _TestPool:
    """A world size's pool as the tests use it.

    ``run`` runs once more on a fresh pool if a worker process died without a Python error, with a warning
    that says so. The workers live for the whole session and run hundreds of trainings; a native crash in one
    (seen once in CI: glibc's "malloc(): unaligned fastbin chunk detected" after a Phi pipeline case, not
    reproduced in 50 reruns of the cases around it) should not fail a test whose own work runs cleanly. A
    crash that the test's work causes happens again and fails it. Python errors and timeouts are not retried.
    """

    def __init__(self, manager: PoolManager, world_size: int) -> None:
        self._manager, self.world_size = manager, world_size

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return self._manager.live(self.world_size).run(fn, *args, **kwargs)
        except WorkerDied as died:
            warnings.warn(f"{died}; running it again on a fresh pool", RuntimeWarning, stacklevel=2)
            return self._manager.live(self.world_size).run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._manager.shutdown(self.world_size)
