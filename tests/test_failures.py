"""When something goes wrong in a running job (issue 13): one message, naming the rank or the file, and the job ends.

Launched tests start a real job the way users do (``python tests/helpers/launched_job.py``: Lightning's launcher
starts the other process), stop or kill one rank mid-training and read what the user sees. The cache test runs in
the pool: a cached profile that does not belong to the live model is measured again, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from lightning_galvatron.errors import note_cause
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.profiler import profile
from lightning_galvatron.profiler.cache import ProfileCache, contradiction, fingerprint, model_signature
from lightning_galvatron.runtime.watchdog import EXIT_CODE, RankMonitor, WatchdogSettings
from tests.helpers.training import dataset, tiny_gpt
from tests.search_profiles import synthetic_profile

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "helpers" / "launched_job.py"
STEP_TIMEOUT_S = 5.0


def _launch(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(JOB), str(out), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_pids(job: subprocess.Popen, out: Path, devices: int, timeout_s: float = 120) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    files = [out / f"rank{r}.pid" for r in range(devices)]
    while not all(f.is_file() and f.read_text() for f in files):
        assert job.poll() is None, job.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)
    return {r: int(f.read_text()) for r, f in enumerate(files)}


def _finish(job: subprocess.Popen, pids: dict[int, int], timeout_s: float) -> tuple[int, str, float, list[int]]:
    """Exit status, output, seconds until the launching process ended, and the ranks whose process still ran."""
    started = time.monotonic()
    try:
        output, _ = job.communicate(timeout=timeout_s)
        took = time.monotonic() - started
        time.sleep(0.5)  # the other processes end right after the launching one
        running = [rank for rank, pid in pids.items() if _running(pid)]
    finally:
        for pid in pids.values():  # never leave a stopped process behind, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if job.poll() is None:
            job.kill()
    return job.returncode, output, took, running


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _user_lines(output: str) -> str:
    """What a user reads: without c10d's socket warnings and Lightning's banner."""
    return "\n".join(line for line in output.splitlines() if "[c10d]" not in line and not line.startswith("frame #"))


@pytest.mark.timeout(240)
def test_a_stopped_rank_ends_the_job_with_its_name(tmp_path):
    watchdog = json.dumps({"setup_timeout_s": 60, "step_timeout_s": STEP_TIMEOUT_S})
    job = _launch(tmp_path, "--plan", "ddp", "--watchdog", watchdog)
    pids = _wait_for_pids(job, tmp_path, 2)
    os.kill(pids[1], signal.SIGSTOP)
    code, output, took, running = _finish(job, pids, timeout_s=60)
    assert code == EXIT_CODE, output[-3000:]
    assert running == []  # the stopped rank was ended too
    assert took < STEP_TIMEOUT_S + 15, took  # the timeout, a beat, and the exit
    text = _user_lines(output)
    assert f"Galvatron watchdog: no progress for {STEP_TIMEOUT_S:.0f} s (watchdog step_timeout_s)." in text, text[
        -3000:
    ]
    assert (
        "rank 1: missing -- no heartbeat (stopped, or hung without releasing Python); last seen in training step"
        in text
    )
    assert f"(pid {pids[1]} on " in text
    # Rank 0 waits for rank 1 in the step's collectives, or right after its step if rank 1 stopped between steps.
    assert re.search(r"rank 0: waiting in (after )?training step", text) and "Ending the job." in text, text[-3000:]
    assert text.count("Galvatron watchdog:") == 1 and "Traceback" not in text


@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_once(tmp_path):
    job = _launch(tmp_path, "--plan", "ddp")
    pids = _wait_for_pids(job, tmp_path, 2)
    os.kill(pids[1], signal.SIGKILL)
    code, output, _, running = _finish(job, pids, timeout_s=60)
    assert code != 0 and running == []
    text = _user_lines(output)
    assert f"Galvatron: rank 1 (pid {pids[1]} on " in text, text[-3000:]
    assert "died (killed, or crashed without a Python error); it was last seen in training step" in text
    assert "The other ranks stopped (RuntimeError: " in text  # gloo's own words, once, in that line
    assert text.count("Galvatron: rank 1") == 1 and "Traceback" not in text


@pytest.mark.timeout(240)
def test_an_interrupted_checkpoint_is_reported_once(tmp_path):
    """What a save killed midway leaves (shards, no .metadata): one message naming it, not a traceback per rank."""
    checkpoint = tmp_path / "epoch=0-step=32.ckpt"
    checkpoint.mkdir()
    (checkpoint / "__0_0.distcp").write_bytes(b"half a shard")
    job = _launch(tmp_path, "--plan", "ddp", "--ckpt-path", str(checkpoint), "--max-steps", "4")
    code, output, _, _ = _finish(job, {}, timeout_s=120)
    assert code == 1
    text = _user_lines(output)
    message = (
        f"CheckpointError: checkpoint directory '{checkpoint}' is incomplete: it holds 1 shard file(s) but has "
        "no .metadata file, which DCP writes last -- the save that wrote it was interrupted; resume from an "
        "earlier checkpoint"
    )
    assert text.count(message) == 1, text[-4000:]
    assert text.count("Traceback") == 1


# ---------------------------------------------------------------------------------------------- the rule
class _Store:
    """The part of a TCPStore the monitor uses, in memory (shared by monitors standing for different ranks)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


