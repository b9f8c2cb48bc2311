"""Whether a pipeline stage can restart the model's loop over its blocks at the stage's first block.

On a pipeline stage the model's loop over its block list yields only the stage's blocks
(:mod:`lightning_galvatron.runtime.stage`): the first receives the hidden states the previous stage sent, and
everything else the loop hands it is what the loop computes when no block before it ran. That is exact where the
loop carries nothing from block to block but the hidden states. Swin's loop also carries the spatial size of each
stage's output (``input_dimensions``, taken from the previous stage's output): a later stage would restart it from
the embedding's, and crash or, where the shapes happen to fit, compute with wrong values. Nor can a stage send
hidden states whose positions change between blocks (patch merging, pooling): a stage declares one shape for what it
sends.

:func:`loop_state_problem` checks both on the step itself, before training: it runs the step once on one sample
(recording what every block receives besides its hidden states, and the shapes it receives and returns), then once
per block ``k > 0`` with the loop started at block ``k`` (the blocks before it taken out of the list, as a stage
does), stopped when block ``k`` is called, and compares what block ``k`` received.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_galvatron.runtime.structure import (
    ModelStructure,
    block_output_hidden,
    hidden_states_of,
    without_kv_caches,
)

__all__ = ["loop_state_problem"]


class _Stop(BaseException):
    """The block looked at was called: the rest of the step does not matter."""


def loop_state_problem(structure: ModelStructure, run_step: Callable[[], Any]) -> str | None:
    """Why a pipeline cannot restart the model's loop over its blocks at a stage's first block, or ``None``.

    ``run_step()`` runs the step on one sample without gradients and leaves the model as it was (it is called
    ``num_blocks`` times; an exception raised in a block's hook must pass through it). One block list only
    (pipelines over several are refused elsewhere)."""
    if len(structure.block_lists) != 1 or structure.num_blocks < 2:
        return None
    container = structure.block_lists[0].container
    blocks = structure.blocks
    received: dict[int, Any] = {}  # block -> what it received besides its hidden states
    restarted: dict[int, Any] = {}  # the same, with the loop started at that block
    shapes: dict[int, tuple[torch.Size, torch.Size]] = {}

    def record(index: int, stop: bool = False) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            (restarted if stop else received).setdefault(index, _besides_hidden(args, kwargs))
            if stop:
                raise _Stop

        return hook

    def returned(index: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            hidden, out = hidden_states_of(args, kwargs)[1], block_output_hidden(output)
            shapes.setdefault(index, (hidden.shape, out.shape))

        return hook

    handles = [b.register_forward_pre_hook(record(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(returned(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        run_step()
    except Exception:  # noqa: BLE001 - the step's own errors are the tracer's to report
        return None
    finally:
        for handle in handles:
            handle.remove()
    name = type(structure.root).__name__
    for index, (into, out) in sorted(shapes.items()):
        if into[:-1] != out[:-1]:
            return (
                f"pipeline parallelism cannot run {name}: block {index} receives hidden states of shape "
                f"{tuple(into)} and returns {tuple(out)}, and a pipeline stage sends one shape of hidden states "
                "(only their width may change between blocks); use pp=1"
            )
    for k in range(1, len(blocks)):
        if k not in received:
            continue
        saved = dict(container._modules)
        handle = blocks[k].register_forward_pre_hook(record(k, stop=True), with_kwargs=True)
        try:
            for key in list(saved)[:k]:
                del container._modules[key]
            run_step()
        except _Stop:
            pass
        except Exception:  # noqa: BLE001 - a loop that cannot start there: the stage's own checks report it
            continue
        finally:
            handle.remove()
            container._modules.clear()
            container._modules.update(saved)
        if k not in restarted:
            continue
        difference = _difference(received[k], restarted[k])
        if difference is not None:
            return (
                f"pipeline parallelism cannot run {name}: its loop over {structure.block_lists[0].path} hands block "
                f"{k} {difference} (as a pipeline stage restarts it): the loop carries state from block to block "
                "besides the hidden states, and only the hidden states travel between stages; use pp=1"
            )
    return None


def _besides_hidden(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block call's inputs with its hidden states blanked out and copies of its tensors (key/value caches as
    ``None``)."""
    args, kwargs = without_kv_caches(args, kwargs)
    where, _ = hidden_states_of(args, kwargs)
    if isinstance(where, int):
        args = (*args[:where], None, *args[where + 1 :])
    else:
        kwargs = {**kwargs, where: None}
    copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return tree_map(copy, args), tree_map(copy, kwargs)


def _difference(real: tuple[tuple, dict], restarted: tuple[tuple, dict]) -> str | None:
    """The first input (``name=value``) that differs between two calls' inputs, or ``None``."""
    (args, kwargs), (args2, kwargs2) = real, restarted
    if len(args) != len(args2):
        return f"{len(args)} positional arguments, but {len(args2)} when restarted there"
    named = [(f"argument {i} = ", a, b) for i, (a, b) in enumerate(zip(args, args2))]
    named += [(f"{key}=", kwargs.get(key), kwargs2.get(key)) for key in dict.fromkeys([*kwargs, *kwargs2])]
    for label, a, b in named:
        if not _same(a, b):
            other = _short(b)
            return f"{label}{_short(a)}, but {'other values' if other == _short(a) else other} when restarted there"
    return None


def _same(a: Any, b: Any) -> bool:
    leaves, spec = tree_flatten(a)
    leaves2, spec2 = tree_flatten(b)
    if spec != spec2:
        return False
    for x, y in zip(leaves, leaves2):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if _has_values(x) and _has_values(y) and not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _has_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values can be read: not the dry run's fake tensors, nor meta ones (shapes only)."""
    return type(tensor) is torch.Tensor and tensor.device.type != "meta"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
