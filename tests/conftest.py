import os
import sys

import pytest
import torch

# Forked workers hang if the parent already ran OpenMP threads; one thread each also keeps
# several processes from fighting over this machine's two cores.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.pool import PoolManager  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """``pools(4).run(fn, ...)`` runs ``fn`` on 4 ranks of a reused gloo process group."""
    manager = PoolManager()
    yield manager
    manager.shutdown()