def test_the_rank_behind_is_named_and_a_slow_step_everywhere_is_not(monkeypatch):
    """A rank whose data loader never returns stays behind the others (it is named after the timeout); every rank
    busy in the same phase between steps is not a stall, however long."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    store, settings = _Store(), WatchdogSettings(setup_timeout_s=100, step_timeout_s=10)
    monitors = [RankMonitor(r, 3, settings, store, run=0) for r in range(3)]
    for step in range(3):
        for m in monitors:
            m.step_started(step)
            m.step_finished(step)
    for m in monitors[:2]:  # ranks 0 and 1 fetched their batch and wait in step 3; rank 2 never gets its batch
        m.step_started(3)

    def poll() -> list:
        for m in monitors:
            m._publish()
        for m in monitors:
            m._read_all()
        return [m._verdict() for m in monitors]

    assert poll() == [None, None, None]
    clock[0] += 11
    for m in monitors:  # everyone still beats (the stuck rank's thread runs)
        m._publish()
    verdicts = poll()
    assert all(v is not None for v in verdicts)
    report, at_fault = verdicts[0]
    assert at_fault == {2}
    assert "rank 2: stuck in after training step 2 (loading the next batch, callbacks), behind the others" in report
    assert "ranks 0, 1: waiting in training step 3" in report

    monitors[2].step_started(3)  # it got its batch after all; then every rank spends long between steps
    for m in monitors:
        m.step_finished(3)
    poll()
    clock[0] += 1000
    assert poll() == [None, None, None]


def test_an_echo_of_another_ranks_error_names_it():
    """The last pipeline stage fails in the user's step; rank 0 only sees the connection close (or time out). Its
    error says which rank failed and with what, wherever it is printed or caught (rank 1 prints the error itself)."""
    store = _Store()
    ranks = [RankMonitor(r, 2, WatchdogSettings(), store, run=0) for r in range(2)]
    for monitor in ranks:
        monitor.evaluation_step("validation", 0)
        monitor._publish()
    assert ranks[1].claim_first_failure()
    ranks[1].stop(failure=TypeError("self.log('val_acc', MulticlassAccuracy) cannot be averaged"))
    echo = RuntimeError("Connection closed by peer [127.0.0.1]:38600")
    assert not ranks[0].claim_first_failure()
    assert ranks[0].failure_report(echo) is None  # rank 1 failed with its own error: it did not die
    note_cause(echo, ranks[0].failed_elsewhere())
    assert (
        "Galvatron: rank 1 failed in validation step 0, with TypeError: self.log('val_acc', MulticlassAccuracy) "
        "cannot be averaged (that rank prints its error)"
    ) in "".join(traceback.format_exception(echo))


# ---------------------------------------------------------------------------------------------- the cache
def _profile_with_a_foreign_cache_file(cache: str) -> tuple[str, int, int]:
    """Profile, put a profile of another model (16x the parameters per block) under this model's key, profile again."""
    module = tiny_gpt()
    structure = find_blocks(module)
    example = dataset(8)[0:2]
    first = profile(module, structure, example, cache=cache, devices_per_node=dist.get_world_size())
    (cached,) = Path(cache).glob("*.json")
    foreign = first.to_dict()
    foreign["fingerprint"] = {**first.fingerprint, "model": "0" * 32}
    foreign["model"]["layer_types"][0]["parameters"] *= 16
    dist.barrier()
    if dist.get_rank() == 0:
        cached.write_text(json.dumps(foreign))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = profile(module, structure, example, cache=cache, devices_per_node=dist.get_world_size())
    stored = json.loads(cached.read_text())
    return "\n".join(str(w.message) for w in caught), again.model.layer_types[0].parameters, stored["fingerprint"]


def test_a_cached_profile_of_another_model_is_measured_again(pools, profile_cache):
    messages, parameters, stored = pools(2).run(_profile_with_a_foreign_cache_file, str(profile_cache))[0]
    assert re.search(
        r"ignoring the cached profile .*/cache/\w+\.json: it was measured on another model or cluster "
        r"\(its fingerprint differs in model\); profiling again and overwriting it",
        messages,
    ), messages
    block = find_blocks(tiny_gpt()).blocks[0]
    assert parameters == sum(p.numel() for p in block.parameters())  # the live model's profile
    assert stored["model"] != "0" * 32  # and it replaced the foreign file


def test_a_cache_file_is_not_trusted_for_its_name(tmp_path):
    """A profile without a fingerprint, or whose content contradicts the live model, is not used."""
    model = tiny_gpt()
    structure = find_blocks(model)
    measured_on = fingerprint(
        model_signature(model, structure), precision="32-true", sample_shapes=[], device_kind="cpu", world_size=2
    )
    synthetic = synthetic_profile(np.random.default_rng(0), num_blocks=4, devices_per_node=2)
    cache = ProfileCache(tmp_path)
    cache.save("key", synthetic)
    with pytest.warns(
        UserWarning,
        match=r"ignoring the cached profile .*key\.json: it does not say what it was "
        r"measured on \(no fingerprint\); profiling again",
    ):
        assert cache.load("key", fingerprint=measured_on) is None
    forged = dataclasses.replace(synthetic, fingerprint=measured_on)
    cache.save("key", forged)
    assert cache.load("key", fingerprint=measured_on) == forged
    assert re.fullmatch(
        r"its block 0 has \d+ parameters but the model's has 12704", contradiction(forged, structure, 2)
    )
    assert contradiction(forged, structure, 4) is not None
    fewer = dataclasses.replace(forged, model=forged.model.with_num_blocks(6))
    assert contradiction(fewer, structure, 2) == "it describes 6 blocks but the model has 4"
