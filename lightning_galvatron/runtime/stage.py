"""Pipeline stages: which blocks and layers a rank keeps, and how the user's step is cut at them.

The plan cuts the blocks into ``pp * virtual_stages`` chunks; chunk ``c`` runs on pipeline stage
``c % pp`` (:func:`~lightning_galvatron.plan.layout.rank_chunks`). Each rank keeps only its chunks' blocks
(the others are removed from their container *by key*, so the remaining parameter names do not
change), the layers before the blocks only on the first stage and those after only on the last.

While the user's step runs for a chunk, iterating over a block container yields only that chunk's
blocks (the gate): the first of them receives the activation sent by the previous stage instead of its
input (what the layers before it computed is discarded; on later stages those layers are
parameter-free stand-ins that return zeros of the shape and dtype the real layer would, and refuse to
run once the blocks have started); after the last of them the step is cut short (:class:`Boundary`)
and the activation is handed to the runner (:mod:`lightning_galvatron.runtime.pipeline`).

Which layers outside the blocks run before them and which after is observed on the step itself, once,
before training (:class:`~lightning_galvatron.runtime.structure.OutsideLayers`, traced by the model
side). Weights shared between the two sides (a tied embedding and head) live on both end stages.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.plan.layout import rank_chunks
from lightning_galvatron.runtime.structure import (
    ModelStructure,
    OutsideLayers,
    block_output_hidden,
    parameter_holders,
    with_hidden_states,
)


class Boundary(Exception):
    """Raised after the last block of a non-final chunk to stop the step and hand over the activation."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class PipelineUsageError(RuntimeError):
    pass


@dataclass
class Chunk:
    index: int
    blocks: range  # global block indices
    final: bool
    received: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------- stand-ins
class _AbsentAttribute(PipelineUsageError, AttributeError):
    """An attribute of a layer or block that lives on another pipeline stage (an ``AttributeError``, so that
    ``hasattr`` still answers ``False``)."""


class _StandIn(nn.Module):
    """A parameter-free module in the place of a layer that lives on another stage (``home``).

    Its attributes are those of a copy of the layer on the meta device, which holds no memory: what a step reads of
    the layer without running it (ViT reads its patch projection's ``weight.dtype`` before the blocks) reads as the
    real layer's, and computing with it fails (it is on the meta device). Anything else is refused.
    """

    def __init__(self, original: nn.Module, name: str, stage: int, home: str) -> None:
        super().__init__()
        self._name, self._stage, self._home = name, stage, home
        meta = {id(t): _on_meta(t) for t in (*original.parameters(), *original.buffers())}
        self._meta = [copy.deepcopy(original, meta)]  # a list: not registered (no parameters, no state)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            own = self.__dict__
            if "_meta" in own and hasattr(own["_meta"][0], name):
                return getattr(own["_meta"][0], name)
            raise _AbsentAttribute(
                f"{own.get('_name')} lives on the {own.get('_home')} pipeline stage only; {name!r} was read on stage "
                f"{own.get('_stage')}"
            ) from None


