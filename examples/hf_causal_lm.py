"""Fine-tune a Hugging Face causal language model with ``strategy="galvatron"``.

Run it (4 CPU processes, automatic plan)::

    python examples/hf_causal_lm.py fit --config configs/hf_causal_lm.yaml

The LightningModule is the one you would write for any Lightning project: the ``transformers`` model
and a next-token loss. Nothing in it knows about parallelism; the strategy finds the decoder layers
(``model.model.layers``), splits them as its plan says (tensor parallelism is known for Llama-style and
GPT-2 layers) and runs the loss in your ``training_step``.

``pretrained`` names a local directory saved with ``save_pretrained`` (or a hub id if you let
``transformers`` download); by default the model is built from ``config`` with fresh weights, so the
example needs no network. The data is the main example's generated arithmetic text (``examples/gpt.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import lightning_galvatron  # noqa: F401  (registers strategy="galvatron")
from examples.gpt import ALPHABET, ArithmeticDataModule

TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=len(ALPHABET) + 1,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


class CausalLMFineTune(L.LightningModule):
    """Next-token prediction with a ``transformers`` causal LM; logs ``train_loss`` and ``val_loss``."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        if pretrained:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
        else:
            fields = dict(config or TINY_LLAMA)
            self.model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**fields))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )


def main() -> None:
    torch.set_num_threads(1)  # several processes share this machine's cores
    LightningCLI(CausalLMFineTune, ArithmeticDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
