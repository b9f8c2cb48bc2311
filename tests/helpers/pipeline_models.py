"""Models whose layers outside the blocks are registered in another order than they run (pipeline tests).

``lm_head_first_gpt``: the layout of LitGPT (``self.lm_head`` registered before ``self.transformer =
nn.ModuleDict(wte, wpe, h, ln_f)``), built from the example GPT's blocks. ``litgpt_gpt``: LitGPT's own
``litgpt.GPT`` from a tiny ``litgpt.Config`` at its defaults. ``input_projection_encoder``: an
``nn.TransformerEncoder`` whose inputs enter through an ``nn.Linear`` (features, no token table). All train on
the parity tests' token batches, with fit, validate, test and predict steps, and AdamW with ``eps=1e-6`` (see
:mod:`tests.helpers.model_families`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import Block, GPTConfig
from tests.helpers.model_families import _encoder_layer, _Trainable

VOCAB, HIDDEN, HEADS, SEQ = 16, 32, 4, 8


class _TokenLM(_Trainable):
    """Next-token loss on ``(inputs, targets)``; ``self.net(inputs)`` returns logits."""

    net: nn.Module

    def loss(self, batch):
        inputs, targets = batch
        return F.cross_entropy(self.net(inputs).flatten(0, 1).float(), targets.flatten())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        inputs, _ = batch
        return self.net(inputs).float()


class HeadFirstGPT(nn.Module):
    """A GPT whose LM head is registered before its embedding and blocks (as in LitGPT)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        config = GPTConfig(vocab_size=VOCAB, seq_length=SEQ, n_layer=layers, n_head=HEADS, n_embd=HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, HIDDEN),
                wpe=nn.Embedding(SEQ, HIDDEN),
                h=nn.ModuleList(Block(config) for _ in range(layers)),
                ln_f=nn.LayerNorm(HIDDEN),
            )
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.transformer.wte(tokens) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class HeadFirstLM(_TokenLM):
    def __init__(self) -> None:
        super().__init__()
        self.net = HeadFirstGPT()


def lm_head_first_gpt() -> HeadFirstLM:
    torch.manual_seed(1234)
    return HeadFirstLM()


class LitGPTLM(_TokenLM):
    """``litgpt.GPT`` (LM head registered first, rotary positions, parallel residual) at its default config."""

    def __init__(self) -> None:
        super().__init__()
        from litgpt import Config
        from litgpt.model import GPT

        config = Config(
            block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=4, n_head=HEADS, n_embd=HIDDEN
        )
        self.net = GPT(config)
        self.net.apply(self.net._init_weights)


def litgpt_gpt() -> LitGPTLM:
    torch.manual_seed(1234)
    return LitGPTLM()


class InputProjectionEncoder(nn.Module):
    """Tokens as one-hot features through an ``nn.Linear``, as a model of continuous inputs: no ``nn.Embedding``."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs = nn.Linear(VOCAB, HIDDEN)
        self.encoder = nn.TransformerEncoder(_encoder_layer(), num_layers=4, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.inputs(F.one_hot(tokens, VOCAB).float())))


class InputProjectionLM(_TokenLM):
    def __init__(self) -> None:
        super().__init__()
        self.net = InputProjectionEncoder()


def input_projection_encoder() -> InputProjectionLM:
    torch.manual_seed(1234)
    return InputProjectionLM()
