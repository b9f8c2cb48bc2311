"""NCCL's rules, checked on a simulated rank that holds fake CUDA tensors (``dry-run --device cuda``).

A job on GPUs talks through NCCL, which is stricter than gloo, the backend every test on CPU runs:

* **device**: a collective or point-to-point tensor must be on the calling rank's own GPU (``cuda:local_rank``);
  NCCL refuses a CPU tensor ("No backend type associated with device type cpu") and a tensor on another GPU
  corrupts or hangs the communicator;
* **object collectives** (``broadcast_object_list``, ``all_gather_object``, ...) pickle on the host and move the
  bytes to ``torch.cuda.current_device()``: the current device must have been set to the rank's own GPU (else
  every rank of a node uses GPU 0), and an explicit ``device=`` must be that GPU;
* **agreement**: the members of a group issue the same collectives with the same shapes and dtypes (checked
  across ranks by :func:`~lightning_galvatron.dryrun.trace.check_order`, which names what differs);
* **checkpoints** load into tensors on the rank's own GPU (:meth:`NcclRules.checkpoint_load`);
* **host synchronisations** are no error but a cost: a value read back to the host (``.item()``, ``float(t)``,
  ``bool(t)``, ``.tolist()``), a copy to the host (``.cpu()``), ``torch.cuda.synchronize()`` and every object
  collective stall the CPU until the GPU has caught up. They are counted per phase (one step each) and named by
  the line that made them, so a step's syncs are known before a GPU pays for them.

Each violation names the rule, what broke it and where it was issued (the innermost frames outside torch).
On a dry run on CPU tensors (``device="cpu"``) none of this is checked: that is what gloo runs.

The simulated process group is torch's ``fake`` backend under the name :data:`SIMULATED_NCCL`: the runtime asks
whether its backend is NCCL (``"nccl" in backend``) to choose where small host values travel, and whether values
travel at all (``"fake" in backend``); a simulated rank must answer both as a job on GPUs would and as the fake
backend is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

SIMULATED_NCCL = "fake_nccl"
_TORCH_FRAMES = ("/torch/",)  # where the site of a host synchronisation is not: it is the line that called torch
_OWN_FRAMES = ("lightning_galvatron/dryrun/trace.py", "lightning_galvatron/dryrun/nccl_rules.py", "dryrun/cuda.py")


def register_simulated_nccl() -> str:
    """Register torch's fake process group for CUDA tensors under :data:`SIMULATED_NCCL` (once); its name."""
    if not hasattr(dist.Backend, SIMULATED_NCCL.upper()):
        from torch.testing._internal.distributed.fake_pg import _create_fake_pg

        # Registered for CPU too, so that a rule's violation is reported with the others instead of stopping the
        # rank at the first CPU tensor.
        devices = ["cpu", "cuda", torch._C._get_privateuse1_backend_name()]  # the last: C++'s view (dryrun.cuda)
        dist.Backend.register_backend(SIMULATED_NCCL, _create_fake_pg, extended_api=True, devices=devices)
    return SIMULATED_NCCL


@dataclass(frozen=True)
class Violation:
    """One broken rule: which, what broke it, in which phase, and where (innermost frame last)."""

    rule: str
    message: str
    phase: str
    stack: tuple[str, ...] = ()

    def describe(self) -> str:
        return "\n".join([f"[{self.phase}] {self.rule}: {self.message}", *(f"    {frame}" for frame in self.stack)])

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "message": self.message, "phase": self.phase, "stack": list(self.stack)}


@dataclass
class HostSync:
    """Host synchronisations of one kind made from one place in one phase."""

    phase: str
    what: str
    stack: tuple[str, ...]  # the innermost frames outside torch, innermost last: the line that asked for it last
    via: str = ""  # the innermost frame, when torch made it on the caller's behalf
    count: int = 0

    @property
    def site(self) -> str:
        return self.stack[-1] if self.stack else "?"

    def describe(self) -> str:
        callers = " <- ".join(reversed(self.stack[:-1]))
        via = f" (in {self.via})" if self.via and self.via != self.site else ""
        return f"[{self.phase}] {self.count} x {self.what} at {self.site}{via}" + (f" <- {callers}" if callers else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "what": self.what,
            "site": self.site,
            "stack": list(self.stack),
            "via": self.via,
            "count": self.count,
        }


_READ = "value read to the host (.item(), float(), int(), bool(), .tolist())"
_COPY = "copy to the host (.cpu(), .to('cpu'))"


