"""Peak memory of one simulated training step, by category, with torch's ``MemTracker``.

``torch.distributed._tools.mem_tracker.MemTracker`` follows every tensor storage that ops create (fake
tensors have sizes, so a step on fake tensors is measured as it would allocate) and labels it:
parameters and buffers (registered up front here), gradients (from hooks on the parameters),
optimizer states (created inside ``optimizer.step``), activations (made in forward) and temporaries
(made in backward: gradients of activations, FSDP2's reduce-scatter buffers and re-gathered weights,
recomputed activations). Its peak is the largest total it saw, with the split at that moment.

Two changes make it fit a pipelined step: module hooks are left out (``MemTracker`` refuses a module
that runs twice in one step, which every micro-batch does, and its per-module snapshots cost more
than the step itself), so recomputed activations count as temporaries; and only the overall peak is
kept. FSDP2 writes sharded gradients directly (not through autograd's accumulation): until the step
ends they count as temporaries. Storages on the meta device (pipeline shape placeholders) are not
memory and are left out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from lightning_galvatron.dryrun.cuda import track_memory

CATEGORIES = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer_states",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.OTH: "other",
}


class StepMemoryTracker(MemTracker):
    """``MemTracker`` without module hooks, for a step of many micro-batches (see the module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self._module, self._optimizer = module, optimizer

    def __enter__(self) -> StepMemoryTracker:
        self._track_module_params_and_buffers(self._module, install_grad_hooks=True)
        if self._optimizer is not None:
            self._track_optimizer_states(_MemRefType.OPT, self._optimizer)
        self._fake_mode_on_entry = torch._guards.active_fake_mode()
        self._register_global_optimizer_hook()
        self._track_resize()
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()}
        torch.utils._python_dispatch.TorchDispatchMode.__enter__(self)
        track_memory(self)  # a simulated GPU's memory statistics read this step's accounting
        return self

    def __exit__(self, *args: object) -> None:
        track_memory(None)
        self._deregister_param_and_optimizer_hooks()
        self._restore_resize()
        torch.utils._python_dispatch.TorchDispatchMode.__exit__(self, *args)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[device] = snap[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snap)

    def peak(self) -> dict[str, int]:
        """Bytes per category at the peak of the (non-meta) device with the largest peak; ``total`` included."""
        devices = [d for d in self._peak_mem_snap if torch.device(d).type != "meta"]
        if not devices:
            return {name: 0 for name in (*CATEGORIES.values(), "total")}
        device = max(devices, key=lambda d: self._peak_mem_snap[d][_TOTAL_KEY])
        snap = self._peak_mem_snap[device]
        out = {name: int(snap.get(ref, 0)) for ref, name in CATEGORIES.items()}
        out["total"] = int(snap[_TOTAL_KEY])
        return out
