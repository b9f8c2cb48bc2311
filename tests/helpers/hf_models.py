"""Hugging Face models built from small configs (nothing is downloaded), as LightningModules.

Every setting not about size is the model's default (the KV cache included), except dropout: 0 for parity.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F


class HFCausalLM(L.LightningModule):
    """A ``transformers`` causal LM trained with the same next-token loss as the example GPT."""

    def __init__(
        self,
        family: str = "gpt2",
        vocab_size: int = 16,
        seq_length: int = 8,
        hidden: int = 32,
        layers: int = 4,
        heads: int = 4,
        learning_rate: float = 1e-2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        if family == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=vocab_size,
                n_positions=seq_length,
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
            self.model = transformers.GPT2LMHeadModel(config)
        elif family == "llama":
            config = transformers.LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads // 2,
                max_position_embeddings=seq_length,
                tie_word_embeddings=False,
            )
            self.model = transformers.LlamaForCausalLM(config)
        else:
            raise ValueError(family)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.model(input_ids=inputs).logits
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        inputs, _ = batch
        return self.model(input_ids=inputs)  # a ModelOutput: logits and, at the defaults, a KV cache

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


def hf_gpt2() -> HFCausalLM:
    torch.manual_seed(1234)
    return HFCausalLM("gpt2")


def hf_llama() -> HFCausalLM:
    torch.manual_seed(1234)
    return HFCausalLM("llama")
