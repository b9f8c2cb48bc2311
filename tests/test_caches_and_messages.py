"""Caches are hints, never locks; messages say what was seen (issue 44).

A cached selection or profile that does not describe the live model is measured again with a warning (not used,
not refused); a cache directory that cannot be written costs one warning, not the run; a model of one block is
found.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import lightning_galvatron.profiler.cache as cache_module
from lightning_galvatron.model.discovery import BlockDiscoveryError, find_blocks
from lightning_galvatron.model.tensor_parallel_plans import block_tensor_parallel_plans
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiler.cache import ProfileCache, contradiction
from lightning_galvatron.runtime.apply import check_runtime_support
from lightning_galvatron.selection import Selection, SelectionCache, TrialSettings
from tests.helpers.training import tiny_gpt
from tests.search_profiles import synthetic_profile


def _messages(caught: list[warnings.WarningMessage]) -> str:
    return "\n".join(str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------------- cached selections
def _select_with_a_stale_selection_cached(directory: str) -> dict:
    """A cached selection whose plan has six layer strategies (the model has four blocks): measured again."""
    from lightning_galvatron.selection import measured

    model = tiny_gpt()
    structure = find_blocks(model)
    tp_plans = block_tensor_parallel_plans(structure)
    searched = ParallelPlan.uniform(1, 4, S())
    profile = synthetic_profile(np.random.default_rng(0), num_blocks=4, devices_per_node=1)
    auto = SimpleNamespace(profile=profile, search_arguments={}, plan=searched)
    settings, cache = TrialSettings(), SelectionCache(directory)
    key = measured.selection_key(profile, auto.search_arguments, settings)
    cache.save(key, Selection(plan=ParallelPlan.uniform(1, 6, S()), trials=(), memory_budget_bytes=1))
    measured_again = Selection(plan=searched, trials=(), memory_budget_bytes=1)
    with (
        mock.patch.object(measured, "_select", lambda *args: measured_again),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        chosen = measured.select_by_measurement(
            auto,
            SimpleNamespace(device=torch.device("cpu")),
            settings,
            cache=cache,
            check=lambda plan: check_runtime_support(plan, structure, tp_plans),
            report=lambda text: None,
        )
    return dict(plan=chosen.plan, messages=_messages(caught), stored=cache.load(key).plan)


def test_a_cached_selection_that_does_not_fit_the_model_is_measured_again(pools, tmp_path):
    out = pools(1).run(_select_with_a_stale_selection_cached, str(tmp_path))[0]
    assert out["plan"] == out["stored"] == ParallelPlan.uniform(1, 4, S())  # measured, and the file replaced
    assert "ignoring the cached selection " in out["messages"], out["messages"]
    assert (
        "its plan has 6 layer strategies but the model has 4 blocks; measuring again and overwriting it"
        in out["messages"]
    )
    assert "give one strategy per block" not in out["messages"]


# ---------------------------------------------------------------------------------------------- cached profiles
def _profile_of(model: nn.Module, structure, devices_per_node: int):
    """A synthetic profile whose content agrees with ``model`` (name, blocks, parameters, hidden size)."""
    synthetic = synthetic_profile(
        np.random.default_rng(0), num_blocks=structure.num_blocks, devices_per_node=devices_per_node
    )
    block = structure.blocks[0]
    layer = dataclasses.replace(
        synthetic.model.layer_types[0],
        name=type(block).__name__,
        parameters=sum(p.numel() for p in block.parameters()),
        hidden_size=block.ln_1.normalized_shape[0],
    )
    model_profile = dataclasses.replace(
        synthetic.model, name=type(model).__name__, layer_types=(layer,), hidden_size=layer.hidden_size
    )
    return dataclasses.replace(synthetic, model=model_profile)


def test_a_cached_profile_whose_content_contradicts_the_model_is_not_used():
    """The issue's edit: hidden size 32 -> 1024 and another model name, the fingerprint (the key) unchanged."""
    model = tiny_gpt()
    structure = find_blocks(model)
    fits = _profile_of(model, structure, 2)
    name = type(model).__name__
    assert contradiction(fits, structure, 2) is None
    wider_layer = dataclasses.replace(fits.model.layer_types[0], hidden_size=1024)
    wider = dataclasses.replace(fits, model=dataclasses.replace(fits.model, layer_types=(wider_layer,)))
    assert contradiction(wider, structure, 2) == (
        "its block hidden size 1024 is no size of block 0's parameters ([32, 128])"
    )
    assert contradiction(fits, structure, 2, name) is None
    renamed = dataclasses.replace(fits, model=dataclasses.replace(fits.model, name="LlamaForCausalLM"))
    assert contradiction(renamed, structure, 2, name) == f"it describes the model 'LlamaForCausalLM', not {name!r}"


