"""``torch.compile`` per block (``GalvatronStrategy(compile=...)``), under every kind of plan.

Each block's ``forward`` is compiled in place, after tensor/sequence parallelism and before recomputation
and data parallelism -- the order torchtitan uses. Why per block: the blocks repeat, so one graph serves
every block of the same layout; the layers outside them (embedding, loss) stay eager; and what the runtime
puts around a block (relocation between layouts, FSDP2's gathers, recomputation) stays outside the graph.
Why ``forward`` and not the module: ``torch.compile(block)`` wraps it (parameter names gain ``_orig_mod.``)
and ``block.compile()`` would trace the module's hooks too; parameter names never change.

Recomputation re-runs the compiled forward in backward and pairs the tensors it saves with the first
run's by position, so both runs must take the same compiled graph:

* shapes are static by default (``dynamic=False``). With automatic dynamic shapes the re-run can pick a
  dynamic graph compiled since (for another block or batch size) that saves the same tensors in another
  order -- silently wrong gradients (pytorch/pytorch#166926); plans that recompute refuse other settings
  (:func:`~lightning_galvatron.plan.rules.compile_problem`);
* in training a compiled block gets no KV cache (Hugging Face models pass one by default, even in
  training; the re-run cannot have one, see :mod:`lightning_galvatron.runtime.structure`). A training
  step's cache starts empty for the block, so it computes the same thing -- what Hugging Face's own
  gradient checkpointing does (``use_cache=False``). Without a cache the block's graph does not depend
  on the layer's index, so all blocks of a layout share one graph instead of one per layer.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_galvatron.runtime.structure import without_kv_caches

_COMPILE_ARGUMENTS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")


def compile_options(value: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments for ``compile=`` (``None``: do not compile), checked."""
    if value is None or value is False:
        return None
    if value is True:
        return {"dynamic": False}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        unknown = sorted(set(value) - set(_COMPILE_ARGUMENTS))
        if unknown:
            raise ValueError(
                f"compile: {unknown} are not arguments of torch.compile; it takes {list(_COMPILE_ARGUMENTS)}"
            )
        return {"dynamic": False, **value}
    raise ValueError(
        "compile must be True, False or a dict of torch.compile arguments such as {'mode': 'max-autotune'}, "
        f"got {value!r}"
    )


def apply_compile(block: nn.Module, options: Mapping[str, Any]) -> None:
    """Compile ``block.forward`` in place; in training it runs without a KV cache."""
    block.forward = torch.compile(block.forward, **options)
    block.register_forward_pre_hook(_no_kv_cache_in_training, with_kwargs=True)


def _no_kv_cache_in_training(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    return without_kv_caches(args, kwargs) if torch.is_grad_enabled() else None
