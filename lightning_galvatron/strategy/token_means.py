"""Losses that are means over tokens, trained as DDP trains them.

Under DDP every rank's loss is a mean over its own batch, and the gradients are averaged over ranks: what
is trained is the mean over DDP ranks of each rank's loss. For a mean over samples that is the mean over
the global batch, however the samples are grouped. For a mean over tokens (``F.cross_entropy`` over labels
padded with ``-100``, what Hugging Face models compute on dynamically padded batches) it is the mean of
per-rank token means, and it depends on which samples share a rank.

A plan's data shard holds the samples of ``ddp_ranks = world size / data shards`` DDP ranks, and each of
its ``calls`` (micro-batches, or one step) computes one loss. With as many calls as DDP ranks, the shard's
batch is put in DDP-rank order so that each call holds exactly one DDP rank's samples: any loss then trains
as under DDP. Otherwise a call holds several DDP ranks' samples, or part of one, which trains the same for
means over samples only: a warning says so when the batch has ignored labels.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from lightning_galvatron.runtime.apply import AppliedPlan

IGNORE_INDEX = -100  # the default ignore_index of F.cross_entropy and of Hugging Face's losses


def ddp_ranks_per_shard(applied: AppliedPlan) -> int:
    """How many DDP ranks' samples one data shard of the plan reads per step."""
    return applied.plan.world_size // applied.input_shards


def arranged_for_token_means(batch: Any, applied: AppliedPlan, calls: int) -> Any:
    """The shard's batch laid out for ``calls`` losses that train as the losses of the DDP ranks whose samples it
    holds would (see the module's docstring); a warning where they cannot."""
    ddp_ranks = ddp_ranks_per_shard(applied)
    if calls == ddp_ranks:
        return in_ddp_rank_order(batch, ddp_ranks)
    warn_if_token_mean_differs(batch, ddp_ranks, calls, applied)
    return batch


def in_ddp_rank_order(batch: Any, ddp_ranks: int) -> Any:
    """The shard's batch with each DDP rank's samples together, in DDP's order.

    A ``DistributedSampler`` over ``d`` shards gives shard ``s`` the samples that DDP over ``d * ddp_ranks``
    ranks gives ranks ``s, s + d, ..., s + (ddp_ranks - 1) d``, interleaved: sample ``i`` of a batch is
    rank ``s + d * (i % ddp_ranks)``'s.
    """
    if ddp_ranks == 1:
        return batch
    size = _leading_size(batch)
    if size is None or size % ddp_ranks:
        return batch
    order = torch.arange(size).view(size // ddp_ranks, ddp_ranks).t().reshape(-1)

    def reorder(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[order.to(tensor.device)] if tensor.dim() and tensor.shape[0] == size else tensor

    return apply_to_collection(batch, torch.Tensor, reorder)


#: Per applied plan (by identity; a plan applied anew starts over), the batches still to look at for ignored labels:
#: the look reads labels back to the host, so only a plan's first few batches are looked at, and none after it warned.
_BATCHES_TO_CHECK: dict[int, tuple[weakref.ref, int]] = {}


def warn_if_token_mean_differs(batch: Any, ddp_ranks: int, calls: int, applied: AppliedPlan) -> None:
    """Warn once per plan when the step's calls do not hold one DDP rank's samples each and the batch has labels
    ``-100``, whose token mean would then differ from DDP's. Only the plan's first batches are looked at."""
    if calls == ddp_ranks:
        return
    seen, left = _BATCHES_TO_CHECK.get(id(applied), (None, 8))
    if seen is None or seen() is not applied:
        left = 8
    if left <= 0:
        return
    _BATCHES_TO_CHECK[id(applied)] = (weakref.ref(applied), left - 1)
    if not has_ignored_labels(batch):
        return
    _BATCHES_TO_CHECK[id(applied)] = (weakref.ref(applied), 0)
    held = (
        f"the samples of {ddp_ranks // calls} DDP ranks at once"
        if calls < ddp_ranks
        else f"1/{calls // ddp_ranks} of one DDP rank's samples"
    )
    rank_zero_warn(
        f"Galvatron: the batch has labels {IGNORE_INDEX} (ignored tokens), and this plan computes each loss on "
        f"{held}: a loss averaged over tokens then differs from DDP's (the mean over DDP ranks of each rank's token "
        f"mean); a mean over samples trains the same. For DDP's token means, give the plan micro_batches={ddp_ranks} "
        "(one DDP rank's samples per micro-batch), or use a plan with one data shard per device (pp=1, vocab tp=1)."
    )


def has_ignored_labels(batch: Any) -> bool:
    """Whether an integer tensor of the batch holds ``-100``: labels a loss averaged over tokens ignores."""
    return any(
        not tensor.is_floating_point() and tensor.dtype != torch.bool and bool((tensor == IGNORE_INDEX).any())
        for tensor in _tensors(batch)
    )


def _leading_size(batch: Any) -> int | None:
    return next((tensor.shape[0] for tensor in _tensors(batch) if tensor.dim()), None)


def _tensors(batch: Any) -> list[torch.Tensor]:
    """The batch's tensors, in any collection Lightning moves to the device (a Hugging Face ``BatchEncoding`` too)."""
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found
