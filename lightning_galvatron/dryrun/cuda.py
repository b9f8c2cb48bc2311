"""A simulated GPU for a dry run with ``device="cuda"``: what ``torch.cuda`` answers to one simulated rank.

A CPU build of torch makes fake tensors on ``cuda:k`` (``FakeTensorMode``: shapes, dtypes and devices, no
storage), but its ``torch.cuda`` module refuses everything else: device queries, streams, events, memory
statistics. :class:`SimulatedDevice` answers those calls for one rank, as a node of ``devices_per_node`` GPUs
would to the process of local rank ``local_rank``, and :meth:`SimulatedDevice.installed` patches them into
``torch.cuda`` (and the matching ``torch.accelerator`` calls) for the duration of the rank, in this one place.

What the simulated device answers, and from what:

* ``is_available``/``device_count``/``current_device``/``set_device``/``get_device_name``/``get_device_properties``:
  a node of identical GPUs of ``total_memory`` bytes; the current device starts at 0, as in a fresh process,
  until ``set_device`` (what Lightning's CUDA accelerator calls at setup) changes it;
* streams and events: objects that order nothing (a simulated rank runs one op at a time) but accept every
  call FSDP2 and the pipeline schedules make (``wait_stream``, ``wait_event``, ``record``, ``torch.cuda.stream``);
* memory statistics (``memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``,
  ``mem_get_info``, ``memory_stats``): from the dry run's own accounting, torch's ``MemTracker`` over the measured
  step (:mod:`.memory`), zero where nothing is measured;
* ``synchronize`` (of the device, a stream or an event): a host synchronisation, reported to ``on_sync``.

Below Python, a CPU build cannot run CUDA: autograd records a CUDA stream for every tensor it saves and its engine
orders the streams of an accelerator between backward nodes, and a CPU build has neither a CUDA device guard nor
an accelerator to ask (registering CUDA's would need C++). So a fake ``cuda:k`` tensor is ``simulated_gpu:k`` to
torch's C++ code -- PrivateUse1, registered as an accelerator whose streams and events do nothing -- and ``cuda:k``
to Python, where the runtime, FSDP2, DTensor and the checks of :mod:`.nccl_rules` read it; the fake mode turns a
device C++ code passes back into ``cuda:k``, carries the CUDA device through every op and refuses mixing it with
CPU tensors, as CUDA does. Where the two views would disagree, Python is told what a GPU build says: ``is_cuda``,
a DTensor's device (its local tensor's), ``Tensor.to`` (a move to the CPU copies, a move to the own device does
not). All of it lives in the rank's own process, which a simulated rank is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

SIMULATED_DEVICE_NAME = "simulated GPU"
# The memory a simulated GPU reports when none is given: an 80 GB A100/H100, what the README's plans assume.
DEFAULT_DEVICE_MEMORY = 80 * 2**30


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports (the fields the runtime and Lightning read)."""

    name: str
    total_memory: int
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132


class SimulatedStream:
    """A CUDA stream of the simulated device: accepts what FSDP2 and the schedules call; orders nothing."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cuda", _index(device))
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: SimulatedEvent | None = None) -> SimulatedEvent:
        event = event if event is not None else SimulatedEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False  # no CUDA graph is captured

    def synchronize(self) -> None:
        _active.on_sync("torch.cuda.Stream.synchronize()")

    def __enter__(self) -> SimulatedStream:
        return self

    def __exit__(self, *args: object) -> None:
        pass


class SimulatedEvent:
    """A CUDA event of the simulated device (timing events report zero: nothing is timed)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _active.on_sync("torch.cuda.Event.synchronize()")

    def elapsed_time(self, end: Any) -> float:
        _active.on_sync("torch.cuda.Event.elapsed_time()")
        return 0.0


def _read_through_item(original: Callable[[torch.Tensor], Any], convert: type) -> Callable[[torch.Tensor], Any]:
    """``float(t)``/``int(t)`` of a CUDA tensor as ``.item()`` (the read a GPU makes), others unchanged."""

    def read(self: torch.Tensor) -> Any:
        return convert(self.item()) if self.device.type == "cuda" else original(self)

    return read


