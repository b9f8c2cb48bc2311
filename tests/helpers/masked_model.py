"""A model whose blocks take an optional per-sample mask that only some ranks pass (like Hugging Face's
attention mask, dropped for batches without padding)."""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class MaskedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, 2 * width)
        self.down_proj = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.down_proj(F.gelu(self.up_proj(x)))
        return x + (y if mask is None else y * mask[..., None])


class SometimesMasked(L.LightningModule):
    def __init__(self, unmasked_from_step: int = 0) -> None:
        super().__init__()
        self.unmasked_from_step = unmasked_from_step  # odd ranks pass no mask from this step on
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(MaskedBlock(8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        x = self.embed(inputs)
        masked = dist.get_rank() % 2 == 0 or batch_idx < self.unmasked_from_step
        mask = torch.ones(inputs.shape, dtype=x.dtype) if masked else None
        for block in self.blocks:
            x = block(x, mask=mask)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def sometimes_masked() -> SometimesMasked:
    torch.manual_seed(0)
    return SometimesMasked()


def masked_on_every_rank_in_the_first_step() -> SometimesMasked:
    torch.manual_seed(0)
    return SometimesMasked(unmasked_from_step=1)


class MixerBlock(nn.Module):
    """A user's own block: no attention heads, names the inference does not know."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.expand = nn.Linear(width, 4 * width)
        self.contract = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.contract(F.gelu(self.expand(x)))


class MixerLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(MixerBlock(8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def mixer_lm_with_registered_plan() -> MixerLM:
    """The documented way to give a block type a tensor-parallel plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import lightning_galvatron

    lightning_galvatron.register_tensor_parallel_plan(
        MixerBlock,
        {"expand": ColwiseParallel(), "contract": RowwiseParallel()},
        divisible=lambda block: {"hidden width": block.expand.out_features},
    )
    torch.manual_seed(0)
    return MixerLM()
