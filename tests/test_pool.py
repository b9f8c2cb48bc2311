"""The tests' worker pools: a worker that dies is replaced and the work run once more; errors are not retried."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.pool import DistributedFailure, PoolManager, WorkerDied


def _die_once(marker: str) -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1 and not Path(marker).exists():
        Path(marker).touch()
        os._exit(1)  # no Python error: as a native crash ends a worker
    return rank


def _count_and_fail(counter: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(counter, "a") as f:
            f.write("x")
    raise ValueError("a Python error in the test's own work")


@pytest.mark.timeout(120)
def test_a_dead_worker_is_replaced_and_the_work_run_again(tmp_path):
    manager = PoolManager()
    try:
        pool = manager(2)
        with pytest.warns(RuntimeWarning, match="worker process died while running _die_once"):
            assert pool.run(_die_once, str(tmp_path / "died"), timeout=60) == [0, 1]
        assert pool.run(_die_once, str(tmp_path / "died"), timeout=60) == [0, 1]  # the fresh pool stays
        # A Python error is the test's own: reported at once, not run again.
        with pytest.raises(DistributedFailure, match="a Python error in the test's own work") as raised:
            pool.run(_count_and_fail, str(tmp_path / "count"), timeout=60)
        assert not isinstance(raised.value, WorkerDied)
        assert (tmp_path / "count").read_text() == "x"
    finally:
        manager.shutdown()
