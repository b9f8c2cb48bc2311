"""Third-party model families at the benchmark's size: Hugging Face GPT-2, Llama and BERT, built from configs.

Nobody here wrote these models: GPT-2 ties its embedding and head (a weight used twice, its gradient complete only at
the very end of backward), Llama has untied weights, grouped-query attention and RMSNorm, BERT is a post-norm encoder
trained as a masked LM (its decoder tied to the word embeddings). Each is built at ``harness.BenchModel``'s sizes
(8 blocks, hidden 128, 8 heads, sequence 64, global batch 16, AdamW) with a vocabulary of 256, every other setting at
its default except dropout (0, so that runs compare like for like). Nothing is downloaded.

``FamilyModule`` is what a user would write for ``strategy="ddp"`` or ``strategy="galvatron"``; ``FSDP2Family`` adds
the hand-written ``configure_model`` Lightning's ``ModelParallelStrategy`` needs (``fully_shard`` on every block and
on the root, as Lightning's documentation does it), with ``reshard_after_forward`` chosen by the plan it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from harness import BenchModel
from torch import nn

FAMILIES = ("gpt2", "llama", "bert")
MASK_EVERY = 4  # BERT: every 4th input position is replaced by the mask token; the loss reads every position


@dataclass(frozen=True)
class FamilyModel(BenchModel):
    """``BenchModel``'s sizes for one Hugging Face family (the fields the harness reads: batch, sequence, blocks)."""

    family: str = "gpt2"
    vocab_size: int = 256

    def describe(self) -> str:
        return f"HF {self.family}: " + super().describe()


def build_hf(model: FamilyModel) -> nn.Module:
    import transformers

    h, n, heads, seq, vocab = model.n_embd, model.n_layer, model.n_head, model.seq_length, model.vocab_size
    if model.family == "gpt2":  # tie_word_embeddings defaults to True
        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=seq, n_embd=h, n_layer=n, n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if model.family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=heads // 2, max_position_embeddings=seq, tie_word_embeddings=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if model.family == "bert":
        config = transformers.BertConfig(
            vocab_size=vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, intermediate_size=4 * h,
            max_position_embeddings=seq, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return transformers.BertForMaskedLM(config)
    raise ValueError(model.family)


def hf_blocks(hf: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a model :func:`build_hf` made (for the FSDP2 baseline's ``configure_model``)."""
    for path in ("transformer.h", "model.layers", "bert.encoder.layer"):
        try:
            return hf.get_submodule(path)
        except AttributeError:
            continue
    raise ValueError(f"no known block list in {type(hf).__name__}")


class FamilyModule(L.LightningModule):
    """A Hugging Face model trained on ``harness.make_loader``'s ``(inputs, targets)`` token batches: next-token
    prediction for the causal LMs; for BERT, the inputs with every ``MASK_EVERY``-th position masked, predicted back."""

    def __init__(self, model: FamilyModel) -> None:
        super().__init__()
        self.spec = model
        self.model = build_hf(model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        if self.spec.family == "bert":
            targets = inputs
            masked = torch.arange(inputs.shape[1], device=inputs.device) % MASK_EVERY == 1
            inputs = inputs.masked_fill(masked, self.spec.vocab_size - 1)
        logits = self.model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.spec.learning_rate)


class FSDP2Family(FamilyModule):
    """For Lightning's ``ModelParallelStrategy``: FSDP2 on every block and on the root."""

    def __init__(self, model: FamilyModel, reshard_after_forward: bool = True) -> None:
        super().__init__(model)
        self.reshard_after_forward = reshard_after_forward

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in hf_blocks(self.model):
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)


def make_family_module(model: FamilyModel, fsdp2: bool = False, reshard_after_forward: bool = True) -> FamilyModule:
    """The module for ``model``, seeded: every configuration starts from the same weights."""
    torch.manual_seed(1234)
    return FSDP2Family(model, reshard_after_forward) if fsdp2 else FamilyModule(model)
