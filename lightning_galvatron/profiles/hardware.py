"""The hardware half of a profile: device memory, overlap, and one fitted cost per measured collective."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_galvatron.profiles.fields import ProfileError, _fields, _finite_nonneg, _positive_int

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def bus_volume(kind: str, group_size: int) -> float:
    """Bytes each rank moves per byte of the (unsharded) tensor, in the bus-bandwidth convention."""
    g = group_size
    if kind == "all_reduce":
        return 2.0 * (g - 1) / g
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (g - 1) / g
    if kind == "p2p":
        return 1.0
    raise ProfileError(f"unknown collective kind {kind!r}; known: {COLLECTIVE_KINDS}")


@dataclass(frozen=True)
class CollectiveFit:
    """Measured cost of one collective on one kind of group: ``latency_s + volume * bytes / bandwidth``.

    Attributes:
        kind: one of :data:`COLLECTIVE_KINDS`.
        group_size: ranks in the group. For ``p2p`` it is the number of pipeline stages that were
            exchanging at the same time (pairs of neighbouring stages).
        ranks_per_node: how many of the group's ranks share a node (``group_size`` inside one node;
            for ``p2p``, 2 if a pair of neighbours shares a node, else 1).
        latency_s: fixed cost per call.
        bandwidth_bytes_per_s: bus bandwidth (see the module docstring), with the cluster's other
            groups busy at the same time as they are in training.
    """

    kind: str
    group_size: int
    ranks_per_node: int
    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise ProfileError(f"collective kind must be one of {COLLECTIVE_KINDS}, got {self.kind!r}")
        _positive_int("collective group_size", self.group_size)
        _positive_int("collective ranks_per_node", self.ranks_per_node)
        if self.kind != "p2p" and self.ranks_per_node > self.group_size:
            raise ProfileError(f"ranks_per_node={self.ranks_per_node} exceeds group_size={self.group_size}")
        _finite_nonneg("latency_s", self.latency_s)
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ProfileError(f"bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s!r}")

    @property
    def intra_node(self) -> bool:
        return self.ranks_per_node >= (2 if self.kind == "p2p" else self.group_size)

    def time(self, nbytes: Any, group_size: int | None = None) -> Any:
        """Seconds for a tensor of ``nbytes`` over a group of ``group_size`` (default: the measured one)."""
        g = self.group_size if group_size is None else group_size
        return self.latency_s + bus_volume(self.kind, g) * nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def fit(
        cls, kind: str, group_size: int, ranks_per_node: int, sizes: Sequence[float], times_s: Sequence[float]
    ) -> CollectiveFit:
        """Fit latency and bus bandwidth to measured (bytes, seconds) points, minimising relative error."""
        if len(sizes) < 2 or len(sizes) != len(times_s):
            raise ProfileError("a collective fit needs at least two (size, time) points")
        vol = bus_volume(kind, group_size) if kind != "p2p" else 1.0
        xs = [vol * float(s) for s in sizes]
        ys = [float(t) for t in times_s]
        # Weighted least squares with weights 1/t^2: small messages count as much as large ones.
        w = [1.0 / (y * y) for y in ys]
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, xs)) / sw
        my = sum(wi * y for wi, y in zip(w, ys)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
        slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx
        latency = my - slope * mx
        if latency < 0 or slope <= 0:
            latency = max(latency, 0.0)
            slope = max(
                sum(wi * x * (y - latency) for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs)),
                1e-30,
            )
        return cls(kind, group_size, ranks_per_node, latency, 1.0 / slope)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CollectiveFit:
        return cls(**_fields(data, where, cls=cls))


@dataclass(frozen=True)
class HardwareProfile:
    """Devices and interconnect.

    Attributes:
        name: label.
        devices_per_node: devices that share a node (and its fast interconnect).
        overlap_coefficient: slowdown ``alpha >= 1`` when computation and communication overlap:
            overlapped time is ``max(x, y) + (alpha - 1) * min(x, y)``.
        collectives: the measured :class:`CollectiveFit` entries; none for one device (nothing communicates).
        device_memory_bytes: memory of one device, if known (the budget is given separately).
        memory_overhead_bytes: fixed memory per device the model does not account for (CUDA
            context, allocator caches, communication buffers).
        device_type: the kind of device measured (``cuda``, ``cpu``, ...; torch's ``device.type``), so a
            profile of one kind is not taken for another. ``None``: not recorded.
    """

    name: str
    devices_per_node: int
    overlap_coefficient: float
    collectives: tuple[CollectiveFit, ...]
    device_memory_bytes: int | None = None
    memory_overhead_bytes: int = 0
    device_type: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "collectives", tuple(self.collectives))
        _positive_int("hardware.devices_per_node", self.devices_per_node)
        if not (self.overlap_coefficient >= 1.0 and math.isfinite(self.overlap_coefficient)):
            raise ProfileError(f"hardware.overlap_coefficient must be >= 1, got {self.overlap_coefficient!r}")
        if self.collectives and not any(c.kind == "all_reduce" for c in self.collectives):
            raise ProfileError("hardware.collectives needs at least one all_reduce entry (the fallback for the others)")
        keys = [(c.kind, c.group_size, c.ranks_per_node) for c in self.collectives]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise ProfileError(
                f"hardware.collectives has duplicate entries for (kind, group_size, ranks_per_node) {duplicates}"
            )
        if self.device_memory_bytes is not None:
            _positive_int("hardware.device_memory_bytes", self.device_memory_bytes)
        if not isinstance(self.memory_overhead_bytes, int) or self.memory_overhead_bytes < 0:
            raise ProfileError(
                f"hardware.memory_overhead_bytes must be a non-negative integer, got {self.memory_overhead_bytes!r}"
            )
        if self.device_type is not None and not (isinstance(self.device_type, str) and self.device_type):
            raise ProfileError(
                f"hardware.device_type must be a device type such as 'cuda' or 'cpu', got {self.device_type!r}"
            )

    def collective(self, kind: str, group_size: int, ranks_per_node: int) -> CollectiveFit:
        """The entry that best describes ``kind`` over such a group (see :func:`lookup_collective`)."""
        return lookup_collective(self.collectives, kind, group_size, ranks_per_node)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["collectives"] = [c.to_dict() for c in self.collectives]
        if self.device_type is None:  # files without it stay readable by earlier versions
            del out["device_type"]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "hardware") -> HardwareProfile:
        kwargs = _fields(data, where, cls=cls)
        if not isinstance(kwargs["collectives"], list):
            raise ProfileError(f"{where}.collectives must be a list")
        kwargs["collectives"] = tuple(
            CollectiveFit.from_dict(c, f"{where}.collectives[{i}]") for i, c in enumerate(kwargs["collectives"])
        )
        return cls(**kwargs)


# Which measured kind stands in for one that was not measured: all-gather and reduce-scatter move
# half an all-reduce's volume at the same bus bandwidth; all-to-all and p2p at worst behave like it.
_KIND_FALLBACK = {
    "all_gather": ("all_reduce",),
    "reduce_scatter": ("all_reduce",),
    "all_to_all": ("all_reduce",),
    "p2p": ("all_reduce",),
    "all_reduce": (),
}


def lookup_collective(
    entries: Iterable[CollectiveFit], kind: str, group_size: int, ranks_per_node: int
) -> CollectiveFit:
    """Pick the measured entry for ``kind`` over a group of ``group_size`` with ``ranks_per_node`` per node.

    Order of preference: the exact entry; else an entry of the same kind on the same side of the
    node boundary (intra-node: nearest group size; inter-node: nearest ranks-per-node, then nearest
    group size, in log scale); else, for an inter-node group with no inter-node measurement, the
    nearest intra-node entry (optimistic: a one-node profile cannot know the network); else the
    fallback kind of :data:`_KIND_FALLBACK` (p2p is then an all-reduce of a pair of ranks).
    """
    entries = tuple(entries)
    for candidate_kind in (kind, *_KIND_FALLBACK[kind]):
        same = [e for e in entries if e.kind == candidate_kind]
        if not same:
            continue
        g, k = group_size, ranks_per_node
        if candidate_kind != kind and kind == "p2p":
            g, k = 2, min(ranks_per_node, 2)
        intra = k >= (2 if candidate_kind == "p2p" else g)
        for e in same:
            if e.group_size == g and e.ranks_per_node == k:
                return e
        side = [e for e in same if e.intra_node == intra] or same

        def distance(e: CollectiveFit, g: int = g, k: int = k, intra: bool = intra) -> tuple[float, float]:
            dg = abs(math.log(e.group_size) - math.log(g))
            dk = abs(math.log(e.ranks_per_node) - math.log(k))
            return (dg, dk) if intra else (dk, dg)

        return min(side, key=distance)
    if not entries:
        raise ProfileError(
            f"the hardware profile measured no collectives (it was made on one device), so it cannot price {kind} over "
            f"{group_size} devices; profile the hardware on the cluster the plan is for"
        )
    raise ProfileError(f"the hardware profile has no {kind} or all_reduce measurement")
