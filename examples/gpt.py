"""A small GPT trained with ``strategy="galvatron"``: the main example.

Run it (4 CPU processes, plan from ``configs/``)::

    python examples/gpt.py fit --config configs/gpt_tiny_cpu.yaml

The model is a plain decoder-only Transformer you can read in one sitting; nothing in it knows
about parallelism. The data is generated, so nothing is downloaded: short sentences of a tiny
arithmetic language ("12+7=19;") that a small model learns quickly, so the loss visibly falls.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import lightning_galvatron  # noqa: F401  (registers strategy="galvatron")


# ---------------------------------------------------------------------------------------------- model
@dataclass
class GPTConfig:
    vocab_size: int = 32
    seq_length: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2 has them, Llama does not)
    tie_weights: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of n_head: with tensor parallelism each rank holds a slice of the heads.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))

    @property
    def head_dim(self) -> int:
        return self.q_proj.in_features // self.n_head


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.down_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.seq_length, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections by depth
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPTModule(L.LightningModule):
    """Next-token prediction with AdamW; logs ``train_loss`` and ``val_loss``."""

    def __init__(
        self,
        vocab_size: int = 32,
        seq_length: int = 32,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab_size, seq_length, n_layer, n_head, n_embd, dropout, bias, tie_weights))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        return self(inputs).argmax(-1)  # the most likely next character at every position

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )


# ---------------------------------------------------------------------------------------------- data
ALPHABET = "0123456789+-=; "


class ArithmeticText(Dataset):
    """Fixed-length windows of generated text like ``"12+7=19;3-5=-2;"`` (character tokens).

    Deterministic for a seed, so every process and every run sees the same corpus.
    """

    def __init__(self, num_samples: int, seq_length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        chars: list[str] = []
        target_len = num_samples * seq_length + 1
        while len(chars) < target_len:
            a, b = torch.randint(0, 50, (2,), generator=generator).tolist()
            op = "+" if torch.rand((), generator=generator) < 0.5 else "-"
            chars.extend(f"{a}{op}{b}={a + b if op == '+' else a - b};")
        ids = torch.tensor([ALPHABET.index(c) for c in chars[:target_len]])
        self.inputs = ids[:-1].view(num_samples, seq_length)
        self.targets = ids[1:].view(num_samples, seq_length)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


class ArithmeticDataModule(L.LightningDataModule):
    def __init__(
        self, batch_size: int = 4, seq_length: int = 32, train_samples: int = 512, val_samples: int = 64
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp = self.hparams
        self.train_set = ArithmeticText(hp.train_samples, hp.seq_length, seed=0)
        self.val_set = ArithmeticText(hp.val_samples, hp.seq_length, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


def main() -> None:
    torch.set_num_threads(1)  # several processes share this machine's cores
    LightningCLI(GPTModule, ArithmeticDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
