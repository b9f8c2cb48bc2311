"""Run simulated ranks, each in a process of its own, a few at a time.

The fake process group is global state, so every rank needs its own process. They are forked from
this one after the model was built on the meta device and every import done, so a rank starts in a
fraction of a second and inherits the model (each process changes only its copy). Results come
back as plain data through a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkProcess
from typing import Any, cast

from lightning_galvatron.dryrun.rank import RankJob, RankResult, simulate_rank


def sample_ranks(plan: Any) -> list[int]:
    """The first, middle and last rank of every pipeline stage (from the plan's own stage ranks)."""
    ranks: list[int] = []
    for stage in range(plan.pp):
        members = plan.stage_ranks(stage)
        for r in (members[0], members[len(members) // 2], members[-1]):
            if r not in ranks:
                ranks.append(r)
    return ranks


def resolve_ranks(ranks: str | int | Iterable[int], plan: Any) -> list[int]:
    """``"sample"``, ``"all"``, one rank or a list of ranks (checked against the world size)."""
    if ranks == "sample":
        return sample_ranks(plan)
    if ranks == "all":
        return list(range(plan.world_size))
    # Any other string is no list of ranks: its characters fail the range check below (a TypeError; "" a ValueError).
    chosen = [ranks] if isinstance(ranks, int) else list(cast("Iterable[int]", ranks))
    bad = [r for r in chosen if not 0 <= r < plan.world_size]
    if bad or not chosen:
        raise ValueError(f"ranks {bad or chosen} are not ranks of a world of {plan.world_size}")
    return sorted(dict.fromkeys(chosen))


def run_ranks(
    job: RankJob,
    ranks: Sequence[int],
    workers: int | None = None,
    timeout_s: float = 900.0,
    progress: Callable[[RankResult], None] | None = None,
) -> list[RankResult]:
    """Simulate ``ranks`` with at most ``workers`` processes at a time; results in rank order."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(ranks)))
    ctx = mp.get_context("fork")
    pending = list(ranks)
    running: dict[Connection[Any, RankResult], tuple[int, ForkProcess, float]] = {}
    results: dict[int, RankResult] = {}
    while pending or running:
        while pending and len(running) < workers:
            rank = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_child, args=(job, rank, child), daemon=True)
            process.start()
            child.close()
            running[parent] = (rank, process, time.monotonic())
        for conn in wait(list(running), timeout=1.0):
            assert isinstance(conn, Connection)  # wait returns some of the pipes it was given
            rank, process, _ = running.pop(conn)
            try:
                results[rank] = conn.recv()
                process.join()
            except EOFError:
                process.join()
                results[rank] = RankResult(
                    rank, -1, error=f"the process of rank {rank} died (exit code {process.exitcode})"
                )
            if progress is not None:
                progress(results[rank])
        for conn, (rank, process, started) in list(running.items()):
            if time.monotonic() - started > timeout_s:
                process.kill()
                process.join()
                running.pop(conn)
                results[rank] = RankResult(rank, -1, error=f"rank {rank} did not finish within {timeout_s:.0f} s")
    return [results[r] for r in ranks]


def _child(job: RankJob, rank: int, conn: Connection[RankResult, Any]) -> None:
    try:
        conn.send(simulate_rank(job, rank))
    finally:
        conn.close()
        os._exit(0)  # skip atexit handlers and finalizers inherited from the parent
