"""Data parallelism for ``ddp`` layers: whole parameters, gradients summed in buckets overlapped with backward.

Why not FSDP2's ``replicate``: it treats replicated parameters like sharded ones (DTensors, an unsharded
copy gathered for every forward, one reduction per module with its hooks), which made a pure-DDP plan
about 1.8x slower than ``torch.nn.parallel.DistributedDataParallel`` on the same model: the optimizer
dispatches every update through DTensor and backward pays a collective per block. Here the parameters
stay as they are (plain tensors, or the DTensors tensor parallelism made on its own group), and their
gradients are summed over each layer's dp group as DDP does it: in flat buckets of about ``bucket_bytes`` (the
first one smaller), each launched asynchronously as soon as all its gradients are accumulated, the sums waited for
at the end of backward. A bucket's flat buffer lives as long as the reducer, and a plain parameter's gradient becomes
its view of it as soon as autograd has accumulated it (``DistributedDataParallel(gradient_as_bucket_view=True)``):
the tensor autograd allocated is freed at once, later accumulation goes into the buffer, nothing is copied back,
and gradients take their memory once.

**Bucket order.** The first backward buckets the parameters in an assumed order (blocks in reverse, then the
layers outside the blocks). It records the order in which gradients actually became ready -- a tied embedding and
head, a module used twice, a parameter some step leaves unused all put it far from the registration order -- and at
its end the buckets are rebuilt once in that order, as DDP's reducer rebuilds them after its first iteration, so that
from the second step on every bucket is launched as soon as backward has produced it. Ranks may see different orders
(data-dependent graphs): the order of the ranks' first (``order_group`` rank 0) is broadcast, so that every rank of a
group issues the same sequence of collectives. Parameters that never received a gradient in that backward go last.

Gradients are **summed** (the runtime's convention, see ``sharding``). The sum is linear, so
accumulation over micro-batches or over Lightning's ``accumulate_grad_batches`` reduces once, after
the last backward of the window (:meth:`GradientReducer.deferred`, then :meth:`GradientReducer.reduce`).
Summed gradients cannot be summed again: a second backward before the optimizer steps is refused.
Weights that two pipeline stages hold (a tied embedding and head) are summed across those stages at the
same moment (:meth:`GradientReducer.add_shared`): a sum per batch would add the batches summed before it
in the accumulation window again.

A gradient missing on some rank (a parameter unused by its data) is reduced as zeros there; a presence count
travels with each bucket, and a parameter whose gradient is missing on every rank keeps ``grad=None`` as in
single-process training.
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
from torch.utils.hooks import RemovableHandle

from lightning_galvatron.runtime.mesh import collective_device, local_tensor, values_travel

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
#: The first bucket in backward order is small, as DDP's: its sum starts while most of backward is still to run.
DEFAULT_FIRST_BUCKET_BYTES = 2**20


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None  # None: a layer without replicas (its gradients only get their layout)
    ready: int = 0
    launched: bool = False
    buffer: torch.Tensor | None = None  # the flat gradients, then one presence count per parameter
    views: list[torch.Tensor] = field(default_factory=list)  # per parameter: its slice of ``buffer``, its shape
    work: dist.Work | None = None
    #: Per parameter: whether its gradient becomes its view as soon as it is accumulated (DTensor gradients are
    #: copied at :meth:`launch`).
    adopts: list[bool] = field(init=False)
    has_dtensors: bool = field(init=False)

    def __post_init__(self) -> None:
        self.adopts = [self.group is not None and not isinstance(p, DTensor) for p in self.params]
        self.has_dtensors = any(isinstance(p, DTensor) for p in self.params)

    def adopt(self, param: nn.Parameter, index: int) -> None:
        """Make ``param``'s (the ``index``-th parameter's) gradient its view of the buffer (a copy now; what autograd
        allocated is freed, and further accumulation goes into the view)."""
        if not self.adopts[index]:
            return
        view = self._views()[index]
        grad = param.grad
        if grad is not view and grad is not None:
            view.copy_(grad)
            param.grad = view

    def launch(self) -> None:
        """Copy this rank's gradients not in the buffer yet (zeros where missing) and their presence; sum it."""
        self.launched = True
        if self.has_dtensors:
            for p in self.params:
                match_parameter_layout(p)
        if self.group is None:
            return
        missing = False
        for p, view in zip(self.params, self._views()):
            grad = p.grad
            if grad is None:
                view.zero_()
                missing = True
            elif grad is not view:
                view.copy_(local_tensor(grad))
        buffer = self.buffer
        assert buffer is not None
        presence = buffer[buffer.numel() - len(self.params) :]
        if missing:
            presence.copy_(torch.tensor([p.grad is not None for p in self.params], dtype=buffer.dtype))
        else:
            presence.fill_(1)
        self.work = dist.all_reduce(buffer, group=self.group, async_op=True)

    def _views(self) -> list[torch.Tensor]:
        if not self.views:  # made at first use, where the parameters are on their device and in their dtype
            locals_ = [local_tensor(p) for p in self.params]
            self.buffer = buffer = locals_[0].new_empty(sum(t.numel() for t in locals_) + len(locals_))
            offset = 0
            for t in locals_:
                self.views.append(buffer[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
        return self.views

    def finish(self) -> None:
        """Wait for the sum and hand it to the gradients."""
        if self.work is not None:
            assert self.buffer is not None
            self.work.wait()
            # Only a rank missing a gradient needs to know whether another rank had one (reading the counts
            # would otherwise synchronise the host with the device for every bucket).
            present = None
            if any(p.grad is None for p in self.params):
                present = self.buffer[self.buffer.numel() - len(self.params) :].tolist()
            for i, (p, view) in enumerate(zip(self.params, self.views)):
                if present is not None and present[i] == 0:
                    continue
                grad = p.grad
                if isinstance(p, DTensor):
                    if grad is None:
                        p.grad = _like(p, view.clone())
                    else:
                        local_tensor(grad).copy_(view)
                elif grad is not view:
                    p.grad = view
        self.work, self.ready, self.launched = None, 0, False


def match_parameter_layout(param: nn.Parameter) -> None:
    """Give a DTensor parameter's gradient the parameter's placements.

    DTensor may produce a gradient in another layout than its parameter's (a vocabulary-parallel
    embedding's is replicated while its weight is sharded); the optimizer, clipping and the reductions
    here work on the parameter's shards.
    """
    grad = param.grad
    if isinstance(grad, DTensor):
        assert isinstance(param, DTensor)  # a DTensor gradient is a DTensor parameter's
        if tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _like(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``param`` from its local values (a DTensor with the parameter's layout where needed)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


@dataclass
class GradientReducer:
    """Sums the gradients of registered parameters over their dp groups once per optimizer step."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    #: Buckets launched during the last backward pass, before its end (the rest waited for the end): the overlap.
    launched_during_backward: int = 0
    _pending: list[tuple[list[nn.Parameter], dist.ProcessGroup | None, bool]] = field(default_factory=list)
    _buckets: list[_Bucket] = field(default_factory=list)
    _slot: dict[int, tuple[_Bucket, int]] = field(default_factory=dict)  # by parameter id: its bucket, its index there
    _group_of: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)
    _registered: set[int] = field(default_factory=set)
    _deferrals: int = 0
    _launched: int = 0  # buckets launched in this backward, in order
    _callback_queued: bool = False
    _summed: bool = False  # gradients were summed and the optimizer has not stepped since
    _hooks: list[RemovableHandle] = field(default_factory=list)
    _shared: list[tuple[Callable[[], list[nn.Parameter]], dist.ProcessGroup]] = field(default_factory=list)
    _ready_now: set[int] = field(default_factory=set)  # parameters whose gradient is ready in this backward
    _ready_order: dict[int, None] | None = None  # ids of parameters in the order their gradients became ready
    _order_group: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------ registration (before training)
    def add(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, reduce_last: bool = False) -> None:
        """Register the trainable ``params`` of one layer, replicated over ``group``.

        Blocks are added in forward order and first bucketed in reverse, as their gradients are expected to
        arrive. Layers outside the blocks (``reduce_last``) hold both the first and the last layers to run
        (embedding and head), so they first go last. The first backward pass corrects both guesses.
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

    def build(self, order_group: dist.ProcessGroup | None = None) -> None:
        """Bucket the registered parameters and hook them; call once, after every ``add``.

        ``order_group``: ranks that registered the same layers in the same order (a pipeline stage), over which the
        bucket order of the first backward is agreed (its rank 0's). Without it, the one group every bucket sums
        over; where buckets sum over several groups and none is given, the buckets keep their first order.
        """
        assert not self._buckets, "GradientReducer.build() was called twice"
        in_order = [unit for unit in reversed(self._pending) if not unit[2]] + [
            unit for unit in self._pending if unit[2]
        ]
        for params, group, _ in in_order:
            for p in params:
                self._group_of[id(p)] = group
        self._bucketize([p for params, _, _ in in_order for p in reversed(params)])
        groups = {id(g): g for g in self._group_of.values() if g is not None}
        if order_group is None and len(groups) <= 1:
            order_group = next(iter(groups.values()), None)
        if order_group is not None or not groups:
            self._ready_order, self._order_group = {}, order_group
        hook = self._gradient_hook()
        for bucket in self._buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        self._pending = []

    def _gradient_hook(self) -> Callable[[nn.Parameter], None]:
        """The hook of every registered parameter. It holds the reducer weakly: a parameter's hooks are held from C++,
        where the garbage collector cannot see the cycle parameter -> hook -> reducer -> bucket -> parameter (a bound
        method as the hook kept every model a process had fitted alive after its Trainer and strategy were gone)."""
        reducer = weakref.ref(self)

        def on_gradient(param: nn.Parameter) -> None:
            owner = reducer()
            if owner is not None:
                owner._on_gradient(param)

        return on_gradient

    def _bucketize(self, params: list[nn.Parameter]) -> None:
        """Buckets over ``params`` in this order: a new one where the group, dtype or device changes or the size is
        reached (``first_bucket_bytes`` for the first)."""
        self._buckets = []
        current: list[nn.Parameter] = []
        size = 0
        for p in params:
            if current and (
                self._group_of[id(p)] is not self._group_of[id(current[0])]
                or p.dtype != current[0].dtype
                or local_tensor(p).device != local_tensor(current[0]).device
            ):
                self._buckets.append(_Bucket(current, self._group_of[id(current[0])]))
                current, size = [], 0
            current.append(p)
            size += local_tensor(p).numel() * p.element_size()
            if size >= (self.bucket_bytes if self._buckets else self.first_bucket_bytes):
                self._buckets.append(_Bucket(current, self._group_of[id(p)]))
                current, size = [], 0
        if current:
            self._buckets.append(_Bucket(current, self._group_of[id(current[0])]))
        self._slot = {id(p): (bucket, i) for bucket in self._buckets for i, p in enumerate(bucket.params)}

    def _rebuild_in_ready_order(self) -> None:
        """Bucket again in the order the first backward's gradients became ready (``order_group``'s rank 0's).
        Collective over ``order_group``."""
        assert self._ready_order is not None
        params = self.params
        index = {id(p): i for i, p in enumerate(params)}
        order = [index[k] for k in self._ready_order if k in index]
        order += [i for i, p in enumerate(params) if id(p) not in self._ready_order]  # no gradient: last
        group = self._order_group
        if group is not None and dist.get_world_size(group) > 1:
            agreed = torch.tensor(order, dtype=torch.int64, device=collective_device(group))
            dist.broadcast(agreed, group=group, group_src=0)
            if values_travel(group):  # the dry run's fake backend carries none: each rank keeps its own
                order = agreed.tolist()
        self._ready_order = None
        self._bucketize([params[i] for i in order])

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for bucket in self._buckets for p in bucket.params]

    def group_of(self, param: nn.Parameter) -> dist.ProcessGroup | None:
        """The group ``param``'s gradient is summed over (``None``: not registered here, or no replicas)."""
        return self._group_of.get(id(param))

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
            self._buckets[self._launched].launch()
            self._launched += 1
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

    def optimizer_stepped(self) -> None:
        """The optimizer consumed the summed gradients (hook this on every optimizer's step)."""
        self._summed = False

    def _on_gradient(self, param: nn.Parameter) -> None:
        """Runs once per parameter and backward pass: one lookup before the work."""
        key = id(param)
        bucket, index = self._slot[key]
        if self._ready_order is not None:
            self._ready_order.setdefault(key, None)
        if not bucket.launched:
            bucket.adopt(param, index)
        if self._deferrals:
            return
        if not self._callback_queued:
            self._check_not_summed()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        ready = self._ready_now
        if key in ready:  # accumulated again in the same backward (a reentrant checkpoint)
            if bucket.launched:
                raise RuntimeError(
                    f"the gradient of a ddp parameter of shape {tuple(param.shape)} was accumulated again after it "
                    "had been summed over its replicas, in the same backward pass (a parameter used both inside and "
                    "outside a reentrant activation checkpoint?): use checkpoint(..., use_reentrant=False)"
                )
            return
        ready.add(key)
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the complete buckets, in bucket order only, so that every rank of a group issues the same
        sequence."""
        while self._launched < len(self._buckets):
            nxt = self._buckets[self._launched]
            if nxt.ready < len(nxt.params):
                break
            nxt.launch()
            self._launched += 1

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self.launched_during_backward = self._launched
        self.reduce()

    def _finish(self) -> None:
        for bucket in self._buckets:
            if bucket.launched:
                bucket.finish()
            bucket.ready = 0
        self._ready_now.clear()
        self._launched = 0
        self._summed = True
        if self._ready_order is not None:  # the first reduction: every rank of the order group is here
            self._rebuild_in_ready_order()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for bucket in self._buckets:
            bucket.buffer, bucket.views = None, []
