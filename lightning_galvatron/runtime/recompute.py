"""Activation recomputation per block.

``torch.distributed._composable.checkpoint`` is used rather than ``checkpoint_wrapper`` because it
hooks the module in place: parameter names (FQNs) stay unchanged, so checkpoints load across plans
and into the plain model.

The recomputation calls the block again with the arguments of its forward. A KV cache among them
(Hugging Face models pass one at their defaults) would already hold what the forward appended, and
the checkpoint would keep it -- with the keys and values it holds, their autograd graph and, through
it, the checkpoint itself: a cycle that outlives the step and pins the parameters. So while
gradients are recorded a recomputed block gets ``None`` instead (see
:mod:`lightning_galvatron.runtime.structure`), as Hugging Face's own gradient checkpointing switches
the cache off; without gradients (evaluation) nothing is recomputed and the cache is passed on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint

from lightning_galvatron.runtime.structure import without_kv_caches


def apply_recompute(block: nn.Module) -> None:
    """Keep only the block's inputs in forward; recompute its activations during backward."""
    checkpoint(block)
    # Before the checkpoint's own hook, which keeps the arguments for the recomputation.
    block.register_forward_pre_hook(_no_kv_cache_with_gradients, with_kwargs=True, prepend=True)


def is_recomputing(block: nn.Module) -> bool:
    """Whether ``block`` is being re-run during backward (its checkpoint hooks are switched off then)."""
    state = checkpoint.state(block)
    return state is not None and not state.enable_hook


def _no_kv_cache_with_gradients(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    return without_kv_caches(args, kwargs) if torch.is_grad_enabled() else None
