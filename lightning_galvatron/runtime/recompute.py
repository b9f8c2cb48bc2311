"""Activation recomputation per block.

``torch.distributed._composable.checkpoint`` is used rather than ``checkpoint_wrapper`` because it
hooks the module in place: parameter names (FQNs) stay unchanged, so checkpoints load across plans
and into the plain model.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def apply_recompute(block: nn.Module) -> None:
    """Keep only the block's inputs in forward; recompute its activations during backward."""
    checkpoint(block)


def is_recomputing(block: nn.Module) -> bool:
    """Whether ``block`` is being re-run during backward (its checkpoint hooks are switched off then)."""
    state = checkpoint.state(block)
    return state is not None and not state.enable_hook
