"""Phase 3, blocks: forward/backward time against batch size and activation bytes, per block type.

A deep copy of the first block of each type runs on random hidden states of the captured shape,
plain and with recomputation; the per-degree half is :mod:`.degrees`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_galvatron.model.call_state import hidden_states_of
from lightning_galvatron.model.tensor_parallel_plans import (
    BlockTensorParallelPlan,
    _attention_heads,
    tensor_parallel_plan,
    tp_collectives_per_forward,
)
from lightning_galvatron.profiler.model.capture import _BlockCall
from lightning_galvatron.profiler.model.degrees import _DegreeMeasurement, _Styles
from lightning_galvatron.profiler.model.saved import (
    SavedTensorCounter,
    _allocated,
    _attribute_to_submodules,
    _output_bytes,
    _per_sample,
    _storage_bytes,
    _storage_key,
)
from lightning_galvatron.profiler.model.setup import (
    TARGET_POINT_S,
    _PrecisionConfig,
    _resize_tensor,
    _synchronize,
    agreed_repeats,
    quiet_over_ranks,
)
from lightning_galvatron.profiles import LayerTypeProfile, LinearFit

log = logging.getLogger(__name__)


class _BlockProfiler(_DegreeMeasurement):
    """Times and counts one block type on deep copies of its first block."""

    def __init__(
        self, block: nn.Module, call: _BlockCall, prec: _PrecisionConfig, device: torch.device, name: str
    ) -> None:
        self.block = block
        self.call = call
        self.prec = prec
        self.device = device
        self.name = name
        self.hidden = call.hidden
        self.tp_plan: BlockTensorParallelPlan | None = tensor_parallel_plan(block)
        self.failed_styles: dict[str, str] = {}

    # ------------------------------------------------------------------ inputs
    def copy(self) -> nn.Module:
        clone = copy.deepcopy(self.block)
        for t in (*clone.parameters(), *clone.buffers()):
            t.data = self.prec.place(t.data, self.device)
        return clone.train()

    def inputs(self, batch: int, seq_split: int = 1) -> tuple[tuple, dict]:
        """Random hidden states of ``batch`` samples (sequence split ``seq_split`` ways) and the other
        captured arguments resized to the batch."""
        shape = list(self.hidden.shape)
        captured_batch = shape[0]
        shape[0] = batch
        if seq_split > 1:
            shape[1] //= seq_split
        hidden = torch.randn(shape, dtype=self.hidden.dtype, device=self.device, requires_grad=True)

        folded = dict(self.tp_plan.folded_inputs) if self.tp_plan is not None else {}
        shared = self.tp_plan.shared_inputs if self.tp_plan is not None else frozenset()

        def resize(value: Any, name: Any = None) -> Any:
            if value is self.hidden:
                return hidden
            if isinstance(value, (tuple, list)):  # rotary (cos, sin) per sample: part by part
                return type(value)(resize(part, name) for part in value)
            if not isinstance(value, torch.Tensor) or value.dim() < 1 or name in shared:
                return value
            factor = folded.get(name)
            if factor and value.shape[0] == captured_batch * factor:  # one row per sample and head (ALiBi)
                unfolded = value.view(captured_batch, factor, *value.shape[1:])
                return _resize_tensor(unfolded, batch).flatten(0, 1)
            if value.shape[0] == captured_batch:
                return _resize_tensor(value, batch)
            return value

        args = tuple(resize(a, i) for i, a in enumerate(self.call.args))
        kwargs = {k: resize(v, k) for k, v in self.call.kwargs.items()}
        return args, kwargs

    # ------------------------------------------------------------------ measurements
    def time_forward_backward(self, block: nn.Module, batch: int) -> tuple[float, float]:
        """(forward, backward) seconds of ``block`` on ``batch`` samples: the quiet end of the repeats, the
        quietest rank's (:func:`quiet_over_ranks`). Collective in a process group."""

        def once() -> tuple[float, float]:
            args, kwargs = self.inputs(batch)
            _synchronize(self.device)
            start = time.perf_counter()
            with self.prec.autocast(self.device):
                out = block(*args, **kwargs)
            _synchronize(self.device)
            middle = time.perf_counter()
            _backward(out)
            _synchronize(self.device)
            return middle - start, time.perf_counter() - middle

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank times the same point at once: training's contention, the same at every size
        warm = once()
        samples = [once() for _ in range(agreed_repeats(sum(warm), TARGET_POINT_S))]
        for p in block.parameters():
            p.grad = None
        forward, backward = quiet_over_ranks(samples)
        return forward, backward

    def saved_bytes(
        self, block: nn.Module, batch: int, seq_split: int = 1, attribute: bool = False, keep_input: bool = False
    ) -> SavedTensorCounter:
        """Bytes autograd saves in one forward of ``block`` (optionally attributed to its submodules).

        ``keep_input`` adds the hidden states if no op saved them: a recomputed block holds its
        input for the replay outside autograd's saved tensors (the checkpoint keeps the arguments).
        """
        args, kwargs = self.inputs(batch, seq_split)
        exclude = [*block.parameters(), *block.buffers()]
        exclude += [
            v
            for v in (*args, *kwargs.values())
            if isinstance(v, torch.Tensor) and v is not hidden_states_of(args, kwargs)[1]
        ]
        counter = SavedTensorCounter(exclude)
        handles = _attribute_to_submodules(block, counter, self.attribution_names()) if attribute else []
        hidden = hidden_states_of(args, kwargs)[1]
        before = _allocated(self.device, reset_peak=True)
        try:
            with counter, self.prec.autocast(self.device):
                out = block(*args, **kwargs)
            if self.device.type == "cuda":
                # What stays allocated besides the output, plus the input if an op saved it (it was allocated before).
                counted_input = _storage_bytes(hidden) if _storage_key(hidden) in counter.seen else 0
                counter.allocator_bytes = _allocated(self.device) - before - _output_bytes(out) + counted_input
                counter.allocator_peak_bytes = torch.cuda.max_memory_allocated(self.device) - before
            if keep_input:
                counter.phase = "input"
                counter._pack(hidden)
        finally:
            for h in handles:
                h.remove()
        del out
        return counter

    def attribution_names(self) -> dict[str, str]:
        """Submodule name -> role for the derived per-degree model: ``column`` (the column-parallel
        projections, whose input stays whole: gathered under SP, replicated without) and ``norm``
        (the block's own norms, which only SP splits; named like the TP plans name them)."""
        if self.tp_plan is None:
            return {}
        from torch.distributed.tensor.parallel import ColwiseParallel

        from lightning_galvatron.runtime.tensor_parallel import ColwiseFused

        roles = {
            name: "column"
            for name, style in self.tp_plan.styles(False).items()
            if isinstance(style, (ColwiseParallel, ColwiseFused))
        }
        for name, child in self.block.named_children():
            if "norm" in type(child).__name__.lower() or name.startswith("ln"):
                roles[name] = "norm"
        return roles

    def attention_calls(self, block: nn.Module) -> int:
        """How many times the block calls ``F.scaled_dot_product_attention`` (Ulysses wraps each)."""
        counter = _AttentionCounter()
        args, kwargs = self.inputs(1)
        with torch.no_grad(), counter, self.prec.autocast(self.device):
            block(*args, **kwargs)
        return counter.calls

    # ------------------------------------------------------------------ the profile
    def profile(self, sizes: Sequence[int], degrees: Sequence[int], world: int) -> LayerTypeProfile:
        from torch.distributed._composable import checkpoint

        block, recompute = self.copy(), self.copy()
        checkpoint(recompute)
        forward, backward, recompute_backward = [], [], []
        for b in sizes:
            f, bw = self.time_forward_backward(block, b)
            _, rbw = self.time_forward_backward(recompute, b)
            forward.append(f)
            backward.append(bw)
            recompute_backward.append(rbw)
        count_sizes = sizes[:2] if len(sizes) > 1 else sizes
        plain = [(b, self.saved_bytes(block, b, attribute=True)) for b in count_sizes]
        per_sample = _per_sample([(b, float(c.total)) for b, c in plain])
        roles = {role: _per_sample([(b, float(c.bytes[role])) for b, c in plain]) for role in ("column", "norm")}
        kept = [(b, float(self.saved_bytes(recompute, b, keep_input=True).total)) for b in count_sizes]
        self._cross_check(plain)

        attention_calls = self.attention_calls(block)
        plan = self.tp_plan
        styles = _Styles(
            tensor_parallel=plan is not None,
            megatron_sp=plan is not None and plan.megatron_sp,
            ulysses=plan is not None and plan.ulysses and attention_calls > 0,
        )
        split, replicated = self.per_degree(per_sample, roles, degrees, world, count_sizes, styles)
        styles = self.styles_that_ran(styles)
        log.info(
            "%s: forward %s s at batch %s; backward/forward %.2f; recompute adds %.2f forwards; %.0f activation "
            "bytes/sample",
            self.name,
            [f"{t:.2e}" for t in forward],
            list(sizes),
            sum(backward) / sum(forward),
            (sum(recompute_backward) - sum(backward)) / sum(forward),
            per_sample,
        )
        heads = self.num_heads()
        return LayerTypeProfile(
            name=self.name,
            parameters=sum(p.numel() for p in self.block.parameters()),
            hidden_size=int(self.hidden.shape[-1]),
            num_heads=heads,
            ffn_hidden_size=self.ffn_hidden_size(),
            seq_length=int(self.hidden.shape[1]) if self.hidden.dim() >= 3 else 1,
            forward_time=LinearFit.fit(sizes, forward),
            activation_bytes_per_sample=split,
            recompute_activation_bytes_per_sample=_per_sample(kept),
            replicated_activation_bytes_per_sample=replicated,
            backward_to_forward=sum(backward) / sum(forward) if sum(forward) > 0 else 2.0,
            supports_tensor_parallel=styles.tensor_parallel,
            supports_megatron_sp=styles.megatron_sp,
            supports_ulysses=styles.ulysses,
            tp_collectives_per_forward=tp_collectives_per_forward(self.tp_plan),
            ulysses_all_to_alls_per_forward=4 * attention_calls if attention_calls else 4,
            tensor_parallel_divisors=tuple(plan.divisible.values()) if plan is not None else (),
            ulysses_divisors=tuple(plan.ulysses_sizes.values()) if plan is not None else (),
        )

    # ------------------------------------------------------------------ shape
    def num_heads(self) -> int:
        """Attention heads as the divisibility rules need them: the gcd of the head counts (query and
        key/value heads), else of the sizes the TP plan says a degree must divide, else 1."""
        heads = _attention_heads(self.block)
        if heads:
            return math.gcd(*heads.values())
        if self.tp_plan is not None and self.tp_plan.divisible:
            return math.gcd(*self.tp_plan.divisible.values())
        return 1

    def ffn_hidden_size(self) -> int:
        widths = [
            int(s) for m in self.block.modules() if isinstance(m, nn.Linear) for s in (m.in_features, m.out_features)
        ]
        widths += [int(s) for m in self.block.modules() if type(m).__name__ == "Conv1D" for s in m.weight.shape]
        return max(widths, default=int(self.hidden.shape[-1]))

    def _cross_check(self, plain: Sequence[tuple[int, SavedTensorCounter]]) -> None:
        for b, counter in plain:
            allocated = counter.allocator_bytes
            if allocated is None:
                continue
            agree = abs(allocated - counter.total) <= 0.1 * max(counter.total, 1)
            (log.debug if agree else log.info)(
                "%s at batch %d: autograd saves %d bytes; the CUDA allocator kept %d (peak %d above the start)%s",
                self.name,
                b,
                counter.total,
                allocated,
                counter.allocator_peak_bytes,
                ""
                if agree
                else ": they differ by more than 10% (allocator rounding, workspaces, tensors kept outside autograd)",
            )


class _AttentionCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _backward(out: Any) -> None:
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(tensors[:1], [torch.randn_like(tensors[0])])
