"""Phase 5, overheads: what one block call and one optimizer step cost under each kind of strategy, and what a
pipeline schedule and DDP's gradient reduction add.

The cost model prices compute and communication; what FSDP2's hooks, DTensor's dispatch, a checkpoint's
replay machinery, the optimizer's per-tensor work, a pipeline schedule's own work (its bookkeeping, waits
and transfers per micro-batch and model chunk; on shared cores, how fast the busy stages run while others
wait) and the DDP reduction a backward leaves exposed add is measured here (collective: every rank runs the same
probes at the same time, so contention for shared cores is in them as it is in training), into a
:class:`~lightning_galvatron.profiles.Overheads` that the search turns into per-call terms
(:mod:`lightning_galvatron.search.overheads`). About a tenth of a second of calls per probe: these are costs of
milliseconds that differ between strategies by whole factors, but a probe shorter than the scheduler's slices of a
shared core measures the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_galvatron.plan import LayerStrategy
from lightning_galvatron.plan.layout import rank_chunks
from lightning_galvatron.profiler.model.blocks import _backward, _BlockProfiler
from lightning_galvatron.profiler.model.degrees import _Styles
from lightning_galvatron.profiler.model.setup import _synchronize, agreed_repeats
from lightning_galvatron.profiler.runtime import _cpu_cores
from lightning_galvatron.profiles import (
    CallProbe,
    LayerTypeProfile,
    OptimizerProbe,
    Overheads,
    PipelineProbe,
    ReductionProbe,
)
from lightning_galvatron.runtime.mesh import reduce_over_ranks
from lightning_galvatron.runtime.structure import block_output_hidden, with_hidden_states

log = logging.getLogger(__name__)

#: Timed calls per probe (block calls, optimizer steps): about this many seconds of them, between the profiler's
#: least and most repeats.
CALL_POINT_S = 0.1
OPTIMIZER_TENSORS = 8
OPTIMIZER_SIZES = (256, 131072)  # elements per tensor and rank: per-tensor and per-element costs apart (beyond caches)
#: The pipeline probes: (schedule, model chunks per rank, blocks per chunk, micro-batches; ``None``: one per stage).
#: Every rank runs two blocks per micro-batch in each; one micro-batch leaves every stage idle half the step.
PIPELINE_PROBES = (("1f1b", 1, 2, None), ("interleaved_1f1b", 2, 1, None), ("gpipe", 1, 2, 1))
#: The reduction probe runs as many copies of a block as the model has of its type, at most this many and at most
#: this many bytes of parameters (two of the runtime's buckets: enough for one to overlap backward and one to wait).
REDUCTION_BLOCKS = 8
REDUCTION_BYTES = 50 * 2**20


def measure_overheads(
    profilers: Sequence[_BlockProfiler],
    layer_types: Sequence[LayerTypeProfile],
    degrees: Sequence[int],
    vocab_tensors: int,
    device: torch.device,
    blocks_per_type: Sequence[int] | None = None,
    optimizer_probes: Sequence[OptimizerProbe] | None = None,
    pipelines: bool = True,
) -> Overheads:
    """Call probes of each block type (plain, recomputed, ZeRO-2, ZeRO-3 over the world, each tensor-parallel
    style at each measured degree), optimizer probes (unless given: they are the cluster's, not the model's) and,
    with two ranks or more, pipeline (unless ``pipelines`` is false: no pipeline can be chosen) and reduction probes
    of the first block type (over ``blocks_per_type[0]`` copies, within :data:`REDUCTION_BLOCKS` and
    :data:`REDUCTION_BYTES`); seconds are the slowest rank's. Collective."""
    from torch.distributed._composable import checkpoint

    from lightning_galvatron.runtime.gradient_sync import GradientReducer
    from lightning_galvatron.runtime.mesh import Layout, MeshCache
    from lightning_galvatron.runtime.precision import mixed_precision_policy
    from lightning_galvatron.runtime.sharding import apply_data_parallel

    started = time.perf_counter()
    world = dist.get_world_size()
    dp_mesh = MeshCache.shared(device.type).dp_mesh(Layout(world, 1, 1, True))
    probes: list[tuple[int, LayerStrategy, float]] = []
    for k, (profiler, lt) in enumerate(zip(profilers, layer_types)):
        batch = int(profiler.hidden.shape[0])
        recomputed = profiler.copy()
        checkpoint(recomputed)
        probes.append((k, LayerStrategy(), _time_call(profiler, profiler.copy(), batch)))
        probes.append((k, LayerStrategy(recompute=True), _time_call(profiler, recomputed, batch)))
        for dp_type in ("zero2", "zero3"):
            block = profiler.copy()
            strategy = LayerStrategy(dp_type=dp_type)
            apply_data_parallel(block, strategy, dp_mesh, mixed_precision_policy(profiler.prec.flag), GradientReducer())
            probes.append((k, strategy, _time_call(profiler, block, batch)))
        styles = _Styles(lt.supports_tensor_parallel, lt.supports_megatron_sp, lt.supports_ulysses)
        for g in sorted(g for g in degrees if 1 < g <= world and world % g == 0):
            for style in profiler.runnable_styles(g, styles):
                block = profiler.split_copy(g, world, style)
                split = 1 if style == "none" else g
                probes.append((k, LayerStrategy(tp=g, sp=style), _time_call(profiler, block, batch, split)))
    optimizer = _optimizer_probes(world, device, dp_mesh) if optimizer_probes is None else []
    # A pipeline probe chains copies of the first block: only where a block returns hidden states of the shape it
    # receives (Swin's stages merge patches; no pipeline is searched for such models either, see autoplan).
    chained = _keeps_shape(profilers[0])
    if pipelines and world > 1 and not chained:
        log.info("%s changes the shape of its hidden states: no pipeline is probed", profilers[0].name)
    pipelines = _pipeline_probes(profilers[0], world, device) if pipelines and world > 1 and chained else []
    block_bytes = sum(p.numel() * p.element_size() for p in profilers[0].block.parameters())
    copies = max(min((blocks_per_type or [1])[0], REDUCTION_BLOCKS, REDUCTION_BYTES // max(block_bytes, 1)), 1)
    reductions = [_reduction_probe(profilers[0], copies, dp_mesh.get_group(), device)] if world > 1 else []
    seconds = reduce_over_ranks(
        [s for *_, s in probes]
        + [s for *_, s in optimizer]
        + [p.seconds for p in pipelines]
        + [s for r in reductions for s in (r.plain_seconds, r.reduced_seconds)],
        dist.ReduceOp.MAX,
    )
    calls = tuple(
        CallProbe(k, strategy, world, int(profilers[k].hidden.shape[0]), s)
        for (k, strategy, _), s in zip(probes, seconds)
    )
    seconds = seconds[len(probes) :]
    if optimizer:
        optimizer_probes = tuple(OptimizerProbe(n, e, d, s) for (n, e, d, _), s in zip(optimizer, seconds))
    seconds = seconds[len(optimizer) :]
    pipeline_probes = tuple(dataclasses.replace(p, seconds=s) for p, s in zip(pipelines, seconds))
    seconds = seconds[len(pipelines) :]
    reduction_probes = tuple(
        dataclasses.replace(r, plain_seconds=seconds[2 * i], reduced_seconds=seconds[2 * i + 1])
        for i, r in enumerate(reductions)
    )
    log.info(
        "per block call, forward and backward (%.1f s to measure): %s",
        time.perf_counter() - started,
        ", ".join(f"{c.strategy.short()} {c.seconds * 1e3:.1f} ms" for c in calls),
    )
    log.info(
        "pipeline steps: %s; blocks without and with DDP's gradient reduction: %s",
        ", ".join(f"pp{p.pp} {p.schedule} m{p.micro_batches} {p.seconds * 1e3:.1f} ms" for p in pipeline_probes),
        ", ".join(
            f"{r.blocks} x {r.plain_seconds * 1e3:.1f} / {r.reduced_seconds * 1e3:.1f} ms" for r in reduction_probes
        ),
    )
    return Overheads(
        world_size=world,
        calls=calls,
        optimizer=optimizer_probes,
        compute_slots=_cpu_cores() if device.type == "cpu" else None,
        block_tensors=tuple(sum(1 for _ in p.block.parameters()) for p in profilers),
        vocab_tensors=vocab_tensors,
        pipelines=pipeline_probes,
        reductions=reduction_probes,
    )


def _time_call(profiler: _BlockProfiler, block: nn.Module, batch: int, seq_split: int = 1) -> float:
    """Seconds of forward and backward of ``block`` on ``batch`` samples (:func:`_median_seconds` of its calls).

    Not three calls: where processes share cores, three fit in one scheduler slice, in which a rank may not run at
    all (two profiles of one machine then differ twofold). Not the quiet end of many (``setup.quiet_seconds``, right
    for the blocks' compute at each size): that is the call that had a core to itself, well below what training's
    block calls take with every rank busy; the median matches training (docs/performance.md).
    """

    def once() -> float:
        args, kwargs = profiler.inputs(batch, seq_split)
        _synchronize(profiler.device)
        start = time.perf_counter()
        with profiler.prec.autocast(profiler.device):
            out = block(*args, **kwargs)
        _backward(out)
        _synchronize(profiler.device)
        seconds = time.perf_counter() - start
        for p in block.parameters():
            p.grad = None
        return seconds

    return _median_seconds(once, profiler.device)


def _median_seconds(once: Callable[[], float], device: torch.device) -> float:
    """The median of about :data:`CALL_POINT_S` of ``once()`` (which returns its own seconds) after an untimed
    first call (lazy initialisation: FSDP2 and DTensor caches, optimizer states) and a warm one that sizes the
    rest. Every rank makes the same number of calls, at the same time: they may hold collectives, and training
    runs every rank at once (where processes share cores, a lone rank's call is faster than training's).
    Collective."""
    dist.barrier()
    once()
    warm = once()
    return float(np.median([once() for _ in range(agreed_repeats(warm, CALL_POINT_S))]))


def _optimizer_probes(world: int, device: torch.device, mesh) -> list[tuple[int, int, bool, float]]:
    """AdamW (as ``torch.optim`` defaults it: the foreach path) over plain tensors and over DTensors sharded on
    ``mesh``, at two sizes per rank: ``(tensors, local elements, dtensor, seconds)``, each the median of its steps
    (:func:`_median_seconds`; the quiet end of three steps, the step that had a core to itself, priced the
    optimizer of processes sharing cores at about half of what training measured, and varied twofold between
    profiles: docs/performance.md)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for dtensor in (False, True):
        for size in OPTIMIZER_SIZES:
            if dtensor:
                params = [
                    nn.Parameter(distribute_tensor(torch.randn(size * world, device=device), mesh, [Shard(0)]))
                    for _ in range(OPTIMIZER_TENSORS)
                ]
            else:
                params = [nn.Parameter(torch.randn(size, device=device)) for _ in range(OPTIMIZER_TENSORS)]
            for p in params:
                p.grad = torch.full_like(p, 1e-3)  # values do not change the work (and DTensor randomness warns)
            optimizer = torch.optim.AdamW(params, lr=1e-4)

            def once(optimizer: torch.optim.Optimizer = optimizer) -> float:
                _synchronize(device)
                start = time.perf_counter()
                optimizer.step()
                _synchronize(device)
                return time.perf_counter() - start

            out.append((OPTIMIZER_TENSORS, OPTIMIZER_TENSORS * size, dtensor, _median_seconds(once, device)))
    return out


def _keeps_shape(profiler: _BlockProfiler) -> bool:
    """Whether the block returns hidden states of the shape and dtype it receives (as captured)."""
    from lightning_galvatron.profiler.model.capture import _skippable

    return _skippable(profiler.call)


class _ProbeChunk(nn.Module):
    """Copies of one block run in sequence on the hidden states a pipeline stage receives; the block's other
    captured arguments (masks, position embeddings), resized to the micro-batch, are closed over. A block that
    changes the shape of its hidden states cannot be chained: its copies then run side by side on the same hidden
    states, and the chunk returns the sum of their outputs' means (the reduction probe needs only their backward)."""

    def __init__(self, profiler: _BlockProfiler, blocks: int, micro_batch: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(profiler.copy() for _ in range(blocks))
        self._profiler = [profiler]  # a list: not registered as a submodule
        self._args, self._kwargs = profiler.inputs(micro_batch)
        self._chained = _keeps_shape(profiler)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        profiler = self._profiler[0]
        dtype = hidden.dtype
        outputs = []
        for block in self.blocks:
            args, kwargs = with_hidden_states(self._args, self._kwargs, hidden)
            with profiler.prec.autocast(profiler.device):
                out = block_output_hidden(block(*args, **kwargs))
            hidden = out if self._chained else hidden
            outputs.append(out)
        if not self._chained:
            return torch.stack([out.float().mean() for out in outputs]).sum()
        return hidden.to(dtype)  # what the stage declared it sends


def _pipeline_probes(profiler: _BlockProfiler, world: int, device: torch.device) -> list[PipelineProbe]:
    """Training steps of real ``torch.distributed.pipelining`` schedules (:data:`PIPELINE_PROBES`) of ``pp = 2``
    stages (``world`` if odd) made of copies of ``profiler``'s block, ``world / pp`` pipelines side by side, at the
    call probes' micro-batch: the median step of each (:func:`_median_seconds`). Against the stage times the model
    prices from the block's own probes, they show what the schedule adds per micro-batch and model chunk.
    Collective."""
    from torch.distributed.pipelining import PipelineStage

    from lightning_galvatron.runtime.mesh import Layout, MeshCache
    from lightning_galvatron.runtime.pipeline import SCHEDULE_CLASSES

    pp = 2 if world % 2 == 0 else world
    mesh = MeshCache.shared(device.type).mesh(Layout(world, pp, 1))["pp"]
    group, stage = mesh.get_group(), mesh.get_local_rank()
    shape = tuple(profiler.hidden.shape)  # the call probes' micro-batch
    micro_batch = shape[0]
    out = []
    for schedule_name, virtual, per_chunk, micro_batches in PIPELINE_PROBES:
        m = micro_batches or pp
        chunks = pp * virtual
        activation = torch.empty(shape, dtype=profiler.hidden.dtype, device="meta", requires_grad=True)
        stages = [
            PipelineStage(
                _ProbeChunk(profiler, per_chunk, micro_batch),
                chunk,
                chunks,
                device,
                input_args=activation,
                output_args=activation,
                group=group,
            )
            for chunk in rank_chunks(stage, pp, virtual)
        ]
        schedule = SCHEDULE_CLASSES[schedule_name](
            stages if virtual > 1 else stages[0],
            n_microbatches=m,
            loss_fn=lambda output, target: output.float().square().mean(),
            scale_grads=False,
        )
        inputs = torch.randn((m * micro_batch, *shape[1:]), dtype=profiler.hidden.dtype, device=device)
        args = (inputs,) if stage == 0 else ()
        kwargs = {"target": torch.zeros(m, device=device)} if stage == pp - 1 else {}
        seconds = _median_seconds(partial(_schedule_step, schedule, stages, args, kwargs, device), device)
        out.append(PipelineProbe(0, pp, schedule_name, m, virtual, per_chunk, micro_batch, seconds))
    return out


def _reduction_probe(
    profiler: _BlockProfiler, copies: int, group: dist.ProcessGroup, device: torch.device
) -> ReductionProbe:
    """Forward and backward of ``copies`` copies of ``profiler``'s block in sequence at the call probes' batch,
    without and then with the runtime's own DDP gradient reduction over ``group`` (each copy registered as a
    layer, bucketed as training buckets them): the median seconds of each (:func:`_median_seconds`). Collective."""
    from lightning_galvatron.runtime.gradient_sync import GradientReducer

    batch = int(profiler.hidden.shape[0])
    chunk = _ProbeChunk(profiler, copies, batch)
    hidden = profiler.hidden.detach().clone().requires_grad_(True)

    def once() -> float:
        _synchronize(device)
        start = time.perf_counter()
        _backward(chunk(hidden))
        _synchronize(device)
        seconds = time.perf_counter() - start
        chunk.zero_grad(set_to_none=True)
        hidden.grad = None
        return seconds

    plain = _median_seconds(once, device)
    reducer = GradientReducer()
    for block in chunk.blocks:
        reducer.add(block.parameters(), group)
    reducer.build()

    def reduced() -> float:
        seconds = once()
        reducer.optimizer_stepped()  # the summed gradients were consumed (dropped): the next backward may sum again
        return seconds

    try:
        return ReductionProbe(0, copies, dist.get_world_size(group), batch, plain, _median_seconds(reduced, device))
    finally:
        reducer.remove()


def _schedule_step(schedule: Any, stages: Sequence[Any], args: tuple, kwargs: dict, device: torch.device) -> float:
    """Seconds of one training step of ``schedule`` (its stages' gradients dropped afterwards)."""
    _synchronize(device)
    start = time.perf_counter()
    schedule.step(*args, **kwargs)
    _synchronize(device)
    seconds = time.perf_counter() - start
    for stage in stages:
        stage.submod.zero_grad(set_to_none=True)
    return seconds


__all__ = ["measure_overheads"]
