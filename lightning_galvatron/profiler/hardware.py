"""Hardware profiler: collective latency and bandwidth per group, overlap slowdown, device memory.

Run :func:`profile_hardware` on every rank of the live default process group (gloo or NCCL). It
measures what the cost model looks up (:meth:`~lightning_galvatron.profiles.HardwareProfile.collective`):

* every kind of :data:`~lightning_galvatron.profiles.COLLECTIVE_KINDS` over every group size the
  search may use (the divisors of the world size), in every rank layout that changes how many of a
  group's ranks share a node (a group's ``ranks_per_node`` decides its bandwidth; inside one node
  consecutive and strided groups are the same entry). All groups of a layout run at the same time,
  as they do in training, so a shared link is measured shared;
* point-to-point transfers between neighbouring pipeline stages for every pipeline degree, all
  pairs at once;
* the overlap slowdown ``alpha``: a matmul loop alone, an all-reduce alone, and the all-reduce
  issued asynchronously while the matmuls run;
* the device memory and the fixed memory the CUDA context and communicators take.

Each (kind, group) is timed at a ladder of message sizes, from a few KB (latency) to a few MB on
CPU or tens of MB on GPU (bandwidth), and fitted with :meth:`CollectiveFit.fit`. The run is bounded
by ``budget_s``: a pilot all-reduce of the largest message sets how many repetitions fit, and the
largest sizes are dropped if even one repetition of everything would not. Every decision that
changes the number of collectives is taken from numbers all ranks share (all-reduced), so ranks
never disagree; timings are all-reduced (slowest rank) before fitting, so every rank returns the
same profile.

On one device nothing communicates: :func:`single_device_hardware` measures only the memory.

Process groups come from the runtime's :class:`~lightning_galvatron.runtime.mesh.MeshCache`, so
the groups measured here are the very groups a plan later trains on, created once.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_galvatron.plan import divisors
from lightning_galvatron.plan.layout import Layout, p2p_ranks_per_node, ranks_per_node
from lightning_galvatron.profiles import COLLECTIVE_KINDS, CollectiveFit, HardwareProfile, bus_volume
from lightning_galvatron.runtime.mesh import MeshCache, reduce_over_ranks

log = logging.getLogger(__name__)

#: Message sizes are powers of this factor between the smallest and the largest.
SIZE_STEP = 4
#: Smallest and largest message (bytes) per device type: latency-bound up to bandwidth-bound.
SIZE_RANGE = {"cpu": (2**12, 2**22), "cuda": (2**14, 2**26)}
#: A fit needs the latency end and some of the bandwidth end: never fewer sizes than this.
MIN_SIZES = 3
#: Timed trials per point; the fastest is kept: interference from other work only ever adds time.
TRIALS = 3
#: Calls per trial at most: beyond this the median no longer improves.
MAX_REPETITIONS = 20


@dataclass(frozen=True)
class GroupLayout:
    """Groups of ``group_size`` ranks whose members are ``stride`` ranks apart, tiling the world.

    ``ranks_per_node`` is the entry key of :class:`~lightning_galvatron.profiles.CollectiveFit`
    (for ``kind="p2p"``, ``group_size`` is the pipeline degree and ``stride`` the stage size).
    """

    kind: str  # "collective" or "p2p"
    group_size: int
    stride: int
    ranks_per_node: int

    def layout(self, world_size: int) -> Layout:
        """The rank layout (collectives) whose tensor-parallel groups are this layout's groups."""
        return Layout.of_group(world_size, self.group_size, self.stride)

    def groups(self, world_size: int) -> list[list[int]]:
        """The rank sets of this layout (collectives): every rank is in exactly one."""
        return self.layout(world_size).tp_groups()


