import importlib.util
import os
import sys

import pytest
import torch

# Forked workers hang if the parent already ran OpenMP threads; one thread each also keeps
# several processes from fighting over this machine's two cores.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.pool import PoolManager  # noqa: E402

#: LitGPT's own pins contradict the newest transformers, so requirements/test.lock installs it without its
#: dependencies; an environment resolved from the test extra alone runs without it.
LITGPT_INSTALLED = importlib.util.find_spec("litgpt") is not None


def pytest_collection_modifyitems(config, items):
    if LITGPT_INSTALLED:
        return
    if os.environ.get("CI") and not os.environ.get("GALVATRON_LOWER_BOUNDS"):  # .ci/lower_bounds runs without it
        raise pytest.UsageError("litgpt is not installed: CI installs requirements/test.lock, which has it")
    skip = pytest.mark.skip(reason="litgpt is not installed (requirements/test.lock installs it, without its pins)")
    for item in items:
        if "litgpt" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pools():
    """``pools(4).run(fn, ...)`` runs ``fn`` on 4 ranks of a reused gloo process group."""
    manager = PoolManager()
    yield manager
    manager.shutdown()


@pytest.fixture(scope="session")
def cluster_measurements(tmp_path_factory):
    """The session's cached cluster measurements (interconnect, optimizer probes): they do not depend on the model,
    so each world size is measured once for the whole suite (``tests/test_profiler_distributed.py`` tests the
    cold path)."""
    return tmp_path_factory.mktemp("clusters")


@pytest.fixture(scope="session")
def linked_profile_cache(cluster_measurements):
    """``linked_profile_cache(directory)``: ``directory`` made a profile cache of its own (every model is profiled
    cold) whose ``clusters/`` links to the session's :func:`cluster_measurements`."""

    def make(directory):
        directory.mkdir(exist_ok=True)
        (directory / "clusters").symlink_to(cluster_measurements, target_is_directory=True)
        return directory

    return make


@pytest.fixture
def profile_cache(tmp_path, linked_profile_cache):
    """A profile cache of the test's own that shares the session's cluster measurements."""
    return linked_profile_cache(tmp_path / "cache")