class NcclRules:
    """The rules for one simulated rank whose own GPU is ``device`` (see the module docstring).

    :class:`~lightning_galvatron.dryrun.trace.Recording` calls :meth:`collective`, :meth:`object_collective` and
    :meth:`observe` (every op it dispatches); the simulated device calls :meth:`sync`.
    """

    def __init__(self, device: torch.device, current_device: Callable[[], int], phase: Callable[[], str]) -> None:
        self.device = device
        self._current_device = current_device  # the process's current CUDA device index
        self._phase = phase  # the phase the rank is in (the recording's)
        self.violations: list[Violation] = []
        self.syncs: dict[tuple[str, str, tuple[str, ...]], HostSync] = {}
        self._last_read: tuple[int, int] | None = None  # the Python call that made the previous read

    # ---------------------------------------------------------------------------------------------- the rules
    def collective(self, kind: str, group_name: str, tensors: Sequence[torch.Tensor]) -> None:
        """Every tensor of a collective or point-to-point operation on this rank's own GPU."""
        wrong = sorted({str(t.device) for t in tensors if t.device != self.device})
        if wrong:
            self._violate(
                "tensor not on the rank's own GPU",
                f"{kind} on group {group_name} got tensors on {', '.join(wrong)}; NCCL takes only tensors on this "
                f"rank's GPU {self.device}",
            )

    def object_collective(self, kind: str, device: Any = None) -> None:
        """An object collective: the current device set to the own GPU, an explicit ``device`` that GPU; a sync."""
        current = torch.device("cuda", self._current_device())
        if device is not None and torch.device(device) != self.device:
            self._violate(
                "object collective on another device",
                f"{kind}(device={device}) on NCCL: the objects travel as tensors on that device; NCCL needs this "
                f"rank's GPU {self.device} (or device=None with the current device set to it)",
            )
        elif device is None and current != self.device:
            self._violate(
                "object collective without the current device set",
                f"{kind} on NCCL moves the objects to torch.cuda.current_device(), {current}, not this rank's GPU "
                f"{self.device}: torch.cuda.set_device({self.device.index}) was not called (every rank of a node "
                "would use the same GPU)",
            )
        self._sync(f"object collective ({kind})")

    def checkpoint_load(self, holders: Mapping[str, torch.Tensor]) -> None:
        """Every tensor a checkpoint is loaded into (its local part) on this rank's own GPU, where the model trains: a
        holder elsewhere costs a copy more, and one split again over a mesh would be sent to NCCL from there. Scalars
        on the host are not data but counters torch's optimizers keep there (Adam's ``step``)."""
        wrong = [
            f"{fqn} on {t.device}"
            for fqn, t in holders.items()
            if t.device != self.device and not (t.dim() == 0 and t.device.type == "cpu")
        ]
        if wrong:
            self._violate(
                "checkpoint loaded off the rank's own GPU",
                f"{len(wrong)} of the {len(holders)} tensors the checkpoint is loaded into are not on this rank's GPU "
                f"{self.device}: {', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}",
            )

    def sync(self, what: str) -> None:
        """A host synchronisation made through ``torch.cuda`` (``synchronize``, an event's or stream's)."""
        self._sync(what)

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Host synchronisations among the ops a rank dispatches: reads of values and copies to the host."""
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].device.type == "cuda":
                self._read()
        elif func is torch.ops.aten._to_copy.default:
            target = kwargs.get("device")
            if (
                args[0].device.type == "cuda"
                and target is not None
                and torch.device(target).type == "cpu"
                and not kwargs.get("non_blocking")
            ):
                self._sync(_COPY)
        elif func is torch.ops.aten.copy_.default:
            if args[0].device.type == "cpu" and args[1].device.type == "cuda" and not kwargs.get("non_blocking"):
                self._sync(_COPY)

    # ---------------------------------------------------------------------------------------------- the report
    def host_syncs(self, phase: str | None = None) -> list[HostSync]:
        return [s for s in self.syncs.values() if phase is None or s.phase == phase]

    # ---------------------------------------------------------------------------------------------- helpers
    def _violate(self, rule: str, message: str) -> None:
        self.violations.append(Violation(rule, message, self._phase(), _caller_stack()))

    def _read(self) -> None:
        """A read of a value: ``.tolist()`` reads element by element, yet is one synchronisation per call."""
        frame = _site_frame()
        call = (id(frame), frame.f_lasti) if frame is not None else None
        if call is not None and call == self._last_read:
            return
        self._last_read = call
        self._sync(_READ)

    def _sync(self, what: str) -> None:
        if what != _READ:
            self._last_read = None
        stack = _caller_stack(depth=40)
        outside = tuple(f for f in stack if not any(part in f.split(":")[0] for part in _TORCH_FRAMES))[-3:]
        phase = self._phase()
        key = (phase, what, outside)
        if key not in self.syncs:
            self.syncs[key] = HostSync(phase, what, outside, stack[-1] if stack else "")
        self.syncs[key].count += 1


def _caller_stack(depth: int = 12) -> tuple[str, ...]:
    from lightning_galvatron.dryrun.trace import _SKIPPED_FRAMES, _stack

    return _stack((*_SKIPPED_FRAMES, *_OWN_FRAMES), depth)


def _site_frame() -> FrameType | None:
    """The innermost Python frame outside torch and this package's dry-run machinery (the caller's line)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in (*_TORCH_FRAMES, *_OWN_FRAMES)):
            return frame
        frame = frame.f_back
    return None
