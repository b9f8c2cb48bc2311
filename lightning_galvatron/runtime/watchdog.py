"""Who is stuck, who died, who reports: a side channel between the ranks, off the training's hot path.

A collective waits for every rank of its group, by default for 30 minutes, and then says nothing about which rank
it waited for; a rank that dies makes the others fail with the transport's "connection reset". The
:class:`RankMonitor` fixes both without a collective of its own:

* every rank's background thread writes a heartbeat record into the job's rendezvous store (the TCPStore that
  ``MASTER_ADDR``/``MASTER_PORT`` name: its own client connection, with a short timeout): a beat counter, the
  rank's progress counter and where it is ("training step 12"), its process id and host;
* the training loop moves the progress counter at a few points (setup stages, the start and end of each
  training step, checkpoints): an assignment, nothing more;
* the same thread reads the other ranks' records and decides, on every rank alike, when the job is stuck:
  a rank whose heartbeat stopped (SIGSTOP, a hang that holds the interpreter) or that stayed behind the others
  (a data loader that never returns) for longer than the timeout; or every rank inside the same training step
  for much longer than any step took. Then every rank silences its standard error and says it is ending; the
  first to decide waits (briefly) until the others are ending too and prints which ranks are missing and where the
  others wait -- the last thing the job prints, not followed by c10d's stack traces from ranks whose peers went
  away -- the stuck ranks are killed, and every rank exits;
* when a rank's step fails (an exception), :meth:`RankMonitor.failure_report` names the ranks that died
  (their process is gone, or their heartbeat stopped) so the message says who, and
  :meth:`RankMonitor.claim_first_failure` lets exactly one rank -- the first to fail -- print its error.

Timeouts (:class:`WatchdogSettings`): ``setup_timeout_s`` (default 5 minutes) applies to setup, checkpoints and
everything before the second training step; afterwards ``step_timeout_s``, by default ``step_time_factor``
times the longest training step so far (data loading included) but at least ``min_step_timeout_s``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

T = TypeVar("T")

EXIT_CODE = 75  # what every rank of a job the watchdog ended exits with
_PREFIX = "lightning_galvatron/monitor"
_SEPARATOR = "\x1f"
_ENDING = ("ended", "reported")  # states of a rank the watchdog is ending the job on


@dataclass(frozen=True)
class WatchdogSettings:
    """When a rank that makes no progress ends the job (see the module docstring)."""

    setup_timeout_s: float = 300.0
    step_timeout_s: float | None = None
    step_time_factor: float = 10.0
    min_step_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("setup_timeout_s", "step_timeout_s", "step_time_factor", "min_step_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "step_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise ValueError(f"watchdog {name} must be a positive number of seconds, got {value!r}")

    @classmethod
    def of(cls, value: bool | Mapping[str, float] | WatchdogSettings | None) -> WatchdogSettings | None:
        """``True``: the defaults; ``False``/``None``: no watchdog; a dict: these fields."""
        if value is True:
            return cls()
        if value is False or value is None:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {"setup_timeout_s", "step_timeout_s", "step_time_factor", "min_step_timeout_s"}
            unknown = set(value) - known
            if unknown:
                raise ValueError(f"unknown watchdog settings {sorted(unknown)}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(f"watchdog must be True, False or a dict of {sorted(cls.__dataclass_fields__)}, got {value!r}")


@dataclass
class _Record:
    """One rank as the others see it."""

    beat: int
    progress: int
    in_step: bool  # inside a training step (vs. between steps, in setup, ...)
    limit_s: float  # how long it may stay where it is
    state: str  # "running", "finished" or "failed"
    where: str
    pid: int
    host: str

    def encode(self) -> str:
        fields = (
            self.beat,
            self.progress,
            int(self.in_step),
            self.limit_s,
            self.state,
            self.where,
            self.pid,
            self.host,
        )
        return _SEPARATOR.join(map(str, fields))

    @classmethod
    def decode(cls, raw: bytes) -> _Record:
        beat, progress, in_step, limit_s, state, where, pid, host = raw.decode().split(_SEPARATOR)
        return cls(int(beat), int(progress), in_step == "1", float(limit_s), state, where, int(pid), host)


@dataclass
class _Seen:
    """What this rank last saw of another and when (on its own monotonic clock: hosts' clocks may differ)."""

    record: _Record | None = None
    beat_changed: float = 0.0
    progress_changed: float = 0.0


class RankMonitor:
    """Heartbeats, stall detection and failure reports for one rank (see the module docstring)."""

    _generation = 0  # monitors made in this process so far: the same on every rank, so it names the run

    def __init__(
        self, rank: int, world_size: int, settings: WatchdogSettings, store: Store, run: int | None = None
    ) -> None:
        """``run`` names the job's run in the store (default: how many monitors this process has made, which every
        rank counts alike)."""
        RankMonitor._generation += 1
        self.rank, self.world_size, self.settings = rank, world_size, settings
        self._store = store
        self._store_lock = threading.Lock()
        self._store_gone: Exception | None = None
        self._prefix = f"{_PREFIX}/{RankMonitor._generation if run is None else run}"
        self._host = socket.gethostname()
        self._progress = 0
        self._where = "setting up"
        self._phase = "setup"  # "setup" (setup, checkpoints), "step" (inside a training step) or "between steps"
        self._state = "running"
        self._step_started: float | None = None
        self._steps_timed = 0
        self._longest_step = 0.0
        self._beat = 0
        started = time.monotonic()
        self._seen = [_Seen(beat_changed=started, progress_changed=started) for _ in range(world_size)]
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when the limit changes kind (setup <-> training): beat now
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- making one
    @classmethod
    def connect(cls, rank: int, world_size: int, settings: WatchdogSettings | None) -> RankMonitor | None:
        """A started monitor on the job's rendezvous store, or ``None`` (no watchdog, one process, no store)."""
        if settings is None or world_size < 2:
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        import torch.distributed as dist

        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]  # torch re-exports it implicitly
                host,
                int(port),
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=_store_timeout(settings)),
            )
        except Exception:  # noqa: BLE001 - no side channel: train without a watchdog rather than not at all
            return None
        monitor = cls(rank, world_size, settings, store)
        monitor.start()
        return monitor

    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._run, name="lightning-galvatron-watchdog", daemon=True)
        self._thread.start()

    def stop(self, failure: BaseException | None = None) -> None:
        """Stop watching; the others see this rank as finished (or failed, with the error) rather than missing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._state = "finished" if failure is None else "failed"
        if failure is not None:
            self._where = f"{self._where}, with {_one_line(failure)}"
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the store is gone with the job
            pass

    # ---------------------------------------------------------------- progress (main thread, cheap)
    def mark(self, where: str) -> None:
        """This rank moved on to ``where``: a setup stage, a checkpoint, ... (judged with the setup timeout)."""
        self._progress += 1
        self._where = where
        self._enter("setup")

    def step_started(self, step: int) -> None:
        now = time.monotonic()
        if self._step_started is not None:  # from one step's start to the next: data loading included
            self._longest_step = max(self._longest_step, now - self._step_started)
            self._steps_timed += 1
        self._step_started = now
        self._progress += 1
        self._where = f"training step {step}"
        self._enter("step")

    def step_finished(self, step: int) -> None:
        self._progress += 1
        self._where = f"after training step {step} (loading the next batch, callbacks)"
        self._enter("between steps")

    def evaluation_step(self, stage: str, step: int) -> None:
        """A validation/test/predict step (judged like the time between training steps)."""
        self._progress += 1
        self._where = f"{stage} step {step}"
        self._enter("between steps")

    def _enter(self, phase: str) -> None:
        if (phase == "setup") != (self._phase == "setup"):
            self._wake.set()  # the others should learn this rank's new limit now, not at the old limit's pace
        self._phase = phase

    def _limit(self) -> tuple[float, str]:
        """The time without progress this rank tolerates now, and which setting says so."""
        s = self.settings
        if self._phase == "setup":
            return s.setup_timeout_s, "watchdog setup_timeout_s"
        if s.step_timeout_s is not None:
            return s.step_timeout_s, "watchdog step_timeout_s"
        if self._steps_timed == 0:  # the first step warms up: no step time to go by yet
            return s.setup_timeout_s, "watchdog setup_timeout_s, until a step has been timed"
        derived = s.step_time_factor * self._longest_step
        if derived < s.min_step_timeout_s:
            return s.min_step_timeout_s, "watchdog min_step_timeout_s"
        return derived, f"{s.step_time_factor:g} x the longest training step, {self._longest_step:.2f} s"

    # ---------------------------------------------------------------- failures (main thread)
    def claim_first_failure(self) -> bool:
        """Whether this rank is the first of the job to fail (so the one to print); ``True`` when unsure."""
        try:
            return int(self._on_store(lambda store: store.add(f"{self._prefix}/failures", 1))) == 1
        except Exception:  # noqa: BLE001 - the store is gone (its host died): the lowest survivor reports
            dead = self.dead_ranks(wait_s=0.0)
            return self.rank == min(set(range(self.world_size)) - dead, default=self.rank)

    def dead_ranks(self, wait_s: float = 2.0) -> set[int]:
        """Ranks whose process is gone (answerable on this host), or whose heartbeat stops within ``wait_s``
        (when it beats more often than that)."""
        try:
            self._read_all()
        except Exception:  # noqa: BLE001 - the store is gone: what was seen last still names the processes
            pass
        dead = {
            r for r, seen in enumerate(self._seen) if seen.record is not None and _process_gone(seen.record, self._host)
        }
        if dead or wait_s <= 0 or self._beat_interval() >= wait_s:
            return dead
        before = {
            r: seen.record.beat for r, seen in enumerate(self._seen) if seen.record is not None and r != self.rank
        }
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                self._read_all()
            except Exception:  # noqa: BLE001
                break
        return {
            r
            for r, beat in before.items()
            if (record := self._seen[r].record) is not None and record.beat == beat and record.state == "running"
        }

    def failure_report(self, exception: BaseException) -> str | None:
        """A message naming the ranks that died, if that is why this rank failed; else ``None``."""
        dead = {  # failed ones said why
            r for r in self.dead_ranks() if (record := self._seen[r].record) is not None and record.state != "failed"
        }
        if not dead:
            return None
        lines = []
        for r in sorted(dead):
            record = self._seen[r].record
            assert record is not None
            lines.append(
                f"rank {r} (pid {record.pid} on {record.host}) died (killed, or crashed without a Python error); it "
                f"was last seen in {record.where}"
            )
        return "Galvatron: " + "; ".join(lines) + f". The other ranks stopped ({_one_line(exception)})."

    def failed_elsewhere(self) -> str | None:
        """The other ranks that failed with an error of their own, as they published it: what this rank's error
        (a closed connection, a timeout) most likely echoes; ``None`` if none did."""
        try:
            self._read_all()
        except Exception:  # noqa: BLE001 - the store is gone: what was seen last still says it
            pass
        failed = [
            f"rank {r} failed in {seen.record.where}"
            for r, seen in enumerate(self._seen)
            if r != self.rank and seen.record is not None and seen.record.state == "failed"
        ]
        return f"Galvatron: {'; '.join(failed)} (that rank prints its error)" if failed else None

    # ---------------------------------------------------------------- the thread
    def _beat_interval(self) -> float:
        return min(max(self._limit()[0] / 5, 0.2), 10.0)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._beat_interval())
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
                self._read_all()
                verdict = self._verdict()
            except Exception as err:  # noqa: BLE001 - the store does not answer: its host is stopped or gone
                verdict = self._store_lost(err)
            if verdict is not None and not self._stop.is_set():
                self._end(*verdict)

    def _publish(self) -> None:
        self._beat += 1
        limit, _ = self._limit()
        record = _Record(
            self._beat, self._progress, self._phase == "step", limit, self._state, self._where, os.getpid(), self._host
        )
        self._on_store(lambda store: store.set(self._key(self.rank), record.encode()))

    def _on_store(self, operation: Callable[[Store], T]) -> T:
        """``operation(store)``, one thread at a time; once the store's host is gone, fail at once (every
        attempt on a dead connection makes c10d print a stack trace)."""
        if self._store_gone is not None:
            raise self._store_gone
        with self._store_lock:
            try:
                return operation(self._store)
            except Exception as err:
                if "timeout" not in str(err).lower():  # refused, reset, broken pipe: not coming back
                    self._store_gone = err
                raise

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/rank{rank}"

    def _read_all(self) -> None:
        keys = [self._key(r) for r in range(self.world_size)]

        def read(store: Store) -> dict[str, bytes]:
            present = keys if store.check(keys) else [k for k in keys if store.check([k])]
            return dict(zip(present, store.multi_get(present))) if present else {}

        values = self._on_store(read)
        now = time.monotonic()
        for r, key in enumerate(keys):
            if key not in values:
                continue
            record, seen = _Record.decode(values[key]), self._seen[r]
            if seen.record is None or record.beat != seen.record.beat:
                seen.beat_changed = now
            if seen.record is None or record.progress != seen.record.progress:
                seen.progress_changed = now
            seen.record = record

    def _verdict(self) -> tuple[str | None, set[int]] | None:
        """``(report, ranks at fault)`` when the job is stuck, else ``None``: the same rule on every rank. The
        report is ``None`` when another rank is ending the job and this one sees no cause itself (it ends quietly).

        A rank is judged by the longer of this rank's limit and its own (a rank writing a checkpoint has the
        setup timeout even while the others wait in a step); a rank that is ending the job is not at fault.
        """
        now = time.monotonic()
        limit, reason = self._limit()
        waited = now - self._seen[self.rank].progress_changed  # how long this rank has been where it is
        missing, behind = set(), set()
        lead = max((s.record.progress for s in self._seen if s.record is not None), default=0)
        for r, seen in enumerate(self._seen):
            record = seen.record
            if r == self.rank or (record is not None and record.state in _ENDING):
                continue
            allowed = max(limit, record.limit_s if record is not None else 0.0)
            if record is None:  # never started its monitor
                if now - seen.beat_changed > allowed:
                    missing.add(r)
            elif record.state == "running":
                if now - seen.beat_changed > allowed:
                    missing.add(r)
                elif record.progress < lead and now - seen.progress_changed > allowed:
                    behind.add(r)
            elif waited > allowed and (record.state == "failed" or self._phase == "step"):
                missing.add(r)  # failed, or finished while this rank waits inside a step
        if self._progress < lead and waited > limit:
            behind.add(self.rank)
        if missing or behind:
            return self._describe(missing, behind, limit, reason), missing | behind
        running = [s.record for s in self._seen if s.record is not None and s.record.state == "running"]
        in_one_step = len(running) == self.world_size and all(r.in_step and r.progress == lead for r in running)
        if in_one_step and waited > limit:
            report = (
                f"Galvatron watchdog: no rank has finished {self._where} in {limit:.0f} s ({reason}); every rank is "
                "inside it, waiting for the others: a collective that not every rank calls, or a rank stuck in its "
                "own computation. Ending the job."
            )
            return (
                report,
                set(),
            )
        others = [seen.record for r, seen in enumerate(self._seen) if r != self.rank and seen.record is not None]
        return (None, set()) if any(record.state in _ENDING for record in others) else None

    def _describe(self, missing: set[int], behind: set[int], limit: float, reason: str) -> str:
        lines = [f"Galvatron watchdog: no progress for {limit:.0f} s ({reason})."]
        for r in sorted(missing):
            record = self._seen[r].record
            if record is None:
                lines.append(f"  rank {r}: missing -- it never reached the strategy's setup")
            elif record.state == "running":
                lines.append(
                    f"  rank {r}: missing -- no heartbeat (stopped, or hung without releasing Python); last seen in "
                    f"{record.where} (pid {record.pid} on {record.host})"
                )
            else:
                lines.append(f"  rank {r}: {record.state} -- {record.where} (pid {record.pid} on {record.host})")
        for r in sorted(behind):
            record = self._seen[r].record
            assert record is not None
            lines.append(f"  rank {r}: stuck in {record.where}, behind the others (pid {record.pid} on {record.host})")
        waiting: dict[str, list[int]] = {}
        for r, seen in enumerate(self._seen):
            if r not in missing and r not in behind and seen.record is not None:
                waiting.setdefault(seen.record.where, []).append(r)
        for where, ranks in waiting.items():
            lines.append(f"  {_ranks(ranks)}: waiting in {where}")
        lines.append("Ending the job.")
        return "\n".join(lines)

    def _store_lost(self, err: Exception) -> tuple[str, set[int]] | None:
        """The store does not answer: its host (rank 0 under Lightning's launcher) is gone, or stopped (then only
        after the timeout: it may just be slow)."""
        limit, reason = self._limit()
        if self._store_gone is None and time.monotonic() - self._seen[self.rank].beat_changed <= limit:
            return None
        state = "is gone" if self._store_gone is not None else f"has not answered for {limit:.0f} s ({reason})"
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it, not rank 0
        host = "torchrun's agent on the first node" if agent else "rank 0's process"
        report = (
            f"Galvatron watchdog: the job's rendezvous store ({os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')}) {state} ({_one_line(err)}): {host}, which hosts it, is stopped or "
            "gone. Ending the job."
        )
        return report, {0} if self.rank != 0 and not agent else set()

    def _end(self, report: str | None, at_fault: set[int]) -> None:
        """End the job. Every rank first silences its standard error (the c10d stack traces of a process whose peers
        or store host are gone are not the user's business) and says it is ending. The first rank to end with a
        report (every rank in debug mode) waits until the others not at fault are ending too (bounded), prints the
        report -- the last thing the job prints -- and exits; the others exit once it has. Each rank kills the
        stuck ranks on its host on the way out."""
        from lightning_galvatron.errors import debug_enabled

        stderr = _silence_stderr()
        self._state = "ended"
        deadline = time.monotonic() + min(max(2 * self._beat_interval(), 1.0), 15.0)
        reports = False
        try:
            self._publish()
            reports = report is not None and (debug_enabled() or self._claim("report"))
            if reports:
                self._wait_until(deadline, lambda: all(self._ending(r) for r in set(range(self.world_size)) - at_fault))
                self._state = "reported"
                self._publish()
            else:
                self._wait_until(deadline + 5.0, self._reported)
        except Exception:  # noqa: BLE001 - the store is gone with its host: the lowest rank not at fault reports
            reports = report is not None and self.rank == min(set(range(self.world_size)) - at_fault, default=self.rank)
        for r in at_fault - {self.rank}:
            record = self._seen[r].record
            if record is not None and record.host == self._host and record.state == "running":
                try:
                    os.kill(record.pid, signal.SIGKILL)
                except OSError:
                    pass
        if reports:
            os.dup2(stderr, 2)
            prefix = f"[rank {self.rank}] " if debug_enabled() else ""
            print(f"{prefix}{report}", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    def _claim(self, what: str) -> bool:
        """Whether this rank is the first of the job to claim ``what`` (through the store)."""
        return int(self._on_store(lambda store: store.add(f"{self._prefix}/{what}", 1))) == 1

    def _reported(self) -> bool:
        return any(seen.record is not None and seen.record.state == "reported" for seen in self._seen)

    def _ending(self, rank: int) -> bool:
        record = self._seen[rank].record
        return record is not None and (record.state != "running" or _process_gone(record, self._host))

    def _wait_until(self, deadline: float, done: Callable[[], bool]) -> None:
        """Poll the others' records until ``done()`` or the deadline (a store error ends it: the store is gone)."""
        while time.monotonic() < deadline:
            self._read_all()
            if done():
                return
            time.sleep(0.05)


def _silence_stderr() -> int:
    """Point this process's standard error (fd 2, where C++ writes too) at the null device; return the old one."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return saved


def _store_timeout(settings: WatchdogSettings) -> float:
    return max(1.0, min(settings.setup_timeout_s, settings.step_timeout_s or settings.setup_timeout_s) / 2)


def _process_gone(record: _Record, host: str) -> bool:
    """Whether the process of ``record`` no longer runs (only answerable on its own host)."""
    if record.host != host:
        return False
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    try:  # a child its parent has not reaped yet still exists, as a zombie
        with open(f"/proc/{record.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _one_line(exception: BaseException) -> str:
    text = str(exception).strip()
    return f"{type(exception).__name__}: {text.splitlines()[0]}" if text else type(exception).__name__


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
