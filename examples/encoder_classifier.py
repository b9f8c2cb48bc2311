"""A BERT-style encoder classifier with torchmetrics accuracy: the same script under DDP and under Galvatron.

Before (DDP) and after (Galvatron) differ by one line of YAML, ``strategy: ddp`` -> ``strategy: galvatron``::

    python examples/encoder_classifier.py fit --config configs/encoder_classifier_ddp.yaml
    python examples/encoder_classifier.py fit --config configs/encoder_classifier_galvatron.yaml

Both train on the same samples per step and log the same loss curve (dropout is off in the configs so
that the curves can be compared number for number). The task is generated, nothing is downloaded: is
there a majority of "1" tokens in a sequence of "0"s and "1"s?

Logging metrics: ``self.log("train_acc", self.train_acc(preds, labels), sync_dist=True)`` logs the
tensor that a torchmetrics metric returns for the batch, averaged over the ranks; logging the
``Metric`` object itself (``self.log("val_acc", self.val_acc)``) works too, under every plan, with
DDP's values (see docs/runtime.md).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import lightning_galvatron  # noqa: F401  (registers strategy="galvatron"; harmless under DDP)

CLS, ZERO, ONE = 1, 2, 3  # token ids; 0 is padding (unused: every sequence has the full length)


class MajorityDataset(Dataset):
    """``[CLS] x_1 ... x_n`` with each ``x`` a "0" or "1" token; the label says whether "1"s are the majority."""

    def __init__(self, num_samples: int, seq_length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        bits = torch.randint(0, 2, (num_samples, seq_length - 1), generator=generator)
        self.labels = (bits.sum(1) * 2 > bits.shape[1]).long()
        cls = torch.full((num_samples, 1), CLS)
        self.tokens = torch.cat([cls, bits + ZERO], dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index], self.labels[index]


class MajorityDataModule(L.LightningDataModule):
    def __init__(
        self, batch_size: int = 8, seq_length: int = 16, train_samples: int = 2048, val_samples: int = 256
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp = self.hparams
        self.train_set = MajorityDataset(hp.train_samples, hp.seq_length, seed=0)
        self.val_set = MajorityDataset(hp.val_samples, hp.seq_length, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class EncoderClassifier(L.LightningModule):
    """``transformers.BertForSequenceClassification`` from a config; logs loss and accuracy."""

    def __init__(self, config: dict[str, Any] | None = None, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        fields = {"model_type": "bert", "vocab_size": 4, "num_labels": 2, **(config or {})}
        bert_config = transformers.AutoConfig.for_model(**fields)
        bert_config._attn_implementation = "sdpa"
        self.model = transformers.AutoModelForSequenceClassification.from_config(bert_config)
        self.train_acc = torchmetrics.classification.BinaryAccuracy()
        self.val_acc = torchmetrics.classification.BinaryAccuracy()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.float(), labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", self.train_acc(logits.argmax(-1), labels), prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, labels = batch
        logits = self(tokens)
        self.log("val_loss", F.cross_entropy(logits.float(), labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc(logits.argmax(-1), labels), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


def main() -> None:
    torch.set_num_threads(1)  # several processes share this machine's cores
    LightningCLI(EncoderClassifier, MajorityDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
