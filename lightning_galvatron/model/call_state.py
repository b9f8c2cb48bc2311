"""Per-call state that models hand to their blocks: key/value caches; where a call's hidden states are.

Hugging Face models create a KV cache object for every forward call at their default config
(``use_cache=True``, in training too) and pass it to each block (``past_key_values=``), which
appends its keys and values to it. The object belongs to one call of the model: a block run a
second time with it -- re-run by the profiler at other batch sizes, or recomputed in backward --
would append again and attend over twice the keys. Where blocks are re-run, the cache is replaced
by ``None``: on a cache that was empty for this block (a training step's), the block computes the
same thing without one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_galvatron.plan import PlanError


def is_kv_cache(value: Any) -> bool:
    """A key/value cache object (Hugging Face's ``Cache`` API: ``update`` and ``get_seq_length``)."""
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "update", None))
        and callable(getattr(value, "get_seq_length", None))
    )


def without_kv_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a block call with every KV cache replaced by ``None``."""
    return (
        tuple(None if is_kv_cache(a) else a for a in args),
        {k: None if is_kv_cache(v) else v for k, v in kwargs.items()},
    )


def hidden_states_of(args: tuple, kwargs: Mapping[str, Any]) -> tuple[int | str, torch.Tensor]:
    """Where a block's hidden states are among its inputs, and the tensor: the first positional tensor, else
    ``hidden_states=`` (the rule the runtime and the profiler use)."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i, a
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states", kwargs["hidden_states"]
    raise PlanError("a block was called without a hidden-states tensor (a first positional tensor or hidden_states=)")
