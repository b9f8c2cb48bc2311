"""What a simulated rank says to the others, and the proof that every group hears the same thing.

NCCL (and gloo) have one hard rule: the ranks of a process group issue the same collectives, in the
same order, with tensors of the same shapes and dtypes; and every rank creates the groups in the same
order (creating a group is itself collective over the world). A rank that breaks it waits forever.

:class:`Recording` captures, on one simulated rank:

* every group creation (``torch.distributed.new_group``, which ``DeviceMesh`` calls for every slice
  of every mesh): its members, in order;
* every collective and point-to-point operation the rank issues, at the dispatcher: what the runtime,
  FSDP2, DTensor and ``torch.distributed.pipelining`` issue alike, through the ``torch.distributed`` API
  or functional collectives -- kind, group, shapes, dtypes, root or peer, and where it was called;
* object collectives (``broadcast_object_list`` and friends), as one operation each. The fake backend
  exchanges no data, so their results are simulated: every rank keeps or receives its own object;
* placeholders for values read back from tensors (``.item()``, ``bool(t)``): ``False`` for flags,
  ``1`` for numbers. Ranks of a real job read the values their peers sent; control flow that depends
  on them is therefore simulated, not observed (see :data:`PLACEHOLDER_NOTE`).

:func:`check_order` compares the recordings of all ranks: group creations everywhere, the operations
of each group across its members, and sends against receives for every pair of ranks.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

PLACEHOLDER_NOTE = (
    "values read back from tensors (.item(), bool(t)) are placeholders (False for flags, 1 for numbers): the fake "
    "backend exchanges no data, so branches on received values follow the placeholder"
)

_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
_KINDS = {  # dispatcher op -> the collective a communication library runs for it
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "monitored_barrier_": "barrier",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}
_NOT_OPERATIONS = {"wait_tensor"}  # completions, not operations
# Rooted operations whose tensor lists differ between the root and the others: compare only this argument.
_COMPARED_ARGUMENT = {"scatter_": "output_tensors", "gather_": "input_tensors"}


@dataclass(frozen=True)
class Event:
    """One group creation or communication operation of one rank.

    Attributes:
        phase: ``setup``, ``train``, ``validate`` or ``checkpoint``.
        kind: ``new_group``, ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``,
            ``barrier``, ``send``, ``recv``, ``broadcast_object``, ...
        group: the group's name (its creation index: equal on every rank that created groups in one order).
        members: global ranks of the group (of the new group for ``new_group``).
        shapes, dtypes: of the tensors involved (what the peers must match).
        root: the group rank of a broadcast's or gather's root; the global peer of a send or receive.
        stack: where it was issued, innermost last (frames of the dispatcher and of this module left out).
    """

    phase: str
    kind: str
    group: str
    members: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    root: int | None = None
    stack: tuple[str, ...] = ()

    @property
    def signature(self) -> tuple[str, tuple[tuple[int, ...], ...], tuple[str, ...], int | None]:
        """What every member must agree on. All-to-all exchanges may be uneven: only the dtype must agree."""
        shapes = () if self.kind == "all_to_all" else self.shapes
        return (self.kind, shapes, self.dtypes, self.root)

    def describe(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.shapes)
        dtypes = ",".join(sorted(set(self.dtypes)))
        root = f" root/peer {self.root}" if self.root is not None else ""
        return f"[{self.phase}] {self.kind} on group {self.group} {list(self.members)} ({shapes} {dtypes}){root}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "kind": self.kind,
            "group": self.group,
            "members": list(self.members),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "root": self.root,
            "stack": list(self.stack),
        }


def _stack(skip_files: Sequence[str], depth: int = 12) -> tuple[str, ...]:
    """The innermost ``depth`` frames of the caller outside ``skip_files``, innermost last (no source lines
    are read: this runs for every operation)."""
    kept: list[str] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and len(kept) < depth:
        code = frame.f_code
        if not any(part in code.co_filename for part in skip_files):
            kept.append(f"{code.co_filename}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(reversed(kept))


_SKIPPED_FRAMES = (
    "torch/_ops.py",
    "torch/utils/_python_dispatch.py",
    "torch/_subclasses/",
    "torch/utils/_stats.py",
    "torch/_compile.py",
    "torch/_dynamo/",
    "torch/distributed/_tools/",
    "lightning_galvatron/dryrun/trace.py",
    "torch/distributed/c10d_logger.py",
)


class Recording(TorchDispatchMode):
    """Records one rank's communication (see the module docstring); a dispatch mode with hooks around it.

    Use :meth:`active` around everything the rank does; :attr:`phase` names the part being run.
    """

    def __init__(self, rank: int, world_size: int, keep_stacks: bool = True) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode.__init__ untyped
        self.rank, self.world_size = rank, world_size
        self.keep_stacks = keep_stacks
        self.phase = "setup"
        self.events: list[Event] = []
        self.members: dict[str, tuple[int, ...]] = {}
        self.placeholders = 0
        self.read_placeholders = False  # placeholders for real tensors too (in the steps, not in setup)
        self.rules: Any = None  # nccl_rules.NcclRules when the rank simulates a GPU: shown every operation

    # ------------------------------------------------------------------ groups
    def _group(self, group: dist.ProcessGroup | None) -> tuple[str, tuple[int, ...]]:
        group = group if group is not None else dist.group.WORLD
        assert group is not None  # the default group exists while a rank runs
        name = group.group_name
        if name not in self.members:
            self.members[name] = tuple(dist.get_process_group_ranks(group))
        return name, self.members[name]

    def _add(
        self, kind: str, group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor] = (), root: int | None = None
    ) -> None:
        name, members = self._group(group)
        self.events.append(
            Event(
                self.phase,
                kind,
                name,
                members,
                tuple(tuple(t.shape) for t in tensors),
                tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                root,
                _stack(_SKIPPED_FRAMES) if self.keep_stacks else (),
            )
        )

    # ------------------------------------------------------------------ the dispatcher
    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower to local ops and collectives, which come back here
        kwargs = kwargs or {}
        if self.rules is not None:
            self.rules.observe(func, args, kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and (
            self.read_placeholders or isinstance(args[0], FakeTensor)
        ):
            self.placeholders += 1
            return False if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1
        if func.namespace in _NAMESPACES:
            self._record(func, args, kwargs)
            if func is torch.ops.c10d.alltoall_base_.default:
                args = _nonempty_all_to_all_input(args)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        op = func._schema.name.split("::")[-1]
        if op in _NOT_OPERATIONS:
            return
        values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        group = None
        for argument in func._schema.arguments:
            value = values.get(argument.name)
            if "ProcessGroup" in str(argument.type) and value is not None:
                group = dist.ProcessGroup.unbox(value)
            elif argument.name == "group_name" and value is not None:
                group = c10d._resolve_process_group(value)  # type: ignore[attr-defined]  # torch: not re-exported
        if group is None and op not in _KINDS:
            return  # a helper of the collectives' autograd, not an operation
        compared = [values[_COMPARED_ARGUMENT[op]]] if op in _COMPARED_ARGUMENT else values.values()
        tensors = [t for t in _flatten(compared) if isinstance(t, torch.Tensor)]
        kind = _KINDS.get(op, op)
        if self.rules is not None:
            every = [t for t in _flatten(values.values()) if isinstance(t, torch.Tensor)]
            self.rules.collective(kind, self._group(group)[0], every)
        root = None
        if kind in ("send", "recv"):
            peer = values.get("dst", values.get("src"))
            _, members = self._group(group)
            root = members[peer] if isinstance(peer, int) and 0 <= peer < len(members) else peer
        elif "root_rank" in values or "src" in values:
            root = values.get("root_rank", values.get("src"))
        self._add(kind, group, tensors, root)

    # ------------------------------------------------------------------ hooks
    @contextmanager
    def active(self) -> Iterator[Recording]:
        """Record group creations and object collectives (patched for this process) and operations (this mode)."""
        world = dist.group.WORLD
        assert world is not None  # the rank's process group is initialised
        self.members.setdefault(world.group_name, tuple(range(self.world_size)))
        patched = {
            (c10d, "_new_group_with_tag"): self._wrap_new_group(c10d._new_group_with_tag),
            **{(module, name): fn for name, fn in self._object_collectives().items() for module in (dist, c10d)},
        }
        saved = {key: getattr(*key) for key in patched}
        for (module, name), fn in patched.items():
            setattr(module, name, fn)
        try:
            with self:
                yield self
        finally:
            for (module, name), fn in saved.items():
                setattr(module, name, fn)

    def _wrap_new_group(self, original: Any) -> Any:
        def new_group_with_tag(ranks: Sequence[int] | None = None, *args: Any, **kwargs: Any) -> Any:
            members = tuple(sorted(ranks)) if ranks else tuple(range(self.world_size))
            group = original(ranks, *args, **kwargs)
            name = group.group_name if isinstance(group, dist.ProcessGroup) else f"#{len(self.events)}"
            self.members.setdefault(name, members)
            self.events.append(
                Event(self.phase, "new_group", name, members, stack=_stack(_SKIPPED_FRAMES) if self.keep_stacks else ())
            )
            return group

        return new_group_with_tag

    def _object_collectives(self) -> dict[str, Any]:
        """Object collectives: recorded as one operation; each rank keeps (or receives) its own object."""

        def group_rank(group: dist.ProcessGroup | None, rank: int | None) -> int | None:
            return (
                None if rank is None else dist.get_group_rank(cast(dist.ProcessGroup, group or dist.group.WORLD), rank)
            )

        def checked(kind: str, device: Any = None) -> None:
            if self.rules is not None:
                self.rules.object_collective(kind, device)

        def broadcast_object_list(
            object_list: list[Any],
            src: int | None = None,
            group: dist.ProcessGroup | None = None,
            device: torch.device | None = None,
            group_src: int | None = None,
        ) -> None:
            checked("broadcast_object_list", device)
            self._add("broadcast_object", group, root=group_src if group_src is not None else group_rank(group, src))

        def all_gather_object(object_list: list[Any], obj: Any, group: dist.ProcessGroup | None = None) -> None:
            checked("all_gather_object")
            self._add("all_gather_object", group)
            object_list[:] = [obj] * len(object_list)

        def gather_object(
            obj: Any,
            object_gather_list: list[Any] | None = None,
            dst: int | None = None,
            group: dist.ProcessGroup | None = None,
            group_dst: int | None = None,
        ) -> None:
            checked("gather_object")
            self._add("gather_object", group, root=group_dst if group_dst is not None else group_rank(group, dst))
            if object_gather_list is not None:
                object_gather_list[:] = [obj] * len(object_gather_list)

        def scatter_object_list(
            scatter_object_output_list: list[Any],
            scatter_object_input_list: list[Any] | None = None,
            src: int | None = None,
            group: dist.ProcessGroup | None = None,
            group_src: int | None = None,
        ) -> None:
            checked("scatter_object_list")
            self._add("scatter_object", group, root=group_src if group_src is not None else group_rank(group, src))
            own = dist.get_rank(group or dist.group.WORLD)
            scatter_object_output_list[0] = scatter_object_input_list[own] if scatter_object_input_list else None

        return {
            "broadcast_object_list": broadcast_object_list,
            "all_gather_object": all_gather_object,
            "gather_object": gather_object,
            "scatter_object_list": scatter_object_list,
        }


def _nonempty_all_to_all_input(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """An uneven all-to-all in which this rank sends nothing but receives: the fake backend fills what a rank
    receives from its own input (it has no peers) and refuses an empty one; give it one placeholder row."""
    output, source, group, output_splits, input_splits, *rest = args
    if source.numel() or not sum(output_splits) or isinstance(source, FakeTensor):
        return args
    row = source.new_zeros((1, *source.shape[1:]))
    return (output, row, group, output_splits, [1] + [0] * (len(input_splits) - 1), *rest)


def _flatten(values: Any) -> Iterator[Any]:
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flatten(v)
        else:
            yield v


# ---------------------------------------------------------------------------------------------- the proof
@dataclass(frozen=True)
class Divergence:
    """Where two ranks that must agree do not: their ``index``-th operation on ``group`` (or their
    ``index``-th group creation), with both events (``None``: the rank issued nothing more there)."""

    what: str
    group: str | None
    members: tuple[int, ...]
    index: int
    ranks: tuple[int, int]
    events: tuple[Event | None, Event | None]

    @property
    def reason(self) -> str:
        """What differs: another operation (or none), or the same one with other dtypes, shapes or root."""
        a, b = self.events
        if a is None or b is None:
            return "one rank issued nothing more"
        if a.kind != b.kind:
            return f"different operations ({a.kind} vs {b.kind})"
        if a.dtypes != b.dtypes:
            return f"dtypes differ ({','.join(a.dtypes)} vs {','.join(b.dtypes)})"
        if a.shapes != b.shapes:
            return "shapes differ"
        if a.root != b.root:
            return f"roots differ ({a.root} vs {b.root})"
        return "members differ" if a.members != b.members else "differs"

    def describe(self) -> str:
        lines = [
            f"{self.what}: operation {self.index} differs between rank {self.ranks[0]} and rank {self.ranks[1]}: "
            f"{self.reason}"
        ]
        for rank, event in zip(self.ranks, self.events):
            lines.append(f"  rank {rank}: {event.describe() if event else 'nothing (its sequence ended here)'}")
            if event is not None and event.stack:
                lines.extend(f"      {frame}" for frame in event.stack)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "group": self.group,
            "members": list(self.members),
            "index": self.index,
            "reason": self.reason,
            "ranks": list(self.ranks),
            "events": [e.to_dict() if e else None for e in self.events],
        }


@dataclass(frozen=True)
class OrderCheck:
    """The result of :func:`check_order`: the divergences found (empty: proven) and what was compared."""

    ranks: tuple[int, ...]
    world_size: int
    divergences: tuple[Divergence, ...]
    groups_checked: int
    groups_unchecked: int  # groups with members that were not simulated
    operations: int
    pairs_checked: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.world_size and self.groups_unchecked == 0

    @property
    def ok(self) -> bool:
        return not self.divergences

    def describe(self) -> str:
        scope = "every rank" if self.complete else f"{len(self.ranks)} of {self.world_size} ranks"
        head = (
            f"collective order over {scope}: {self.groups_checked} groups and {self.pairs_checked} point-to-point "
            f"pairs, {self.operations} operations compared"
            + (
                f" ({self.groups_unchecked} groups have members that were not simulated)"
                if self.groups_unchecked
                else ""
            )
        )
        if self.ok:
            return head + ": every member of every group issued the same sequence"
        return "\n".join(
            [head + f": {len(self.divergences)} divergence(s); the first:", self.divergences[0].describe()]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "complete": self.complete,
            "ranks": len(self.ranks),
            "world_size": self.world_size,
            "groups_checked": self.groups_checked,
            "groups_unchecked": self.groups_unchecked,
            "pairs_checked": self.pairs_checked,
            "operations": self.operations,
            "divergences": [d.to_dict() for d in self.divergences],
            "notes": list(self.notes),
        }


def check_order(traces: Mapping[int, Sequence[Event]], world_size: int, limit: int = 10) -> OrderCheck:
    """Compare the recorded sequences of the ranks in ``traces`` (all ``world_size`` of them for a proof).

    1. Group creations: every rank created the same groups in the same order.
    2. Every group whose members were all simulated: each member issued the same operations on it, in
       the same order, with the same shapes, dtypes and roots.
    3. Point-to-point: what rank ``a`` sent to ``b`` is what ``b`` received from ``a``, in order.

    Returns at most ``limit`` divergences: a difference in group creation first (it renames every later
    group), then in the order the first rank of each issued them.
    """
    ranks = tuple(sorted(traces))
    divergences: list[tuple[int, Divergence]] = []
    if not ranks:
        return OrderCheck((), world_size, (), 0, 0, 0)

    # 1. group creations
    creations = {r: [e for e in traces[r] if e.kind == "new_group"] for r in ranks}
    reference = ranks[0]
    for r in ranks[1:]:
        found = _first_difference(creations[reference], creations[r], key=lambda e: e.members)
        if found is not None:
            i, a, b = found
            divergences.append((-1, Divergence("group creation order", None, (), i, (reference, r), (a, b))))
            break

    # 2. operations per group
    per_group: dict[str, dict[int, list[tuple[int, Event]]]] = defaultdict(lambda: defaultdict(list))
    members_of: dict[str, tuple[int, ...]] = {}
    p2p: dict[tuple[int, int], dict[str, list[tuple[int, Event]]]] = defaultdict(lambda: {"send": [], "recv": []})
    operations = 0
    for r in ranks:
        for position, e in enumerate(traces[r]):
            if e.kind == "new_group":
                continue
            operations += 1
            if e.kind in ("send", "recv"):
                assert e.root is not None  # a point-to-point operation names its peer
                pair = (r, e.root) if e.kind == "send" else (e.root, r)
                p2p[pair][e.kind].append((position, e))
                continue
            per_group[e.group][r].append((position, e))
            members_of[e.group] = e.members
    present = set(ranks)
    checked = unchecked = 0
    for name, by_rank in per_group.items():
        members = members_of[name]
        if not set(members) <= present:
            unchecked += 1
            continue
        checked += 1
        first = members[0]
        for r in members[1:]:
            found = _first_difference(
                [e for _, e in by_rank.get(first, [])], [e for _, e in by_rank.get(r, [])], key=lambda e: e.signature
            )
            if found is not None:
                i, a, b = found
                when = by_rank[first][i][0] if a is not None else by_rank[r][i][0]
                divergences.append(
                    (when, Divergence(f"group {name} {list(members)}", name, members, i, (first, r), (a, b)))
                )
                break

    # 3. point-to-point pairs
    pairs = 0
    for (src, dst), ops in sorted(p2p.items()):
        if src not in present or dst not in present:
            continue
        pairs += 1
        sends = [e for _, e in ops["send"]]
        recvs = [e for _, e in ops["recv"]]
        found = _first_difference(sends, recvs, key=lambda e: (e.shapes, e.dtypes))
        if found is not None:
            i, a, b = found
            when = ops["send"][i][0] if a is not None else ops["recv"][i][0]
            divergences.append(
                (when, Divergence(f"point-to-point {src} -> {dst}", None, (src, dst), i, (src, dst), (a, b)))
            )

    divergences.sort(key=lambda item: item[0])
    return OrderCheck(
        ranks=ranks,
        world_size=world_size,
        divergences=tuple(d for _, d in divergences[:limit]),
        groups_checked=checked,
        groups_unchecked=unchecked,
        operations=operations,
        pairs_checked=pairs,
    )


def _first_difference(
    a: Sequence[Event], b: Sequence[Event], key: Any
) -> tuple[int, Event | None, Event | None] | None:
    for i in range(max(len(a), len(b))):
        ea = a[i] if i < len(a) else None
        eb = b[i] if i < len(b) else None
        if ea is None or eb is None or key(ea) != key(eb):
            return i, ea, eb
    return None
