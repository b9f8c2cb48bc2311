"""Data parallelism for ``ddp`` layers: whole parameters, gradients summed in buckets overlapped with backward.

Why not FSDP2's ``replicate``: it treats replicated parameters like sharded ones (DTensors, an unsharded
copy gathered for every forward, one reduction per module with its hooks), which made a pure-DDP plan
about 1.8x slower than ``torch.nn.parallel.DistributedDataParallel`` on the same model: the optimizer
dispatches every update through DTensor and backward pays a collective per block. Here the parameters
stay as they are (plain tensors, or the DTensors tensor parallelism made on its own group), and their
gradients are summed over each layer's dp group as DDP does it: flattened into buckets of about
``bucket_bytes`` in backward order (the first one smaller), each launched asynchronously as soon as all its
gradients are accumulated (at most two in flight, so the flat copies stay small), the last ones waited for at
the end of backward.

Gradients are **summed** (the runtime's convention, see ``sharding``). The sum is linear, so
accumulation over micro-batches or over Lightning's ``accumulate_grad_batches`` reduces once, after
the last backward of the window (:meth:`GradientReducer.deferred`, then :meth:`GradientReducer.reduce`).
Summed gradients cannot be summed again: a second backward before the optimizer steps is refused.
Weights that two pipeline stages hold (a tied embedding and head) are summed across those stages at the
same moment (:meth:`GradientReducer.add_shared`): a sum per batch would add the batches summed before it
in the accumulation window again.

Every rank registers the same layers in the same order and launches its buckets strictly in that order,
so the collectives of each group match across its ranks. A gradient missing on some rank (a parameter
unused by its data) is reduced as zeros there; a presence count travels with each bucket, and a parameter
whose gradient is missing on every rank keeps ``grad=None`` as in single-process training.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_galvatron.runtime.mesh import local_tensor

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
#: The first bucket in backward order is small, as DDP's: its sum starts while most of backward is still to run.
DEFAULT_FIRST_BUCKET_BYTES = 2**20


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None  # None: a layer without replicas (its gradients only get their layout)
    ready: int = 0
    launched: bool = False
    flat: torch.Tensor | None = None
    work: dist.Work | None = None

    def launch(self) -> None:
        """Flatten this rank's gradients (zeros where missing) with a presence count per parameter; sum them."""
        self.launched = True
        for p in self.params:
            match_parameter_layout(p)
        if self.group is None:
            return
        pieces, present = [], []
        for p in self.params:
            local = local_tensor(p).detach()
            grad = p.grad
            pieces.append(local_tensor(grad).reshape(-1) if grad is not None else local.new_zeros(local.numel()))
            present.append(grad is not None)
        pieces.append(torch.tensor(present, dtype=pieces[0].dtype, device=pieces[0].device))
        self.flat = torch.cat(pieces)
        self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for the sum and write it back into the gradients."""
        if self.work is not None:
            assert self.flat is not None
            self.work.wait()
            flat, offset = self.flat, 0
            # Only a rank missing a gradient needs to know whether another rank had one (reading the counts
            # would otherwise synchronise the host with the device for every bucket).
            if any(p.grad is None for p in self.params):
                present = flat[-len(self.params) :].tolist()
            else:
                present = [1] * len(self.params)
            for p, count in zip(self.params, present):
                local = local_tensor(p)
                n = local.numel()
                if count > 0:
                    summed = flat[offset : offset + n].view_as(local)
                    if p.grad is None:
                        p.grad = _like(p, summed.clone())
                    else:
                        local_tensor(p.grad).copy_(summed)
                offset += n
        self.flat, self.work, self.ready, self.launched = None, None, 0, False


def match_parameter_layout(param: nn.Parameter) -> None:
    """Give a DTensor parameter's gradient the parameter's placements.

    DTensor may produce a gradient in another layout than its parameter's (a vocabulary-parallel
    embedding's is replicated while its weight is sharded); the optimizer, clipping and the reductions
    here work on the parameter's shards.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _like(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``param`` from its local values (a DTensor with the parameter's layout where needed)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