def measured_layouts(
    world_size: int, devices_per_node: int, group_sizes: Sequence[int] | None = None
) -> list[GroupLayout]:
    """The layouts whose timings the search can ask for, one per distinct ``(group_size, ranks_per_node)``.

    A stage of ``n = W/pp`` devices splits into ``d = n/g`` groups of ``g``: model-parallel groups
    are consecutive (stride 1) or ``d`` apart, data-parallel groups ``g`` apart or consecutive. All
    those strides are visited and the first layout of each ``ranks_per_node`` kept (smallest stride:
    the one that needs fewest process groups). Point-to-point: one entry per pipeline degree.
    """
    if world_size < 2:
        return []
    sizes = sorted({g for g in (group_sizes or divisors(world_size)) if g > 1})
    bad = [g for g in sizes if world_size % g]
    if bad:
        raise ValueError(f"group sizes {bad} do not divide the world size {world_size}")
    out: dict[tuple[str, int, int], GroupLayout] = {}
    for g in sizes:
        for stride in sorted(s for s in divisors(world_size // g)):
            k = ranks_per_node(g, stride, devices_per_node, world_size)
            out.setdefault(("collective", g, k), GroupLayout("collective", g, stride, k))
    for pp in divisors(world_size):
        if pp < 2:
            continue
        k = p2p_ranks_per_node(world_size, pp, devices_per_node)
        out.setdefault(("p2p", pp, k), GroupLayout("p2p", pp, world_size // pp, k))
    return list(out.values())


def message_sizes(device_type: str, max_bytes: int | None = None) -> list[int]:
    """The ladder of message sizes (bytes) for a device type, ``SIZE_STEP`` apart."""
    low, high = SIZE_RANGE.get(device_type, SIZE_RANGE["cuda"])
    if max_bytes is not None:
        high = max(min(high, max_bytes), low * SIZE_STEP ** (MIN_SIZES - 1))
    sizes = [low]
    while sizes[-1] * SIZE_STEP <= high:
        sizes.append(sizes[-1] * SIZE_STEP)
    return sizes


# ---------------------------------------------------------------------------------------------- API
def profile_hardware(
    world_size: int,
    devices_per_node: int,
    *,
    group_sizes: Sequence[int] | None = None,
    device_type: str | None = None,
    budget_s: float = 3.0,
    max_message_bytes: int | None = None,
    name: str | None = None,
) -> HardwareProfile:
    """Measure the interconnect of the live default process group; collective: call on every rank.

    Args:
        world_size: ranks of the default group (checked: the profile is for this cluster shape).
        devices_per_node: ranks per node (torchrun's ``LOCAL_WORLD_SIZE``); ranks ``[k*D, (k+1)*D)``
            are taken to share node ``k``, as launchers number them.
        group_sizes: restrict the measured group sizes (default: every divisor of the world size).
        device_type: ``"cpu"`` or ``"cuda"``; default from the backend (NCCL -> the current CUDA device).
        budget_s: rough bound on the time spent measuring collectives.
        max_message_bytes: largest message (default: 4 MiB on CPU, 64 MiB on CUDA).
        name: label of the profile (default: device name and world size).
    """
    if world_size == 1:
        return single_device_hardware(_device(device_type), name)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "profile_hardware measures the live process group, and none is initialised: call it on every rank "
            "after torch.distributed.init_process_group (e.g. under torchrun)"
        )
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size={world_size} but the process group has {dist.get_world_size()} ranks")
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node must be positive, got {devices_per_node}")
    device = _device(device_type)
    started = time.perf_counter()
    layouts = measured_layouts(world_size, devices_per_node, group_sizes)
    groups = _GroupCache(device.type, world_size)
    sizes = message_sizes(device.type, max_message_bytes)

    collective_points = sum(len(COLLECTIVE_KINDS) - 1 if lay.kind == "collective" else 1 for lay in layouts)
    sizes, repetitions = _plan_repetitions(sizes, collective_points, budget_s, device)
    table = torch.zeros(collective_points, len(sizes), dtype=torch.float64)
    keys: list[tuple[str, GroupLayout]] = []
    for layout in layouts:
        kinds = [k for k in COLLECTIVE_KINDS if k != "p2p"] if layout.kind == "collective" else ["p2p"]
        group = groups.get(layout) if layout.kind == "collective" else None
        for kind in kinds:
            for j, nbytes in enumerate(sizes):
                op = _collective(kind, layout, group, nbytes, device, world_size)
                table[len(keys), j] = _time_point(op, repetitions[j], device)
            keys.append((kind, layout))
    # The slowest rank's time is the collective's time; all ranks then fit the same numbers.
    table = reduce_over_ranks(table, dist.ReduceOp.MAX)
    for i, (kind, layout) in enumerate(keys):
        log.debug("%s over %s: seconds per size %s", kind, layout, dict(zip(sizes, table[i])))
    fits = tuple(_fit(kind, layout, sizes, table[i]) for i, (kind, layout) in enumerate(keys))
    alpha = _overlap_coefficient(sizes[-1], device)
    device_memory, overhead = _memory(device)
    elapsed = time.perf_counter() - started
    log.info("hardware profile: %d fits over %d layouts, alpha %.2f, %.1f s", len(fits), len(layouts), alpha, elapsed)
    return HardwareProfile(
        name=name or f"{_device_name(device)} x{world_size} ({dist.get_backend()})",
        devices_per_node=devices_per_node,
        overlap_coefficient=alpha,
        collectives=fits,
        device_memory_bytes=device_memory,
        memory_overhead_bytes=overhead,
        device_type=device.type,
    )


def single_device_hardware(device: torch.device, name: str | None = None) -> HardwareProfile:
    """One device: nothing communicates, so there is nothing to measure but its memory (no collectives; a plan
    for one device never looks one up)."""
    device_memory, overhead = _memory(device)
    return HardwareProfile(
        name=name or f"{_device_name(device)} x1",
        devices_per_node=1,
        overlap_coefficient=1.0,
        collectives=(),
        device_memory_bytes=device_memory,
        memory_overhead_bytes=overhead,
        device_type=device.type,
    )


# ---------------------------------------------------------------------------------------------- groups
class _GroupCache:
    """The process group of this rank for a layout, from the runtime's shared mesh cache.

    A layout of ``g`` ranks ``stride`` apart is the ``tp`` dimension of the runtime's
    ``Layout(W, pp=W/(g*stride), tp=g, consecutive=stride == 1)``; building it through
    :class:`MeshCache` creates each group once (collectively, in the same order on every rank) and
    leaves it for the plan that will use it.
    """

    def __init__(self, device_type: str, world_size: int) -> None:
        self._meshes = MeshCache.shared(device_type)
        self.world_size = world_size

    def get(self, layout: GroupLayout) -> dist.ProcessGroup:
        if layout.group_size == self.world_size:
            return dist.group.WORLD
        return self._meshes.tp_mesh(layout.layout(self.world_size)).get_group()


# ---------------------------------------------------------------------------------------------- timing
def _device(device_type: str | None) -> torch.device:
    if device_type is None:
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_point(op: Callable[[], None], repetitions: int, device: torch.device) -> float:
    """Seconds per call: one warm-up, then the fastest of ``TRIALS`` runs of ``repetitions`` back-to-back calls.

    A barrier first lines the ranks up, so one rank's late start is not billed to the next point.
    Back-to-back calls let the stragglers of one call catch up in the next, as in training.
    """
    op()
    _synchronize(device)
    dist.barrier()
    trials = []
    for _ in range(TRIALS):
        start = time.perf_counter()
        for _ in range(repetitions):
            op()
        _synchronize(device)
        trials.append((time.perf_counter() - start) / repetitions)
    return min(trials)


def _plan_repetitions(
    sizes: list[int], points: int, budget_s: float, device: torch.device
) -> tuple[list[int], list[int]]:
    """Repetitions per message size (and the sizes kept) so that all points fit ``budget_s``.

    A pilot all-reduce over all ranks at the smallest and largest size gives a per-call time model
    ``t(s)``; each point gets ``budget / (points * sizes)`` seconds. The pilot times are all-reduced
    (max) so every rank computes the same plan -- the number of collectives must agree.
    """
    pilot = torch.tensor(
        [_time_point(_all_reduce(n, device), 1, device) for n in (sizes[0], sizes[-1])], dtype=torch.float64
    )
    small, large = reduce_over_ranks(pilot, dist.ReduceOp.MAX)
    per_byte = max(large - small, 0.0) / (sizes[-1] - sizes[0])

    def call_time(nbytes: int) -> float:
        return small + per_byte * (nbytes - sizes[0])

    def point_time(nbytes: int, repetitions: int) -> float:  # the warm-up call, then the trials
        return (1 + TRIALS * repetitions) * call_time(nbytes)

    while len(sizes) > MIN_SIZES and points * sum(point_time(s, 1) for s in sizes) > budget_s:
        sizes = sizes[:-1]  # even one repetition would not fit: drop the largest message
    share = budget_s / (points * len(sizes))
    repetitions = [int(min(max((share / max(call_time(s), 1e-9) - 1) // TRIALS, 1), MAX_REPETITIONS)) for s in sizes]
    return sizes, repetitions


def _all_reduce(nbytes: int, device: torch.device, group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    return lambda: dist.all_reduce(x, group=group)


def _collective(
    kind: str, layout: GroupLayout, group: dist.ProcessGroup | None, nbytes: int, device: torch.device, world_size: int
) -> Callable[[], None]:
    """A closure issuing one collective of ``nbytes`` in the bus-bandwidth convention of the profile format.

    ``nbytes`` is the full (unsharded) tensor for all-gather and reduce-scatter, the tensor each
    rank holds for all-reduce and all-to-all, the message each stage sends for p2p.
    """
    g = layout.group_size
    numel = max(nbytes // 4 // g, 1) * g  # divisible by the group: equal shards
    full = torch.ones(numel, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        shard = torch.ones(numel // g, dtype=torch.float32, device=device)
        return lambda: dist.all_gather_single(full, shard, group=group)
    if kind == "reduce_scatter":
        shard = torch.empty(numel // g, dtype=torch.float32, device=device)
        return lambda: dist.reduce_scatter_single(shard, full, group=group)
    if kind == "all_to_all":
        received = torch.empty_like(full)
        return lambda: dist.all_to_all_single(received, full, group=group)
    if kind == "p2p":
        return _pipeline_exchange(layout, full, world_size)
    raise ValueError(f"unknown collective kind {kind!r}")


def _pipeline_exchange(layout: GroupLayout, message: torch.Tensor, world_size: int) -> Callable[[], None]:
    """Every stage sends ``message`` to the same position of the next stage, all pairs at once."""
    rank, stage_size = dist.get_rank(), layout.stride
    received = torch.empty_like(message)
    ops = []
    if rank + stage_size < world_size:
        ops.append(dist.P2POp(dist.isend, message, rank + stage_size))
    if rank - stage_size >= 0:
        ops.append(dist.P2POp(dist.irecv, received, rank - stage_size))

    def exchange() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return exchange


def _fit(kind: str, layout: GroupLayout, sizes: Sequence[int], times: Sequence[float]) -> CollectiveFit:
    """:meth:`CollectiveFit.fit`, checked against the largest message, where bandwidth matters most.

    The format's fit weighs every point by its relative error, so a few slow small messages (noise
    on a shared machine) can tilt it flat and claim an unbounded bandwidth. If the fit misses the
    largest message by more than half, the line through the smallest and largest message is used
    instead (or, if even that does not rise, the bandwidth the largest message proves: a lower bound).
    When the times are flat the fit explains the largest message by latency alone (an unbounded
    bandwidth); the lower bound is used then too.
    """
    fit = CollectiveFit.fit(kind, layout.group_size, layout.ranks_per_node, sizes, times)
    volume = bus_volume(kind, layout.group_size)
    transfer = volume * sizes[-1] / fit.bandwidth_bytes_per_s  # the fit's transfer time of the largest message
    if abs(fit.time(sizes[-1]) - times[-1]) <= 0.5 * times[-1] and transfer >= 0.1 * times[-1]:
        return fit
    rise = times[-1] - times[0]
    if transfer < 0.1 * times[-1]:
        # Flat times (noise hid the size dependence): the fit would claim a boundless bandwidth. The largest
        # message proves a lower bound; pricing large messages by it errs on the slow side.
        bandwidth, latency = volume * sizes[-1] / times[-1], min(times)
    elif rise > 0:
        bandwidth = volume * (sizes[-1] - sizes[0]) / rise
        latency = max(times[0] - volume * sizes[0] / bandwidth, 0.0)
    else:
        bandwidth, latency = volume * sizes[-1] / times[-1], min(times)
    # A diagnostic of the measurement, not something a user can act on: shown with DEBUG logging of this package.
    log.debug(
        "%s over %d ranks: the least-squares fit does not explain the largest message (%.3g s measured, %.3g s "
        "fitted, %.3g s of it transfer): using %.3g GB/s from the smallest and largest message",
        kind,
        layout.group_size,
        times[-1],
        fit.time(sizes[-1]),
        transfer,
        bandwidth / 1e9,
    )
    return CollectiveFit(kind, layout.group_size, layout.ranks_per_node, latency, bandwidth)


# ---------------------------------------------------------------------------------------------- overlap
def _overlap_coefficient(nbytes: int, device: torch.device) -> float:
    """``alpha`` from ``overlapped = max(x, y) + (alpha - 1) * min(x, y)``, measured, averaged over ranks.

    ``y`` is an all-reduce of ``nbytes`` over all ranks, ``x`` a loop of matmuls sized so that
    ``x ~= y`` (where the slowdown shows most); overlapped, the all-reduce is issued
    asynchronously before the loop and waited for after it, as FSDP overlaps gradient reductions.
    """
    communicate = _all_reduce(nbytes, device)
    comm_alone = _time_point(communicate, 1, device)
    n = 256 if device.type == "cpu" else 4096
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def matmul() -> None:
        torch.mm(a, b)

    one = _local_time(matmul, device)
    count = max(1, round(comm_alone / max(one, 1e-9)))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, b)

    x = torch.ones(max(nbytes // 4, 1), device=device)

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    ratios = []
    for _ in range(TRIALS):
        dist.barrier()
        comp = _local_time(compute, device)
        comm = _time_point(communicate, 1, device)
        overlapped = _time_point(both, 1, device)
        ratios.append(1.0 + (overlapped - max(comp, comm)) / max(min(comp, comm), 1e-12))
    alpha = torch.tensor([max(statistics.median(ratios), 1.0)], dtype=torch.float64)
    return reduce_over_ranks(alpha)[0] / dist.get_world_size()


def _local_time(fn: Callable[[], None], device: torch.device) -> float:
    """Median seconds of a local computation (no collectives: ranks may repeat it differently)."""
    fn()
    _synchronize(device)
    times = []
    for _ in range(TRIALS):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- memory
def _memory(device: torch.device) -> tuple[int | None, int]:
    """(device memory, fixed overhead) in bytes; the overhead is the largest over ranks.

    On CUDA the overhead is what the process holds on the device beyond live tensors after the
    communicators are up: the CUDA context, NCCL buffers, the allocator's own use. CPU memory is
    not budgeted per device, so it has none.
    """
    if device.type != "cuda":
        return None, 0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    overhead = torch.tensor([max(total - free - torch.cuda.memory_allocated(device), 0)], dtype=torch.int64)
    return int(total), reduce_over_ranks(overhead, dist.ReduceOp.MAX)[0]


__all__ = ["GroupLayout", "measured_layouts", "message_sizes", "profile_hardware", "single_device_hardware"]
