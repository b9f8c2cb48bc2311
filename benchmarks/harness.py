"""Shared measuring harness of the benchmarks: the model, the data, the worker pool and the probes.

Every measurement trains the example GPT (``examples/gpt.py``) with a real ``lightning.Trainer`` on
the ranks of a pool of forked gloo workers (``benchmarks/pool.py``: the workers keep their process
group between runs, so a run costs the Trainer's setup, not a launch). The calibration probes and their
runtime profiling are the library's (:mod:`lightning_galvatron.cli.calibrate`). What a run measures, per rank:

Step time
    the wall-clock time between the starts of consecutive training steps (``on_train_batch_start``):
    forward, backward, gradient synchronisation, the optimizer step and Lightning's own per-step work,
    as a user's throughput sees it. Steps are collective, so ranks keep pace; a step's time is the
    slowest rank's, and a run reports the median over its timed steps (after warm-up steps).

Peak memory per rank (CPU)
    an allocator-level peak, the CPU counterpart of ``torch.cuda.max_memory_allocated``: the PyTorch
    profiler with ``profile_memory=True`` reports every allocation and free of the CPU allocator while it
    runs. It runs over two steps; at the start of the second (the step measured) the live model states
    are counted by storage -- parameters (local shards), gradients and optimizer states, each storage
    once -- and from then on the running sum of allocations minus frees gives what the step adds: saved
    activations, gathered (unsharded) weights, gradient buffers before their reduction, temporaries of
    every op, the optimizer's temporaries. Peak = states at the start + the largest running sum.
    Allocations made before the profiler started are only seen through the state count (the first of
    the two profiled steps makes sure that everything freed in the measured step was allocated under the
    profiler), so other persistent buffers are counted explicitly: PyTorch DDP's gradient buckets
    (Lightning's ``DDPStrategy``), a flat copy of every gradient that DDP allocates when it wraps the
    model and keeps (counted from its parameters, see :func:`_persistent_buffer_bytes`). Starting the
    profile before the model is wrapped would see such buffers without naming them, but it misses frees:
    tried, a profile from ``setup`` over the first steps kept one flat gradient bucket of Galvatron's DDP
    layers (6 MiB) counted on one rank of two and not on the other -- a free the profiler did not see,
    likely on gloo's thread, which can drop the last reference to an asynchronous collective's buffer
    (the profiler's ``profile_all_threads`` option records no memory events at all). Not counted: memory that
    does not come from PyTorch's CPU allocator (gloo's buffers, the interpreter), the input batch.

    On CUDA the same probe reports ``torch.cuda.max_memory_allocated`` over the measured step (peak
    statistics reset at its start).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Kineto prints a line at every profiler start and stop unless told otherwise before the profiler's first use.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

torch.set_num_threads(1)  # forked workers hang if the parent ran OpenMP threads; 4 processes share 2 cores

import lightning.pytorch as L
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.pool import WorkerPool
from examples.gpt import ArithmeticText, GPTModule
from lightning_galvatron.cli.calibrate import CalibrationProbe

RESULTS = REPO / "benchmarks" / "results"


# ---------------------------------------------------------------------------------------------- model and data
@dataclass(frozen=True)
class BenchModel:
    """The example GPT at a size where plans differ visibly on a few CPU processes: model states and
    activations of the same order (so ZeRO, recompute and TP each change memory), steps of tenths of a
    second (so communication and compute both matter)."""

    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 128
    seq_length: int = 64
    vocab_size: int = 32
    global_batch: int = 16
    learning_rate: float = 1e-3

    def module_kwargs(self) -> dict[str, Any]:
        return dict(
            vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            learning_rate=self.learning_rate,
        )

    def describe(self) -> str:
        return (
            f"GPT {self.n_layer} blocks, hidden {self.n_embd}, {self.n_head} heads, sequence {self.seq_length}, "
            f"vocabulary {self.vocab_size}, global batch {self.global_batch}, AdamW, fp32"
        )


class FSDP2GPT(GPTModule):
    """The example GPT for Lightning's own ``ModelParallelStrategy``: a hand-written ``configure_model``
    with FSDP2 (``fully_shard``) on every block and on the model, as Lightning's documentation does it."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def model_parallel_fsdp2() -> Any:
    """Lightning's ``ModelParallelStrategy`` with FSDP2 over every device (no tensor parallelism)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1)


def make_module(model: BenchModel, cls: type[GPTModule] = GPTModule) -> GPTModule:
    torch.manual_seed(1234)
    return cls(**model.module_kwargs())


def make_loader(model: BenchModel, world_size: int, samples: int | None = None) -> DataLoader:
    """DDP's per-device batch: the global batch over the ranks (the strategies re-batch as they need)."""
    samples = samples or model.global_batch * 64
    return DataLoader(
        ArithmeticText(samples, model.seq_length, seed=0), batch_size=model.global_batch // world_size, shuffle=True
    )