# ---------------------------------------------------------------------------------------------- unwritable cache
def test_an_unwritable_cache_directory_falls_back_to_a_temporary_one_with_one_warning(tmp_path, monkeypatch):
    read_only = tmp_path / "read-only"
    write = cache_module.write_atomically

    def read_only_file_system(path: Path, text: str) -> None:
        if read_only in path.parents:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        write(path, text)

    monkeypatch.setattr(cache_module, "write_atomically", read_only_file_system)
    profile = synthetic_profile(np.random.default_rng(0), num_blocks=4, devices_per_node=2)
    selection = Selection(plan=ParallelPlan.uniform(2, 4, S()), trials=(), memory_budget_bytes=1)
    profiles, selections = ProfileCache(read_only), SelectionCache(read_only)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile_file = profiles.save("key", profile)
        selection_file = selections.save("key", selection)
    assert len(caught) == 1, _messages(caught)
    assert str(caught[0].message).startswith(
        f"cannot write to the profile cache {read_only} ([Errno 30] Read-only file system: "
    )
    assert "caching in " in str(caught[0].message) and "profile_cache=False" in str(caught[0].message)
    assert read_only not in profile_file.parents and profile_file.parent == selection_file.parent.parent
    assert profiles.load("key") == profile and selections.load("key").plan == selection.plan  # read back this run


# ---------------------------------------------------------------------------------------------- block discovery
def test_a_model_of_one_block_is_found_and_a_model_without_a_list_is_told_what_was_seen():
    structure = find_blocks(tiny_gpt(n_layer=1))
    assert [bl.path for bl in structure.block_lists] == ["model.blocks"] and structure.num_blocks == 1

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            self.body = nn.Linear(4, 4)

    with pytest.raises(BlockDiscoveryError, match=r"\(lists seen: 'stem'\)"):
        find_blocks(Flat())


# ---------------------------------------------------------------------------------------------- the watchdog's report
class _Ended(BaseException):
    """What ``os._exit`` does to a monitor's thread here: it ends."""


def test_the_watchdog_report_is_printed_once_and_after_the_other_ranks_are_ending(monkeypatch):
    """Rank 0 decides first (rank 2 stopped); rank 1, still running, would print c10d's stack traces once rank 0 (the
    store's host) is gone. Rank 0 prints only after rank 1 has silenced itself and said it is ending; rank 1 exits
    only after the report; nobody else prints."""
    import threading
    import time

    from lightning_galvatron.runtime import watchdog
    from tests.test_failures import _Store

    events: list[tuple[str, str]] = []

    def record(what: str) -> None:
        events.append((threading.current_thread().name, what))

    def exit_(code: int) -> None:
        record(f"exit {code}")
        raise _Ended

    stream = SimpleNamespace(write=lambda text: text.strip() and record(f"print {text.strip()}"), flush=lambda: None)

    def kill(pid: int, sig: int) -> None:
        if sig:  # every monitor here is this process: a stuck rank's kill is recorded, not done
            record(f"kill {sig}")

    fake_os = SimpleNamespace(getpid=os.getpid, environ=os.environ, kill=kill, dup2=lambda *a: None, _exit=exit_)
    monkeypatch.setattr(watchdog, "os", fake_os)
    monkeypatch.setattr(watchdog, "sys", SimpleNamespace(stderr=stream))
    monkeypatch.setattr(watchdog, "_silence_stderr", lambda: record("silenced") or -1, raising=False)
    store = _Store()
    monitors = [watchdog.RankMonitor(r, 3, watchdog.WatchdogSettings(), store, run=0) for r in range(3)]
    for monitor in monitors:
        monitor._publish()
        monitor._read_all()

    def end(rank: int, report: str | None, at_fault: set[int]) -> threading.Thread:
        def run() -> None:
            try:
                monitors[rank]._end(report, at_fault)
            except _Ended:
                pass

        thread = threading.Thread(target=run, name=f"rank {rank}", daemon=True)
        thread.start()
        return thread

    reporter = end(0, "Galvatron watchdog: rank 2 missing", {2})
    time.sleep(0.5)
    assert [e for e in events if e[1].startswith("print")] == [], events  # rank 1 still runs: no report yet
    quiet = end(1, None, set())
    reporter.join(10)
    quiet.join(10)
    printed = [e for e in events if e[1].startswith("print")]
    assert printed == [("rank 0", "print Galvatron watchdog: rank 2 missing")], events
    assert events.index(("rank 1", "silenced")) < events.index(printed[0]) < events.index(("rank 1", "exit 75"))
