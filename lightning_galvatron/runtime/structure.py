"""What the runtime needs to know about a model: its blocks, the layers around them, how blocks are called.

The runtime never imports ``model/`` (dependencies run ``model/ -> runtime/``, as ``models/ ->
distributed/`` in torchtitan): the model side finds these (:func:`~lightning_galvatron.model.discovery.find_blocks`,
:func:`~lightning_galvatron.model.outside_layers.trace_outside_layers`) and the glue hands them to the
runtime. The types live here, with the conventions every part of the runtime follows for a block call:
where its hidden states are, what it returns, and which per-call state (key/value caches) must not be
replayed.

Key/value caches: Hugging Face models create a cache object for every forward call at their default
config (``use_cache=True``, in training too) and pass it to each block (``past_key_values=``), which
appends its keys and values to it. The object belongs to one call of the model: a block run a second
time with it -- re-run by the profiler at other batch sizes, or recomputed in backward -- would append
again and attend over twice the keys. Where blocks are re-run, the cache is replaced by ``None``: on a
cache that was empty for this block (a training step's), the block computes the same thing without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_galvatron.plan import PlanError

#: Block inputs that hold one entry per sequence position, and the dimension of the positions: under Ulysses
#: each rank keeps its positions' part, as of the hidden states (Hugging Face names: rotary ``(cos, sin)``,
#: position ids, cache positions).
HF_POSITION_INPUTS: Mapping[str | int, int] = {"position_embeddings": -2, "position_ids": -1, "cache_position": -1}


# ---------------------------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class BlockList:
    """One container of same-class blocks and where it sits in the model."""

    path: str
    container: nn.ModuleList | nn.Sequential

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.container.children())

    @property
    def block_type(self) -> str:
        return model_class(self.blocks[0]).__name__


@dataclass(frozen=True)
class ModelStructure:
    """The blocks of a model in execution order, across one or more block lists."""

    root: nn.Module
    block_lists: tuple[BlockList, ...]

    @property
    def blocks(self) -> list[nn.Module]:
        return [block for block_list in self.block_lists for block in block_list.blocks]

    @property
    def block_names(self) -> list[str]:
        return [f"{bl.path}.{i}" for bl in self.block_lists for i in range(len(bl.blocks))]

    @property
    def num_blocks(self) -> int:
        return sum(len(bl.blocks) for bl in self.block_lists)

    def block_parameter_ids(self) -> set[int]:
        return {id(p) for block in self.blocks for p in block.parameters()}

    def vocab_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Named parameters outside every block: embeddings, final norm, head."""
        in_blocks = self.block_parameter_ids()
        return [(name, p) for name, p in self.root.named_parameters() if id(p) not in in_blocks]


def model_class(module: nn.Module) -> type[nn.Module]:
    """The user's class of a module, looking through the classes FSDP2 inserts when it shards one."""
    user_class = next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))
    return cast("type[nn.Module]", user_class)  # the first class that is not FSDP2's is the module's own


# -------------------------------------------------------------------------------------------- layers outside the blocks
@dataclass(frozen=True)
class OutsideLayers:
    """Modules holding parameters outside the blocks (names relative to the root), by where the step runs them.

    Modules the traced step never called keep the side of the blocks they are registered on.
    """

    before: tuple[str, ...]
    after: tuple[str, ...]
    #: The width (last dimension) of the hidden states each block returns, as traced: what a pipeline stage sends
    #: on (it may differ from the token embedding's, as ELECTRA's projected embeddings do); empty if not traced.
    hidden_widths: tuple[int, ...] = ()


def hidden_states_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int | str, torch.Tensor]:
    """Where a block's hidden states are among its inputs, and the tensor: the first positional tensor, else
    ``hidden_states=`` (the rule every part of the runtime uses)."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i, a
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states", kwargs["hidden_states"]
    raise PlanError("a block was called without a hidden-states tensor (a first positional tensor or hidden_states=)")


def with_hidden_states(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], hidden: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A block call's inputs with ``hidden`` in place of its hidden states (found by :func:`hidden_states_of`)."""
    where, _ = hidden_states_of(args, kwargs)
    if isinstance(where, int):
        return (*args[:where], hidden, *args[where + 1 :]), dict(kwargs)
    return tuple(args), {**kwargs, where: hidden}


def block_output_hidden(output: Any) -> torch.Tensor:
    """The hidden states a block returns: the output itself, or the first element of a tuple/list."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise PlanError(
        f"a block returned {type(output).__name__}; expected the hidden states (or a tuple starting with them)"
    )


def parameter_holders(structure: ModelStructure) -> dict[str, nn.Module]:
    """Modules outside the blocks that hold parameters themselves, by name (registration order)."""
    in_blocks = {id(m) for block in structure.blocks for m in block.modules()}
    return {
        name: module
        for name, module in structure.root.named_modules()
        if id(module) not in in_blocks and any(True for _ in module.parameters(recurse=False))
    }


# ---------------------------------------------------------------------------------------------- per-call state
def is_kv_cache(value: Any) -> bool:
    """A key/value cache object (Hugging Face's ``Cache`` API: ``update`` and ``get_seq_length``)."""
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "update", None))
        and callable(getattr(value, "get_seq_length", None))
    )


def without_kv_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` of a block call with every KV cache replaced by ``None``."""
    return (
        tuple(None if is_kv_cache(a) else a for a in args),
        {k: None if is_kv_cache(v) else v for k, v in kwargs.items()},
    )
