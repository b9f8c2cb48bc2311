"""A pool of long-lived worker processes that share one gloo process group.

Launching ``torchrun`` costs seconds per test; forking workers from a parent that has already
imported torch and Lightning costs well under a second, and keeping them (with their process
group and meshes) across tests costs nothing. ``pool.run(fn, *args)`` runs ``fn`` on every rank
and returns the per-rank results. Workers look to Lightning like externally launched processes
(``LOCAL_RANK`` and friends are set), so a ``Trainer(devices=N)`` inside ``fn`` runs distributed
without launching anything.

Any failure or timeout kills the pool (ranks may be stuck in a collective); the next request
for that world size forks a fresh one. The benchmarks measure on such pools; the tests reuse them
(``tests/helpers/pool.py``).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

PG_TIMEOUT_S = 90


class DistributedFailure(AssertionError):
    pass


class WorkerDied(DistributedFailure):
    """A worker process ended without a Python error (a native crash or a kill); the pool is gone."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            # Plain pickle: tensors travel as bytes, not as shared-memory file descriptors (many results would
            # exhaust the descriptors a process may hold).
            conn.send(("ok", pickle.dumps(fn(*args, **kwargs))))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("fork")
        port = _free_port()
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive:
            raise RuntimeError("this worker pool was shut down")
        try:
            for conn in self._conns:
                conn.send((fn, args, kwargs))
            return self._collect(fn, timeout)
        except (EOFError, OSError) as crash:  # a worker died (e.g. a native abort): the next request forks anew
            self.shutdown()
            raise WorkerDied(f"a worker process died while running {fn.__name__}: {crash!r}") from crash

    def _collect(self, fn: Callable[..., Any], timeout: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors = []
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for rank, conn in enumerate(self._conns):
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if not conn.poll(max(remaining, 0.1)):
                self.shutdown()
                raise DistributedFailure(f"rank {rank} did not finish {fn.__name__} within {timeout:.0f} s")
            status, value = conn.recv()
            if status == "ok":
                value = pickle.loads(value)
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            results[rank] = value
        if errors:
            self.shutdown()
            raise DistributedFailure(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return results

    def shutdown(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
