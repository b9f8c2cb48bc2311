"""Which layers outside the blocks a step runs before the blocks, and which after them.

A pipeline keeps the layers that run before the first block on the first stage and those that run
after the last block on the last stage; the other stages stand in for them. The order of
registration in ``__init__`` does not tell which is which (LitGPT registers its LM head before its
embedding and blocks), so :func:`trace_outside_layers` runs the step once, on one sample of a real
batch, and watches it:

- every call of a module with parameters outside the blocks, and every use of such a parameter,
  falls in a phase: before the first block, between blocks, inside a block, or after the last;
- each block receives, as its hidden states, the very tensor the previous block returned, and its
  other inputs depend neither on parameters nor on the hidden states (only the hidden states
  travel between stages);
- the step's outputs (the loss it returns, the values it logs) depend on what ran before the blocks
  only through the first block's input, and on the blocks only through the last block's output;
- the model's loop carries nothing from block to block besides the hidden states, whose positions no block
  changes (a stage restarts the loop at its first block: :mod:`~lightning_galvatron.model.loop_state`).

Whatever a pipeline could not run exactly raises a :class:`~lightning_galvatron.plan.PlanError`
naming the module and what to do. Blocks run without autograd (their own work does not matter
here, and it keeps the trace cheap); the hidden states are cut at every block's input, so autograd
can tell which paths reach the step's outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_galvatron.model.loop_state import loop_state_problem
from lightning_galvatron.plan import PlanError
from lightning_galvatron.runtime.structure import (
    ModelStructure,
    OutsideLayers,
    block_output_hidden,
    hidden_states_of,
    parameter_holders,
    with_hidden_states,
)

__all__ = [
    "OutsideLayers",
    "block_output_hidden",
    "hidden_states_of",
    "parameter_holders",
    "pipeline_loop_problem",
    "trace_outside_layers",
]

BEFORE, BETWEEN, INSIDE, AFTER = "before", "between", "inside", "after"
_WHERE = {
    BEFORE: "before the blocks",
    BETWEEN: "between the blocks",
    INSIDE: "inside a block",
    AFTER: "after the blocks",
}


def trace_outside_layers(module: nn.Module, structure: ModelStructure, step: str, batch: Any) -> OutsideLayers:
    """Run ``module.<step>(batch, 0)`` once and sort the layers outside the blocks by where they run.

    Args:
        module: the LightningModule as the user built it (not yet parallelised); nothing of it changes
            (modes, ``requires_grad``, buffers, gradients and the random state are restored).
        structure: its blocks; one block list.
        step: ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
        batch: an example batch; its first sample is used.
    """
    holders = parameter_holders(structure)
    problems = _holders_containing_blocks(structure, holders)
    if problems:
        raise PlanError(_message(problems))
    tracer = _Tracer(structure, holders)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    sample = tree_map(lambda t: t[:1].to(device) if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)
    with _untouched(module, train=step == "training_step"), _recording_logs(module) as logged, tracer:
        try:
            out = getattr(module, step)(sample, 0)
        except PlanError:
            raise
        except Exception as error:
            raise PlanError(
                f"with pipeline parallelism the strategy runs {type(module).__name__}.{step} once on one sample before "
                f"training, to see which layers run before and after the blocks; it failed: {type(error).__name__}: "
                f"{error}"
            ) from error
    problems = tracer.problems(outputs=[*tree_flatten(out)[0], *logged])  # autograd's graph outlives the hooks
    if problems:
        raise PlanError(_message(problems))
    carried = pipeline_loop_problem(module, structure, step, sample)
    if carried is not None:
        raise PlanError(carried)
    return tracer.outside_layers()


def pipeline_loop_problem(
    module: nn.Module, structure: ModelStructure, step: str | Callable[[nn.Module, Any], Any], batch: Any
) -> str | None:
    """Why a pipeline stage could not restart the model's loop over its blocks at its first block (the loop carries
    state besides the hidden states, or blocks change their positions: :mod:`~lightning_galvatron.model.loop_state`),
    seen by running ``step`` (a step's name, or ``step(module, batch)``) on one sample of ``batch``; else ``None``.
    Nothing of ``module`` changes."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    sample = tree_map(lambda t: t[:1].to(device) if isinstance(t, torch.Tensor) and t.dim() > 0 else t, batch)

    def run() -> None:
        training = step == "training_step" or not isinstance(step, str)
        with _untouched(module, train=training), _recording_logs(module), torch.no_grad():
            getattr(module, step)(sample, 0) if isinstance(step, str) else step(module, sample)

    return loop_state_problem(structure, run)


# ---------------------------------------------------------------------------------------------- the tracer
class _Tracer(TorchFunctionMode):
    """Watches one step: module calls and parameter uses by phase, and the blocks' inputs and outputs."""

    def __init__(self, structure: ModelStructure, holders: dict[str, nn.Module]) -> None:
        super().__init__()
        self.structure = structure
        self.blocks = structure.blocks
        self.block_names = structure.block_names
        self.holders = holders
        self.holder_name = {id(m): name for name, m in holders.items()}
        # parameter id -> (its name, ids of the modules holding it: two for a tied weight)
        self.parameters: dict[int, tuple[str, set[int]]] = {}
        for name, holder in holders.items():
            for attr, p in holder.named_parameters(recurse=False):
                label, owners = self.parameters.setdefault(id(p), (f"{name}.{attr}" if name else attr, set()))
                owners.add(id(holder))
        self.phase = BEFORE
        self.calls: dict[str, set[str]] = {}
        self.uses: list[tuple[str, str, str]] = []  # (parameter, phase, holder) used outside its module's call
        self.stack: list[int] = []
        self.block_order: list[int] = []
        self.cuts: list[torch.Tensor] = []  # each block's hidden input, cut from what computed it
        self.widths: list[int] = []  # the width of the hidden states each block returns
        self.before_outputs: list[tuple[str, torch.Tensor]] = []
        self.found: list[str] = []
        self.previous_output: torch.Tensor | None = None
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ installation
    def __enter__(self) -> _Tracer:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        for index, block in enumerate(self.blocks):
            block.forward = self._traced_block(index, block.forward)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        for block in self.blocks:
            del block.forward

    # ------------------------------------------------------------------ observation
    def _pre(self, module: nn.Module, args: tuple) -> None:
        self.stack.append(id(module))
        name = self.holder_name.get(id(module))
        if name is not None:
            self.calls.setdefault(name, set()).add(self.phase)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.stack.pop()
        name = self.holder_name.get(id(module))
        if name is not None and self.phase == BEFORE:
            self.before_outputs += [(name, t) for t in tree_flatten(output)[0] if _differentiable(t)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_metadata(func):  # ViT reads its patch projection's weight.dtype to cast the pixels: not a use
            return func(*args, **kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            known = self.parameters.get(id(leaf)) if isinstance(leaf, nn.Parameter) else None
            if known is not None and not known[1] & set(self.stack):
                label, owners = known
                owner = next(name for name, m in self.holders.items() if id(m) in owners)
                self.uses.append((label, self.phase, owner))
        return func(*args, **kwargs)

    def _traced_block(self, index: int, forward: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            self.block_order.append(index)
            name = self.block_names[index]
            where, hidden = hidden_states_of(args, kwargs)
            if index > 0 and hidden is not self.previous_output:
                self.found.append(
                    f"{name} does not receive the hidden states {self.block_names[index - 1]} returned (the step "
                    "changes them between the blocks); a pipeline hands each block's output to the next unchanged: "
                    "move that work into the blocks, or use pp=1"
                )
            for key, value in [*enumerate(args), *kwargs.items()]:
                if key != where and any(_differentiable(t) for t in tree_flatten(value)[0]):
                    self.found.append(
                        f"{name} receives an input ({_argument(key)}) computed from parameters or from the hidden "
                        "states; only the hidden states travel between pipeline stages, so a block's other inputs "
                        "must come from the batch alone: compute it inside the block, or use pp=1"
                    )
            cut = hidden.detach().requires_grad_(hidden.is_floating_point())
            self.cuts.append(cut)
            args, kwargs = with_hidden_states(args, kwargs, cut)
            self.phase = INSIDE
            try:
                with torch.no_grad():
                    out = forward(*args, **kwargs)
            finally:
                self.phase = AFTER if index == len(self.blocks) - 1 else BETWEEN
            out = tree_map(lambda t: _DependsOn.apply(t, cut) if _floating(t) and cut.requires_grad else t, out)
            self.previous_output = block_output_hidden(out)
            self.widths.append(int(self.previous_output.shape[-1]) if self.previous_output.dim() else 1)
            return out

        return traced

    # ------------------------------------------------------------------ conclusions
    def problems(self, outputs: list[Any]) -> list[str]:
        found = list(self.found)
        expected = list(range(len(self.blocks)))
        if self.block_order != expected:
            found.insert(
                0,
                f"the step called the blocks in the order {self.block_order}, not each of the {len(expected)} once in "
                f"order; with pipeline parallelism a step runs every block once, by iterating over their list",
            )
            return found
        for name, phases in self.calls.items():
            for phase in sorted(phases & {BETWEEN, INSIDE}):
                found.append(
                    f"{name} holds parameters outside the blocks but runs {_WHERE[phase]}; with pipeline parallelism "
                    "such layers run before the first block or after the last: make it part of the blocks, or use pp=1"
                )
            if {BEFORE, AFTER} <= phases:
                found.append(
                    f"{name} runs both before and after the blocks; a pipeline keeps the layers before them on the "
                    "first stage and those after them on the last: use two modules (they may share a weight, as a "
                    "tied embedding and head do), or pp=1"
                )
        for label, phase, owner in dict.fromkeys(self.uses):
            found.append(
                f"{label} is used {_WHERE[phase]} outside a call of {owner} (e.g. F.linear(x, {label})); with pipeline "
                f"parallelism parameters outside the blocks are used through their own module: call {owner}, or use a "
                "module whose weight is tied to it (an nn.Linear head sharing the embedding's weight)"
            )
        found += self._leaks([t for t in outputs if _differentiable(t)])
        sides = self._sides()
        for name in self.holders:  # a module and its submodule on different sides of the blocks
            for child in self.holders:
                if child.startswith(f"{name}.") and sides[name] != sides[child]:
                    found.append(f"{name} and its submodule {child} run on different sides of the blocks; use pp=1")
        return list(dict.fromkeys(found))

    def _leaks(self, outputs: list[torch.Tensor]) -> list[str]:
        """Paths from what a later stage does not compute to the step's outputs."""
        targets = [(f"the output of {name} (a layer before the blocks)", t) for name, t in self.before_outputs]
        targets += [
            (f"outputs of {self.block_names[i]} other than the hidden states it hands to the next block", cut)
            for i, cut in enumerate(self.cuts[:-1])
            if cut.requires_grad
        ]
        if not outputs or not targets:
            return []
        grads = torch.autograd.grad(
            outputs, [t for _, t in targets], [torch.ones_like(o) for o in outputs], allow_unused=True
        )
        return [
            f"the step uses {what} after the blocks (or hands it to a block besides its hidden states); a pipeline "
            "stage that does not run it cannot compute that: keep such values inside the blocks, or use pp=1"
            for (what, _), grad in zip(targets, grads)
            if grad is not None
        ]

    def _side(self, name: str, module: nn.Module) -> str:
        phases = self.calls.get(name, set())
        if AFTER in phases:
            return AFTER
        if BEFORE in phases:
            return BEFORE
        return self._registered_side(module)

    def _registered_side(self, module: nn.Module) -> str:
        container = self.structure.block_lists[0].container
        for m in self.structure.root.modules():
            if m is container:
                return AFTER
            if m is module:
                return BEFORE
        return AFTER

    def _sides(self) -> dict[str, str]:
        return {name: self._side(name, module) for name, module in self.holders.items()}

    def outside_layers(self) -> OutsideLayers:
        sides = self._sides()
        return OutsideLayers(
            before=tuple(n for n, s in sides.items() if s == BEFORE),
            after=tuple(n for n, s in sides.items() if s == AFTER),
            hidden_widths=tuple(self.widths),
        )


#: What a parameter tells without its values (properties of ``torch.Tensor`` and methods).
_METADATA_PROPERTIES = frozenset(
    getattr(torch.Tensor, name)
    for name in ("dtype", "shape", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_leaf", "itemsize")
)
_METADATA_METHODS = frozenset(
    {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.is_floating_point}
)


def _reads_metadata(func: Any) -> bool:
    return getattr(func, "__self__", None) in _METADATA_PROPERTIES or func in _METADATA_METHODS


class _DependsOn(torch.autograd.Function):
    """``value`` unchanged, marked as computed from ``source`` (its backward reaches ``source``, with zeros)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        ctx.source_shape, ctx.source_dtype = source.shape, source.dtype
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, torch.zeros(ctx.source_shape, dtype=ctx.source_dtype, device=grad.device)


# ---------------------------------------------------------------------------------------------- helpers
def _holders_containing_blocks(structure: ModelStructure, holders: dict[str, nn.Module]) -> list[str]:
    """Modules with parameters of their own that contain the blocks (the root, say): no stage could hold them."""
    containers = [bl.container for bl in structure.block_lists]
    problems = []
    for name, module in holders.items():
        if any(c is module or any(c is m for m in module.modules()) for c in containers):
            own = ", ".join(n for n, _ in module.named_parameters(recurse=False))
            label = name or type(module).__name__
            problems.append(
                f"{label} holds parameters itself ({own}) and contains the blocks; with pipeline parallelism every "
                "parameter outside the blocks must belong to a submodule that does not contain them (e.g. an "
                "nn.Embedding or an nn.Linear head)"
            )
    return problems


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _argument(key: int | str) -> str:
    return f"argument {key}" if isinstance(key, int) else f"{key}="


def _message(problems: list[str]) -> str:
    return "this model cannot run as a pipeline exactly:\n- " + "\n- ".join(problems)


@contextlib.contextmanager
def _untouched(module: nn.Module, train: bool) -> Iterator[None]:
    """Run the step as Lightning would (training or eval mode, every parameter differentiable so that uses
    show), then restore modes, ``requires_grad``, gradients, buffers and the random state."""
    modes = {m: m.training for m in module.modules()}
    flags = {p: (p.requires_grad, p.grad) for p in module.parameters()}
    buffers = {b: b.detach().clone() for b in module.buffers() if not b.is_meta}
    devices = list({t.device for t in buffers if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            module.train(train)
            for p in flags:
                p.requires_grad_(True)
            with torch.enable_grad():
                yield
        finally:
            for m, mode in modes.items():
                m.training = mode
            for p, (requires_grad, grad) in flags.items():
                p.requires_grad_(requires_grad)
                p.grad = grad
            with torch.no_grad():
                for b, value in buffers.items():
                    b.copy_(value)


@contextlib.contextmanager
def _recording_logs(module: nn.Module) -> Iterator[list[Any]]:
    """``self.log``/``self.log_dict`` record their values instead of logging (no Lightning loop runs)."""
    values: list[Any] = []
    module.log = lambda name, value, *args, **kwargs: values.append(value)  # type: ignore[method-assign]
    module.log_dict = lambda metrics, *args, **kwargs: values.extend(metrics.values())  # type: ignore[method-assign]
    try:
        yield values
    finally:
        del module.log, module.log_dict