def _index(device: Any) -> int:
    """The device index of ``device`` (an int, a string, a ``torch.device`` or ``None``: the current one)."""
    if device is None:
        return _active.current
    if isinstance(device, int):
        return device
    d = torch.device(device) if isinstance(device, str) else device
    return d.index if getattr(d, "index", None) is not None else _active.current


class SimulatedDevice:
    """The GPUs of one node as the process of ``local_rank`` sees them (see the module docstring).

    Attributes:
        local_rank: the device this rank must use (``cuda:local_rank``).
        current: the current device of the process (0 until ``set_device``).
        tracker: the memory tracker of the measured step while it runs (``memory_allocated`` reads it).
        on_sync: called with a description of every host synchronisation made through ``torch.cuda``.
    """

    def __init__(
        self,
        local_rank: int,
        devices_per_node: int,
        total_memory: int = DEFAULT_DEVICE_MEMORY,
        on_sync: Callable[[str], None] | None = None,
    ) -> None:
        self.local_rank, self.devices_per_node, self.total_memory = local_rank, devices_per_node, total_memory
        self.current = 0
        self.set_device_calls = 0
        self.tracker: Any = None
        self.peak_base = 0  # reset_peak_memory_stats: the peak counts from here
        self.on_sync = on_sync or (lambda what: None)
        self._stream = SimulatedStream(0)

    @property
    def own(self) -> torch.device:
        return torch.device("cuda", self.local_rank)

    # ---------------------------------------------------------------------------------------------- torch.cuda
    def set_device(self, device: Any) -> None:
        index = _index(device)
        if not 0 <= index < self.devices_per_node:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (a node of {self.devices_per_node} GPUs)")
        self.current, self.set_device_calls = index, self.set_device_calls + 1

    def current_stream(self, device: Any = None) -> SimulatedStream:
        return self._stream

    @contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        yield stream

    @contextmanager
    def device(self, device: Any) -> Iterator[None]:
        saved = self.current
        if device is not None and _index(device) >= 0:
            self.current = _index(device)
        try:
            yield
        finally:
            self.current = saved

    def synchronize(self, device: Any = None) -> None:
        self.on_sync("torch.cuda.synchronize()")

    def memory_allocated(self, device: Any = None) -> int:
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY

        if self.tracker is None:
            return 0
        return int(self.tracker._curr_mem_snap.get(torch.device("cuda", _index(device)), {}).get(_TOTAL_KEY, 0))

    def max_memory_allocated(self, device: Any = None) -> int:
        if self.tracker is None:
            return self.peak_base
        peak = self.tracker._peak_mem.get(torch.device("cuda", _index(device)), 0)
        return int(max(peak, self.peak_base))

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.peak_base = self.memory_allocated(device)
        if self.tracker is not None:
            self.tracker._peak_mem[torch.device("cuda", _index(device))] = self.peak_base

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.total_memory - self.memory_allocated(device), self.total_memory

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        allocated = self.memory_allocated(device)
        peak = self.max_memory_allocated(device)
        return {
            "allocated_bytes.all.current": allocated,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": allocated,
            "reserved_bytes.all.peak": peak,
        }

    def properties(self, device: Any = None) -> DeviceProperties:
        return DeviceProperties(SIMULATED_DEVICE_NAME, self.total_memory)

    def _to(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            args = tuple(self._indexed(a) for a in args)
            if "device" in kwargs:
                kwargs["device"] = self._indexed(kwargs["device"])
            result = original(t, *args, **kwargs)
            target = next((a for a in (*args, kwargs.get("device")) if isinstance(a, torch.device)), None)
            if target is None or not isinstance(t, FakeTensor):
                return result
            # C++ compared the devices as the CPU sees them: redo what a GPU build decides.
            if result.device != target:
                copied: torch.Tensor = torch.ops.aten._to_copy.default(result, device=target)
                return copied
            if result is not t and t.device == target and result.dtype == t.dtype and not kwargs.get("copy"):
                return t
            return result

        return to

    def _indexed(self, device: Any) -> Any:
        """``"cuda"`` (a string or device without index) as the current device; anything else unchanged."""
        if isinstance(device, (str, torch.device)):
            try:
                d = torch.device(device)
            except RuntimeError:
                return device  # not a device (a dtype name, a memory format)
            if d.type == "cuda" and d.index is None:
                return torch.device("cuda", self.current)
        return device

    def patches(self) -> dict[tuple[Any, str], Any]:
        """``(module, name) -> replacement`` for every call answered here."""
        cuda, accelerator = torch.cuda, torch.accelerator
        nothing: Callable[..., None] = lambda *args, **kwargs: None  # noqa: E731
        return {
            (cuda, "is_available"): lambda: True,
            (cuda, "is_initialized"): lambda: True,
            (cuda, "_lazy_init"): nothing,
            (cuda, "init"): nothing,
            (cuda, "device_count"): lambda: self.devices_per_node,
            (cuda, "current_device"): lambda: self.current,
            (cuda, "set_device"): self.set_device,
            (cuda, "device"): self.device,
            (cuda, "get_device_name"): lambda device=None: SIMULATED_DEVICE_NAME,
            (cuda, "get_device_properties"): self.properties,
            (cuda, "get_device_capability"): lambda device=None: (9, 0),
            (cuda, "is_bf16_supported"): lambda *args, **kwargs: True,
            (cuda, "synchronize"): self.synchronize,
            (cuda, "Stream"): SimulatedStream,
            (cuda, "Event"): SimulatedEvent,
            (cuda, "current_stream"): self.current_stream,
            (cuda, "default_stream"): self.current_stream,
            (cuda, "stream"): self.stream,
            (cuda, "set_stream"): nothing,
            (cuda, "memory_allocated"): self.memory_allocated,
            (cuda, "max_memory_allocated"): self.max_memory_allocated,
            (cuda, "memory_reserved"): self.memory_allocated,
            (cuda, "max_memory_reserved"): self.max_memory_allocated,
            (cuda, "reset_peak_memory_stats"): self.reset_peak_memory_stats,
            (cuda, "reset_max_memory_allocated"): self.reset_peak_memory_stats,
            (cuda, "memory_stats"): self.memory_stats,
            (cuda, "mem_get_info"): self.mem_get_info,
            (cuda, "empty_cache"): nothing,
            (cuda, "get_rng_state"): lambda device="cuda": torch.get_rng_state(),
            (cuda, "set_rng_state"): nothing,
            (cuda, "get_rng_state_all"): lambda: [torch.get_rng_state()] * self.devices_per_node,
            (cuda, "set_rng_state_all"): nothing,
            (cuda, "manual_seed"): nothing,
            (cuda, "manual_seed_all"): nothing,
            # A CPU build cannot resolve "cuda" to the current device: done here, as a GPU build does.
            (torch.Tensor, "to"): self._to(torch.Tensor.to),
            (torch.Tensor, "cuda"): lambda t, device=None, non_blocking=False, **kwargs: t.to(
                torch.device("cuda", _index(device)), non_blocking=non_blocking
            ),
            (torch.Tensor, "cpu"): lambda t, memory_format=torch.preserve_format: t.to(
                torch.device("cpu"), memory_format=memory_format
            ),
            # A CPU build refuses these for a CUDA tensor before any dispatch; .item() reaches the dispatcher.
            (torch.Tensor, "__float__"): _read_through_item(torch.Tensor.__float__, float),
            (torch.Tensor, "__int__"): _read_through_item(torch.Tensor.__int__, int),
            (torch.Tensor, "__index__"): _read_through_item(torch.Tensor.__index__, int),
            (accelerator, "is_available"): lambda: True,
            (accelerator, "current_accelerator"): lambda check_available=False: torch.device("cuda"),
            (accelerator, "device_count"): lambda: self.devices_per_node,
            (accelerator, "current_device_index"): lambda: self.current,
            (accelerator, "set_device_index"): self.set_device,
            (accelerator, "current_stream"): self.current_stream,
            (accelerator, "synchronize"): self.synchronize,
        }

    @contextmanager
    def installed(self) -> Iterator[SimulatedDevice]:
        """Answer ``torch.cuda``'s calls from this device while the block runs (one simulated rank per process)."""
        global _active
        import torch._dynamo  # noqa: F401 - before the patches: it indexes torch.cuda's functions once, on import

        patches = {**self.patches(), **_cpu_build_sees_an_accelerator()}
        saved = {(owner, name): _attribute(owner, name) for owner, name in patches}
        previous, _active = _active, self
        for (module, name), fn in patches.items():
            setattr(module, name, fn)
        try:
            yield self
        finally:
            for (module, name), fn in saved.items():
                setattr(module, name, fn)
            _active = previous


class FakeCudaFactories(TorchDispatchMode):
    """Tensors made on a CUDA device outside the rank's fake mode are made in it: while the plan is applied, the
    rank runs outside the fake mode (``DeviceMesh`` needs real index tensors), yet FSDP2 and DTensor make buffers on
    the mesh's device, which a CPU build cannot allocate."""

    def __init__(self, fake_mode: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode.__init__ untyped
        self.fake_mode = fake_mode

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            with self.fake_mode:
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _cpu_build_sees_an_accelerator() -> dict[tuple[Any, str], Any]:
    """Fake ``cuda:k`` tensors as ``privateuseone:k`` to torch's C++ code (the module docstring says why); patches in
    the form of :meth:`SimulatedDevice.patches`."""
    import torch._subclasses.fake_tensor as fake_tensor
    from torch.distributed.tensor import DTensor

    _register_accelerator()
    handlers = _MetaHandlers(fake_tensor._DISPATCH_META_HANDLERS)
    fake_device = handlers.device
    FakeTensor, FakeTensorMode = fake_tensor.FakeTensor, fake_tensor.FakeTensorMode
    dispatch, mode_dispatch = FakeTensor.__torch_dispatch__, FakeTensorMode.__torch_dispatch__
    wrapper_subclass, run_backward = torch.Tensor._make_wrapper_subclass, torch.autograd._engine_run_backward  # type: ignore[attr-defined]

    def device(args: Any) -> torch.device:
        below: torch.device = _below(fake_device(args))
        return below

    def torch_dispatch(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.prim.device.default:  # answered here outside a fake mode
            return device(args)
        return dispatch(func, types, args, kwargs if kwargs is not None else {})

    def fake_mode_dispatch(mode: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # C++ code makes tensors on the devices it was told: those are the fake tensors' CUDA devices.
        kwargs = {k: _above(v) for k, v in (kwargs or {}).items()}
        return mode_dispatch(mode, func, types, tuple(_above(a) for a in args), kwargs)

    def make_wrapper_subclass(cls: type, *args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _below(kwargs["device"])
        return wrapper_subclass(cls, *args, **kwargs)

    def engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.set_multithreading_enabled(False):  # no device threads: the calling thread runs all
            return run_backward(*args, **kwargs)

    return {
        (handlers, "device"): device,
        (FakeTensor, "__torch_dispatch__"): classmethod(torch_dispatch),
        (FakeTensorMode, "__torch_dispatch__"): fake_mode_dispatch,
        (FakeTensorMode, "avoid_device_init"): property(lambda mode: True),  # torch.tensor(device=) made on the CPU
        (torch.Tensor, "_make_wrapper_subclass"): staticmethod(make_wrapper_subclass),
        (torch.autograd, "_engine_run_backward"): engine_run_backward,
        (FakeTensor, "is_cuda"): property(lambda t: t.fake_device.type == "cuda"),
        (FakeTensor, "is_cpu"): property(lambda t: t.fake_device.type == "cpu"),
        (FakeTensor, "get_device"): lambda t: t.fake_device.index if t.fake_device.type == "cuda" else -1,
        (DTensor, "device"): property(lambda t: t._local_tensor.device),
        (DTensor, "is_cuda"): property(lambda t: t._local_tensor.device.type == "cuda"),
    }


_BELOW = "simulated_gpu"  # the name PrivateUse1 takes in a simulated rank: how C++ code sees a simulated GPU


def _below(device: Any) -> Any:
    d = torch.device(device) if isinstance(device, str) else device
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device(_BELOW, d.index if d.index is not None else _active.current)
    return device


def _above(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == _BELOW:
        return torch.device("cuda", value.index)
    return value


def _register_accelerator() -> None:
    """Make PrivateUse1 an accelerator whose streams and events do nothing (torch's Python backend registration),
    and give CUDA the CPU's no-op device guard; once per process (registrations cannot be undone: a simulated rank
    is a process of its own).

    Autograd's engine keeps the streams of an accelerator's tensors in order (it asks for the accelerator, its
    current streams, records events); a CPU build has none, and registering CUDA's would need C++. CUDA's device guard
    is still asked for by ops given a CUDA device (a move, a factory): torch's own ``_ensureCUDADeviceGuardSet``
    registers one only for CUDA builds without devices, so c10's registry of guards
    (``c10::impl::device_guard_impl_registry``, one pointer per device type) is written directly.
    """
    import ctypes
    import os

    from torch.utils.backend_registration import _DummyBackendModule, _DummyDeviceGuard, _DummyPrivateUse1Hook

    if torch._C._get_privateuse1_backend_name() != _BELOW:
        torch.utils.rename_privateuse1_backend(_BELOW)  # type: ignore[attr-defined]  # torch: not re-exported
        torch._register_device_module(_BELOW, _DummyBackendModule())
        torch._C._acc.register_python_privateuseone_hook(_DummyPrivateUse1Hook())
        torch._C._acc.register_python_privateuseone_device_guard(_DummyDeviceGuard())
    if not torch.backends.cuda.is_built():
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        registry = (ctypes.c_void_p * 2).in_dll(library, "_ZN3c104impl26device_guard_impl_registryE")  # CPU, CUDA
        if registry[1] is None:
            registry[1] = registry[0]


def _swap_tensors(swap: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``Module.to`` moves a fake parameter by swapping it for its copy, which torch refuses while anything else
    refers to it (an autograd graph of an earlier forward, such as the pipeline's trace); a real parameter is moved
    in place (``param.data = moved``): so is a fake one then."""

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            swap(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
                raise
            with torch.no_grad():
                t1.data = t2.detach()
            t1.fake_device = t2.fake_device

    return swap_tensors


@contextmanager
def fake_parameter_moves() -> Iterator[None]:
    """Fake parameters moved as real ones are (see :func:`_swap_tensors`), on a simulated rank of either device."""
    swap = torch.utils.swap_tensors
    torch.utils.swap_tensors = _swap_tensors(swap)
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


def _attribute(owner: Any, name: str) -> Any:
    """What to restore: a class's own descriptor (a classmethod, a property), else the attribute."""
    return inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)


class _MetaHandlers:
    """The fake tensors' ``prim.device`` handler as an attribute (what C++ code asks a tensor's device)."""

    def __init__(self, table: dict[OpOverload, Callable[[Sequence[object]], object]]) -> None:
        self._table = table

    @property
    def device(self) -> Callable[[Sequence[object]], object]:
        return self._table[torch.ops.prim.device.default]

    @device.setter
    def device(self, handler: Callable[[Sequence[object]], object]) -> None:
        self._table[torch.ops.prim.device.default] = handler


class _NoDevice:
    current = 0

    def on_sync(self, what: str) -> None:
        pass


_active: SimulatedDevice | _NoDevice = (
    _NoDevice()
)  # the device whose streams and events are in use (one simulated rank per process)


@contextmanager
def simulated_gpu(
    rank: int, devices_per_node: int, total_memory: int | None, recording: Any
) -> Iterator[SimulatedDevice]:
    """Be the GPU of global ``rank`` (``cuda:rank % devices_per_node``) with NCCL's rules checked on ``recording``.

    The current device is set to the rank's own before anything else, as Lightning's CUDA accelerator does at
    setup (before the process group exists).
    """
    from lightning_galvatron.dryrun.nccl_rules import NcclRules

    device = SimulatedDevice(rank % devices_per_node, devices_per_node, total_memory or DEFAULT_DEVICE_MEMORY)
    rules = NcclRules(device.own, lambda: device.current, lambda: recording.phase)
    device.on_sync = rules.sync
    recording.rules = rules
    with device.installed(), fake_parameter_moves():
        torch.cuda.set_device(device.own)
        yield device


def track_memory(tracker: Any) -> None:
    """Answer the simulated device's memory statistics from ``tracker`` (``None``: nothing is measured now)."""
    if isinstance(_active, SimulatedDevice):
        if tracker is None and _active.tracker is not None:
            _active.peak_base = _active.max_memory_allocated()
        _active.tracker = tracker