class _FirstStageOnly(_StandIn):
    """Stand-in for a layer before the blocks, on stages that discard its output.

    It returns zeros of the shape and dtype the real layer would return (computed by its copy on the meta
    device), and refuses to run after the blocks started: there its output would be used.
    """

    def __init__(self, original: nn.Module, name: str, stage: int, gate: _Gate) -> None:
        super().__init__(original, name, stage, "first")
        self._gate = gate

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        chunk = self._gate.chunk
        if chunk is None or self._gate.blocks_started:
            raise PipelineUsageError(
                f"{self._name} runs before the Transformer blocks (as traced on the step before training), so with "
                f"pipeline parallelism it lives on the first stage only; on stage {self._stage} it was called "
                + (
                    "outside the Lightning steps"
                    if chunk is None
                    else "after the blocks (does this step use it differently from the traced one?)"
                )
            )
        device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        shapes = self._meta[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tree_map(zeros, shapes)


class _LastStageOnly(_StandIn):
    """Stand-in for a layer after the blocks on stages that never reach it."""

    def __init__(self, original: nn.Module, name: str, stage: int) -> None:
        super().__init__(original, name, stage, "last")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineUsageError(
            f"{self._name} runs after the Transformer blocks (as traced on the step before training), so with pipeline "
            f"parallelism it lives on the last stage only; it was called on stage {self._stage} (does this step use "
            "it before the blocks?)"
        )


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _outermost(names: Sequence[str]) -> list[str]:
    """Names not inside another of ``names`` (replacing a module replaces its submodules)."""
    return [n for n in names if not any(n.startswith(f"{other}.") for other in names if other != n)]


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


# ----------------------------------------------------------------------------------------- the gate
class _BlockCall:
    """What the user's loop calls instead of a block while a chunk runs."""

    def __init__(
        self, gate: _Gate, block: nn.Module, receive: torch.Tensor | None, hand_over: torch.dtype | None
    ) -> None:
        self.gate, self.block, self.receive, self.hand_over = gate, block, receive, hand_over

    def __getattr__(self, name: str) -> Any:
        # The loop may read the block's configuration (Qwen2: ``decoder_layer.attention_type``).
        return getattr(self.block, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.gate.blocks_started = True
        if self.receive is not None:
            args, kwargs = with_hidden_states(args, kwargs, self.receive)
        out = self.block(*args, **kwargs)
        if self.hand_over is not None:
            raise Boundary(block_output_hidden(out).to(self.hand_over))
        return out


class _Gate:
    """While a chunk runs, block containers yield that chunk's blocks (as :class:`_BlockCall`)."""

    def __init__(self, index_of: dict[int, int], boundary_dtype: torch.dtype) -> None:
        self.index_of = index_of  # id(block) -> global block index
        self.boundary_dtype = boundary_dtype
        self.chunk: Chunk | None = None
        self.blocks_started = False  # whether the running chunk's first block was called

    def calls(self, blocks: Sequence[nn.Module]) -> list[_BlockCall]:
        chunk = self.chunk
        if chunk is None:
            raise PipelineUsageError(
                "with pipeline parallelism the model runs only inside the Lightning steps (training, validation, "
                "test, predict), where the strategy drives the pipeline schedule"
            )
        chosen = [b for b in blocks if self.index_of.get(id(b), -1) in chunk.blocks]
        first, last = chunk.blocks[0], chunk.blocks[-1]
        return [
            _BlockCall(
                self,
                b,
                receive=chunk.received if self.index_of[id(b)] == first else None,
                hand_over=self.boundary_dtype if self.index_of[id(b)] == last and not chunk.final else None,
            )
            for b in chosen
        ]


class _AbsentBlock:
    """A block of another stage, looked up by index: its configuration reads like a local block's.

    Only configuration: its tensors and methods are refused (they would be another block's), and its
    submodules read the same way.
    """

    def __init__(self, representative: nn.Module, key: str, path: str = "") -> None:
        self._representative, self._key, self._path = representative, key, path

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._representative, name)
        path = f"{self._path}.{name}" if self._path else name
        if isinstance(value, nn.Module):
            return _AbsentBlock(value, self._key, path)
        if isinstance(value, torch.Tensor) or inspect.ismethod(value):
            raise _AbsentAttribute(
                f"block {self._key} lives on another pipeline stage; its {path!r} is not on this one (its "
                "configuration can be read, its tensors and methods cannot)"
            )
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineUsageError(
            f"block {self._key} lives on another pipeline stage; with pipeline parallelism blocks must be called "
            "by iterating over their list (for block in self.layers: ...), not by index"
        )


class _GatedContainer(Protocol):
    """What the gated methods read of a block container."""

    _modules: dict[str, nn.Module]
    galvatron_length: int  # its length before other stages' blocks were removed


def _gated_class(cls: type, gate: _Gate) -> type:
    def __iter__(self: _GatedContainer) -> Iterator[_BlockCall]:
        return iter(gate.calls(list(self._modules.values())))

    def __getitem__(self: _GatedContainer, index: int | slice) -> nn.Module | _AbsentBlock | list[_BlockCall]:
        if isinstance(index, slice):
            return gate.calls(list(self._modules.values())[index])
        key = str(index % self.galvatron_length)  # keys are the global positions
        if key in self._modules:
            return self._modules[key]
        return _AbsentBlock(next(iter(self._modules.values())), key)  # e.g. nn.TransformerEncoder reads layers[0]

    return type(f"Pipelined{cls.__name__}", (cls,), {"__iter__": __iter__, "__getitem__": __getitem__})


# ----------------------------------------------------------------------------------------- the stage
class StagePartition:
    """This rank's share of the model: its chunks, and what was removed or stood in for.

    ``outside`` says which layers outside the blocks run before them and which after (see
    :func:`~lightning_galvatron.model.outside_layers.trace_outside_layers`).

    Activations cross stages in ``boundary_dtype`` (fixed, so that every stage knows the shapes and
    dtypes it will receive before the first micro-batch runs).
    """

    def __init__(
        self,
        structure: ModelStructure,
        plan: ParallelPlan,
        rank: int,
        boundary_dtype: torch.dtype,
        outside: OutsideLayers,
    ) -> None:
        if structure.num_blocks != plan.num_layers:
            raise PlanError(
                f"the plan has {plan.num_layers} layer strategies but the model has {structure.num_blocks} blocks"
            )
        self.plan = plan
        self.stage = rank // plan.devices_per_stage
        last = plan.pp * plan.virtual_stages - 1
        self.chunks = [
            Chunk(c, plan.chunk_layers(c), final=c == last)
            for c in rank_chunks(self.stage, plan.pp, plan.virtual_stages)
        ]
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.pp - 1
        self.local_blocks = [i for chunk in self.chunks for i in chunk.blocks]

        holders = parameter_holders(structure)
        before = [(name, holders[name]) for name in outside.before]
        after = [(name, holders[name]) for name in outside.after]
        before_params = {id(p) for _, m in before for p in m.parameters()}
        # Where this stage holds each weight shared by the first and last stage: (module, attribute).
        after_params = {id(p) for _, m in after for p in m.parameters()}
        self._has_tied = bool(before_params & after_params)  # known on every stage: the group is collective
        holders_here = before if self.is_first else after if self.is_last else []
        self._tied_slots = [
            (m, name)
            for _, m in holders_here
            for name, p in m.named_parameters(recurse=False)
            if id(p) in before_params and id(p) in after_params
        ]
        # The layers outside the blocks that this stage runs, grouped for data parallelism by the caller.
        # (the outermost ones: a module holding parameters may sit inside another, BERT's ``cls.predictions``)
        here = [*(outside.before if self.is_first else ()), *(outside.after if self.is_last else ())]
        self.vocabulary_modules = [holders[name] for name in _outermost(here)]

        # Remove the blocks of other stages, by key so that the remaining names do not change.
        local = set(self.local_blocks)
        index_of: dict[int, int] = {}
        index = 0
        for block_list in structure.block_lists:
            # (before blocks are removed; Module.__setattr__ is typed for tensors and modules only)
            block_list.container.galvatron_length = len(block_list.container)  # type: ignore[assignment]
            for key, block in list(block_list.container._modules.items()):
                if index in local:
                    index_of[id(block)] = index
                else:
                    del block_list.container._modules[key]
                index += 1
        self.gate = _Gate(index_of, boundary_dtype)
        self.boundary_dtype = boundary_dtype
        for block_list in structure.block_lists:
            container = block_list.container
            container.__class__ = _gated_class(type(container), self.gate)
        if not self.is_first:
            for name in _outermost(outside.before):
                _replace(structure.root, name, _FirstStageOnly(holders[name], name, self.stage, self.gate))
        if not self.is_last:
            for name in _outermost(outside.after):
                _replace(structure.root, name, _LastStageOnly(holders[name], name, self.stage))

    @property
    def has_tied_weights(self) -> bool:
        return self._has_tied

    @property
    def tied(self) -> list[nn.Parameter]:
        """This stage's copies of weights shared by the first and last stage (as they are now: sharding
        replaces parameter objects)."""
        return [getattr(module, name) for module, name in self._tied_slots]

    @contextmanager
    def running(self, chunk: Chunk, received: torch.Tensor | None) -> Iterator[None]:
        chunk.received = received
        self.gate.chunk = chunk
        self.gate.blocks_started = False
        try:
            yield
        finally:
            self.gate.chunk = None
            chunk.received = None