def _weakly(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """A gradient hook that calls ``method`` while its object lives. A parameter's hooks are held from C++, where the
    garbage collector cannot see the cycle parameter -> hook -> reducer -> bucket -> parameter: a bound method as the
    hook kept every model a process had fitted alive after its Trainer and strategy were gone."""
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook


@dataclass
class GradientReducer:
    """Sums the gradients of registered parameters over their dp groups once per optimizer step."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    _pending: list[tuple[list[nn.Parameter], dist.ProcessGroup | None, bool]] = field(default_factory=list)
    _buckets: list[_Bucket] = field(default_factory=list)
    _bucket_of: dict[int, _Bucket] = field(default_factory=dict)
    _registered: set[int] = field(default_factory=set)
    _deferrals: int = 0
    _launched: int = 0  # buckets launched in this backward, in order
    _callback_queued: bool = False
    _summed: bool = False  # gradients were summed and the optimizer has not stepped since
    _hooks: list = field(default_factory=list)
    _shared: list[tuple[Callable[[], list[nn.Parameter]], dist.ProcessGroup]] = field(default_factory=list)

    # ------------------------------------------------------------------ registration (before training)
    def add(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, reduce_last: bool = False) -> None:
        """Register the trainable ``params`` of one layer, replicated over ``group``.

        Blocks are added in forward order and reduced in reverse, as their gradients arrive. Layers
        outside the blocks (``reduce_last``) hold both the first and the last layers to run (embedding
        and head), so their gradients are complete only at the end of backward: they go last.
        """
        params = [p for p in dict.fromkeys(params) if p.requires_grad and id(p) not in self._registered]
        self._registered.update(id(p) for p in params)
        if params:
            self._pending.append((params, group if dist.get_world_size(group) > 1 else None, reduce_last))

    def add_shared(self, params: Callable[[], list[nn.Parameter]], group: dist.ProcessGroup) -> None:
        """Sum the gradients of ``params()`` (this rank's copies of weights other ranks of ``group`` hold too, each
        computing part of their gradient) over ``group`` in :meth:`reduce`, before the dp reduction; backward
        passes that compute them must run :meth:`deferred`. A callable: sharding replaces parameter objects."""
        self._shared.append((params, group))

    def owns(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is data-parallel through this reducer (FSDP must leave it alone)."""
        return id(param) in self._registered

    def build(self) -> None:
        """Bucket the registered parameters in backward order and hook them; call once, after every ``add``."""
        assert not self._buckets, "GradientReducer.build() was called twice"
        in_order = [unit for unit in reversed(self._pending) if not unit[2]] + [
            unit for unit in self._pending if unit[2]
        ]
        # Consecutive layers on the same group share buckets: one collective per ~bucket_bytes, not per layer.
        current: list[nn.Parameter] = []
        current_group: dist.ProcessGroup | None = None
        size = 0
        for params, group, _ in in_order:
            if current and group is not current_group:
                self._buckets.append(_Bucket(current, current_group))
                current, size = [], 0
            current_group = group
            for p in reversed(params):
                current.append(p)
                size += local_tensor(p).numel() * p.element_size()
                if size >= (self.bucket_bytes if self._buckets else self.first_bucket_bytes):
                    self._buckets.append(_Bucket(current, group))
                    current, size = [], 0
        if current:
            self._buckets.append(_Bucket(current, current_group))
        for bucket in self._buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(_weakly(self._on_gradient)))
        self._pending = []

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for bucket in self._buckets for p in bucket.params]

    def group_of(self, param: nn.Parameter) -> dist.ProcessGroup | None:
        """The group ``param``'s gradient is summed over (``None``: not registered here, or no replicas)."""
        bucket = self._bucket_of.get(id(param))
        return bucket.group if bucket is not None else None

    # ------------------------------------------------------------------ the step
    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Backward passes inside only accumulate; the owner calls :meth:`reduce` after the last one."""
        self._deferrals += 1
        try:
            yield
        finally:
            self._deferrals -= 1

    @property
    def is_deferred(self) -> bool:
        return self._deferrals > 0

    def reduce(self) -> None:
        """Sum every bucket now (after backward passes run under :meth:`deferred`)."""
        if self._launched == 0:
            self._check_not_summed()
            self._sum_shared()
        while self._launched < len(self._buckets):
            self._launch_next()
        self._finish()

    def _sum_shared(self) -> None:
        for params, group in self._shared:
            for param in params():
                if param.grad is not None:
                    match_parameter_layout(param)  # the embedding's and the head's gradients may differ in layout
                    dist.all_reduce(local_tensor(param.grad), group=group)

    def _check_not_summed(self) -> None:
        if self._summed and any(p.grad is not None for bucket in self._buckets for p in bucket.params):
            raise RuntimeError(
                "a second backward pass before the optimizer step: the gradients of ddp layers were already summed "
                "over their replicas and would be summed again. Sum the losses and call backward once, let Lightning "
                "accumulate (accumulate_grad_batches; under Fabric, run the backward passes but the last inside "
                "fabric.no_backward_sync(model)), or use dp_type='zero2'/'zero3' for these layers"
            )

    def _launch_next(self) -> None:
        """Launch the next bucket in order; finish the one before the previous (at most two in flight)."""
        if self._launched >= 2:
            self._buckets[self._launched - 2].finish()
        self._buckets[self._launched].launch()
        self._launched += 1

    def optimizer_stepped(self) -> None:
        """The optimizer consumed the summed gradients (hook this on every optimizer's step)."""
        self._summed = False

    def _on_gradient(self, param: nn.Parameter) -> None:
        if self.is_deferred:
            return
        if not self._callback_queued:
            self._check_not_summed()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        # Launch in bucket order only, so that every rank of a group issues the same sequence.
        while self._launched < len(self._buckets):
            nxt = self._buckets[self._launched]
            if nxt.ready < len(nxt.params):
                break
            self._launch_next()

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self.reduce()

    def _finish(self) -> None:
        for bucket in self._buckets:
            if bucket.launched:
                bucket.finish()
            bucket.ready = 0
        self._launched = 0
        self._summed = True

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