# ---------------------------------------------------------------------------------------------- probes
def _live_state_bytes(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes of the distinct storages holding parameters (local shards), gradients and optimizer states."""
    from torch.distributed.tensor import DTensor

    seen: dict[tuple, int] = {}

    def add(t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[(local.device.type, storage.data_ptr())] = storage.nbytes()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                add(v)
    return sum(n for (_, ptr), n in seen.items() if ptr)


def _persistent_buffer_bytes(model: Any) -> int:
    """Persistent buffers of the wrapping strategy that are not parameters, gradients or optimizer states: PyTorch
    DDP's gradient buckets, one slot per parameter that needs a gradient (none extra when the gradients are views
    into the buckets: the state count sees the buckets' storages then)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    return sum(p.numel() * p.element_size() for p in model.module.parameters() if p.requires_grad)


_MARKER_BYTES = 7_777_771  # an allocation of this odd size marks the start of the measured step in the trace


class StepProbe(L.Callback):
    """Times every training step; profiles the memory of two steps after the timed ones (see the module doc)."""

    def __init__(self, warmup: int, timed: int, memory: bool = True) -> None:
        self.warmup, self.timed, self.memory = warmup, timed, memory
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []  # this process's CPU time (every thread) at the same moments
        self.phases: list[dict[str, float]] = []  # per step: moments of its phases, relative to its start
        self.states_at_start = 0
        self.peak_bytes: int | None = None
        self.cuda = False
        self._profiler: Any = None

    @property
    def total_steps(self) -> int:
        return self.warmup + self.timed + 1 + (2 if self.memory else 0)

    def _phase(self, name: str) -> None:
        if self.phases:
            self.phases[-1].setdefault(name, time.perf_counter() - self.starts[-1])

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._phase("backward_start")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._phase("backward_end")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._phase("optimizer_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        self.phases.append({})
        step = len(self.starts) - 1
        first_memory = self.warmup + self.timed + 1
        if not self.memory:
            return
        device = pl_module.device
        if step == first_memory:
            if device.type == "cuda":
                self.cuda = True
            else:
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self._profiler.__enter__()
        elif step == first_memory + 1:
            self.states_at_start = _live_state_bytes(pl_module, trainer.optimizers) + _persistent_buffer_bytes(
                trainer.strategy.model
            )
            if self.cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            else:
                marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
                del marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._phase("optimizer_end")
        if not self.memory or len(self.starts) != self.warmup + self.timed + 3:
            return
        if self.cuda:
            torch.cuda.synchronize(pl_module.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(pl_module.device))
            return
        self._profiler.__exit__(None, None, None)
        events = [
            e
            for e in self._profiler.profiler.kineto_results.events()
            if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
        ]
        events.sort(key=lambda e: e.start_ns())
        self._profiler = None
        start = next(i for i, e in enumerate(events) if e.nbytes() == _MARKER_BYTES)
        running = peak = 0
        for e in events[start + 2 :]:  # after the marker's allocation and free
            running += e.nbytes()
            peak = max(peak, running)
        self.peak_bytes = self.states_at_start + peak

    def phase_times(self) -> dict[str, float]:
        """Median seconds of each phase over the timed steps (those the step's path reports)."""
        spans = {
            "forward": ("start", "backward_start"),
            "backward": ("backward_start", "backward_end"),
            "forward_backward": ("start", "backward_end"),
            "optimizer": ("optimizer_start", "optimizer_end"),
        }
        out = {}
        timed = self.phases[self.warmup : self.warmup + self.timed]
        for name, (a, b) in spans.items():
            values = [(p[b] - (p[a] if a != "start" else 0.0)) for p in timed if b in p and (a == "start" or a in p)]
            if values:
                out[name] = statistics.median(values)
        return out

    def cpu_step_times(self) -> list[float]:
        """CPU seconds of this process (every thread) over each timed step."""
        c = self.cpu_starts
        return [c[i + 1] - c[i] for i in range(self.warmup, self.warmup + self.timed)]

    def step_times(self) -> list[float]:
        """Durations of the timed steps (start of a step to the start of the next)."""
        s = self.starts
        return [s[i + 1] - s[i] for i in range(self.warmup, self.warmup + self.timed)]


@dataclass
class RunMeasurement:
    """One training run on all ranks: per step, the slowest rank's time; per rank, the peak memory."""

    step_times_s: list[float]
    peak_bytes_per_rank: list[int | None]
    memory_source: str  # "cpu-allocator-profile" or "cuda-max-memory-allocated" or "none"
    setup_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["step_time_s"] = self.step_time_s
        return out


def probe_trainer(
    strategy: Any,
    world_size: int,
    probe: StepProbe,
    accelerator: str,
    *extra: L.Callback,
    precision: str = "32-true",
    root_dir: str | None = None,
) -> L.Trainer:
    """A Trainer that runs the probe's steps and nothing else (no validation, logging, checkpoints or bars)."""
    return L.Trainer(
        default_root_dir=root_dir or tempfile.gettempdir(),
        accelerator=accelerator,
        devices=world_size,
        strategy=strategy,
        precision=precision,
        max_steps=probe.total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[probe, *extra],
    )


def measure_run(
    make_strategy: Callable[[], Any],
    model: BenchModel,
    *,
    warmup: int = 3,
    timed: int = 8,
    memory: bool = True,
    runtime_profile: bool = False,
    module_cls: Callable[[BenchModel], L.LightningModule] | None = None,
    info: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Inside every worker: train ``warmup + timed (+1 +2 for memory)`` steps and report what :class:`StepProbe` saw.

    Returns (on every rank) the merged :class:`RunMeasurement` as a dict.
    """
    world = dist.get_world_size()
    accelerator = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    module = module_cls(model) if module_cls is not None else make_module(model)
    probe = StepProbe(warmup, timed, memory)
    # The runtime profiler of the library's calibration workflow, on the same timed steps.
    runtime = CalibrationProbe(warmup, timed) if runtime_profile else None
    strategy = make_strategy()
    trainer = probe_trainer(strategy, world, probe, accelerator, *([runtime] if runtime is not None else []))
    gc.collect()
    started = time.perf_counter()
    trainer.fit(module, make_loader(model, world))
    times = torch.tensor(probe.step_times(), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, probe.peak_bytes)
    source = "none" if not memory else ("cuda-max-memory-allocated" if probe.cuda else "cpu-allocator-profile")
    extra = info(strategy) if info is not None else {}
    phases: list[Any] = [None] * world
    dist.all_gather_object(phases, probe.phase_times())
    extra["phases_per_rank"] = phases
    # CPU seconds a step costs, summed over the ranks (median over the timed steps): the work, whatever the waits --
    # on a machine shared with other jobs far steadier than the step time, which the other jobs' load moves.
    cpu = torch.tensor(statistics.median(probe.cpu_step_times()), dtype=torch.float64)
    dist.all_reduce(cpu)
    extra["cpu_s_per_step"] = float(cpu)
    if runtime is not None:
        extra["observations"] = [o.to_dict() for o in runtime.observations]
    setup = (probe.starts[0] - started) if probe.starts else 0.0
    del trainer, module, strategy
    gc.collect()
    dist.barrier()
    return RunMeasurement(times.tolist(), peaks, source, setup, extra).to_dict()


# ---------------------------------------------------------------------------------------------- calibration
def fit_from_runs(profile: Any, runs: Sequence[dict], precision: str, optimizer: str) -> Any:
    """A calibration fitted to the runtime profiler's observations in ``runs`` (results of :func:`measure_run`)."""
    from lightning_galvatron.search.calibration import Observation, fit_calibration
    from lightning_galvatron.search.overheads import profile_calibration

    observations = [Observation.from_dict(o) for run in runs for o in run["info"].get("observations", [])]
    return fit_calibration(  # as the library's calibrate workflow fits: the profile's own calibration the prior
        profile,
        observations,
        precision=precision,
        optimizer=optimizer,
        source="benchmark probe plans",
        prior=profile_calibration(profile),
    )


# ---------------------------------------------------------------------------------------------- pool
@contextlib.contextmanager
def worker_pool(world_size: int) -> Iterator[WorkerPool]:
    pool = WorkerPool(world_size)
    try:
        yield pool
    finally:
        pool.shutdown()


def interleaved(names: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, name)`` in alternating order: every name once per round, the order rotated by one each
    round, so slow phases of a shared machine fall on every configuration alike."""
    names = list(names)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            yield r, name


# ---------------------------------------------------------------------------------------------- statistics and output
def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute error relative to the measured value."""
    return statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured))


def machine() -> dict[str, Any]:
    import platform

    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
    }


def mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"
