"""Phase 1, capture: one run of the step records the inputs and output of the first block of each type.

Later blocks of a type are stood in for by the identity (:func:`_skipping`), so capturing runs one
block per type; the embedding/head phase skips every block the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_galvatron.model.call_state import hidden_states_of, without_kv_caches
from lightning_galvatron.profiler.model.setup import Step, _BlockType, _detach, _PrecisionConfig, _to_device


@dataclass
class _BlockCall:
    """One block call: its inputs and (as a template for skipping) its output."""

    args: tuple
    kwargs: dict
    output: Any = None

    @property
    def hidden(self) -> torch.Tensor:
        return hidden_states_of(self.args, self.kwargs)[1]


@dataclass
class _Captured:
    inputs: dict[int, _BlockCall]  # per first block of a type


def _with_hidden(template: Any, hidden: torch.Tensor) -> Any:
    """``template`` (a block's output) with its first tensor replaced by ``hidden``."""
    leaves, spec = tree_flatten(template)
    index = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    leaves[index] = hidden
    return tree_unflatten(leaves, spec)


def _skippable(call: _BlockCall) -> bool:
    """A block can be stood in for by the identity if it keeps the shape of the hidden states."""
    leaves, _ = tree_flatten(call.output)
    out = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    return out is not None and out.shape == call.hidden.shape and out.dtype == call.hidden.dtype


def _capture(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    types: Sequence[_BlockType],
    batch: Any,
    step: Step,
    prec: _PrecisionConfig,
    device: torch.device,
) -> _Captured:
    """Run the step once without gradients; record the inputs and output of the first block of each type."""
    firsts = {t.first for t in types}
    calls: dict[int, _BlockCall] = {}
    handles = []
    for i in firsts:

        def pre(mod: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            calls.setdefault(i, _BlockCall(*without_kv_caches(_detach(args), _detach(kwargs))))  # re-run later

        def post(mod: nn.Module, args: tuple, kwargs: dict, output: Any, i: int = i) -> None:
            if calls[i].output is None:
                calls[i].output = _detach(output)

        handles.append(blocks[i].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(blocks[i].register_forward_hook(post, with_kwargs=True))
    later = {i for t in types for i in t.members if i != t.first}
    try:
        with torch.no_grad(), prec.autocast(device), _skipping(blocks, calls, types, later):
            step(module, _to_device(batch, device, prec))
    finally:
        for h in handles:
            h.remove()
    missing = sorted(firsts - set(calls))
    if missing:
        raise ValueError(f"the training step never called block(s) {missing}; are the blocks those the model runs?")
    return _Captured(calls)


@contextlib.contextmanager
def _skipping(
    blocks: Sequence[nn.Module], calls: Mapping[int, _BlockCall], types: Sequence[_BlockType], which: set[int]
) -> Iterator[None]:
    """Blocks in ``which`` return their input in the structure of their type's output instead of running.

    The output template is looked up at call time (while capturing, the first block of a type has
    run by then); a block without one, or one that changes the shape of the hidden states, runs.
    """
    type_of = {i: t for t in types for i in t.members}

    def stand_in(i: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = calls.get(type_of[i].first)
            if call is None or call.output is None or not _skippable(call):
                return type(blocks[i]).forward(blocks[i], *args, **kwargs)
            return _with_hidden(call.output, hidden_states_of(args, kwargs)[1])

        return forward

    for i in which:
        blocks[i].forward = stand_in(i)
    try:
        yield
    finally:
        for i in which:
            del blocks[i].forward
