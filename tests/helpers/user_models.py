"""Models as users write them from scratch (issue 43), trained on the parity tests' token batches.

None of their blocks has a registered tensor-parallel plan: the plan is inferred from the layer names and proven on
the block (:mod:`lightning_galvatron.model.tensor_parallel_proof`).

- :func:`nano_gpt`: nanoGPT's layout -- a ``transformer`` ``ModuleDict`` of ``wte``, ``wpe``, ``h``, ``ln_f``, the
  head tied to ``wte`` -- with its attention's fused ``c_attn`` ``[q | k | v]`` ``nn.Linear``, ``c_proj``, an MLP of
  ``c_fc``/``c_proj``, and nanoGPT's attention code verbatim: ``self.n_head`` and ``self.n_embd`` (divided by the
  degree) and the width ``C`` read from the input (which receives this rank's part of its width).
- :func:`min_gpt`: minGPT's -- eager attention under a causal mask buffer, an MLP that is a ``ModuleDict`` (never
  called: its layers are, by the block), a GELU module.
- :func:`llama_scratch`: Meta's Llama written again -- RMSNorm, grouped-query attention ``wq``/``wk``/``wv``/``wo``
  reading ``self.n_local_heads``/``self.n_local_kv_heads``, complex rotary tables passed to every layer, SwiGLU
  ``w1``/``w2``/``w3``. Its blocks take more than their hidden states, so the proof runs on a real call's inputs.
- :func:`hidden_heads`: a block whose attention reshapes with a head count kept in an attribute no rule knows
  (``self.groups``): split, it would run without error and compute heads of half the width; the proof catches it.
- :func:`albert`, :func:`funnel`, :func:`swin`: Hugging Face models of structures the family matrix lacks (a layer
  shared by every position of the stack, a list of lists with the sequence pooled between them, stages that merge
  patches).
- :func:`widening` (blocks that widen the residual stream), :func:`carried_gate` and :func:`carried_depth` (loops
  carrying a tensor, or a count, from block to block), :func:`unlisted_blocks` (blocks in no list),
  :func:`conditioned` (blocks reading per-sample state their model sets on them: the profiler cannot run them alone).

Factories are module-level (the worker pool pickles them) and seed the initialisation; dropout is 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.model_families import HEADS, HIDDEN, VOCAB, FamilyLM, _hf, _Trainable

SEQ = 8


# ---------------------------------------------------------------------------------------------- nanoGPT
class NanoAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.n_head, self.n_embd = HEADS, HIDDEN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(HIDDEN), NanoAttention()
        self.ln_2, self.mlp = nn.LayerNorm(HIDDEN), NanoMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(_Trainable):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, HIDDEN),
                wpe=nn.Embedding(SEQ, HIDDEN),
                h=nn.ModuleList(NanoBlock() for _ in range(4)),
                ln_f=nn.LayerNorm(HIDDEN),
            )
        )
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

    def logits(self, batch):
        inputs, _ = batch
        x = self.transformer.wte(inputs) + self.transformer.wpe(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nano_gpt() -> NanoGPT:
    torch.manual_seed(1234)
    return NanoGPT()


# ---------------------------------------------------------------------------------------------- minGPT
class NewGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MinAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))
        self.n_head, self.n_embd = HEADS, HIDDEN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MinBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(HIDDEN), MinAttention(), nn.LayerNorm(HIDDEN)
        self.mlp = nn.ModuleDict(
            dict(c_fc=nn.Linear(HIDDEN, 4 * HIDDEN), c_proj=nn.Linear(4 * HIDDEN, HIDDEN), act=NewGELU())
        )

    def mlpf(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp  # minGPT keeps this in a lambda; a method survives the profiler's deep copies
        return m.c_proj(m.act(m.c_fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class MinGPT(_Trainable):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, HIDDEN),
                wpe=nn.Embedding(SEQ, HIDDEN),
                h=nn.ModuleList(MinBlock() for _ in range(4)),
                ln_f=nn.LayerNorm(HIDDEN),
            )
        )
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def logits(self, batch):
        inputs, _ = batch
        x = self.transformer.wte(inputs) + self.transformer.wpe(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def min_gpt() -> MinGPT:
    torch.manual_seed(1234)
    return MinGPT()


# ---------------------------------------------------------------------------------------------- Llama from scratch
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    return torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs))


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, n_heads: int = HEADS, n_kv_heads: int = 2) -> None:
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads = n_heads, n_kv_heads
        self.n_rep, self.head_dim = n_heads // n_kv_heads, HIDDEN // n_heads
        self.wq = nn.Linear(HIDDEN, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(HIDDEN, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(HIDDEN, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, freqs_cis), apply_rotary_emb(xk, freqs_cis)
        keys, values = (t.repeat_interleave(self.n_rep, dim=2) for t in (xk, xv))
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int = 2 * HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, hidden, bias=False)
        self.w2 = nn.Linear(hidden, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = LlamaAttention(), FeedForward()
        self.attention_norm, self.ffn_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaScratch(_Trainable):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(4))
        self.norm = RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(HIDDEN // HEADS, 2 * SEQ), persistent=False)

    def logits(self, batch):
        inputs, _ = batch
        h = self.tok_embeddings(inputs)
        freqs_cis = self.freqs_cis[: inputs.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def llama_scratch() -> LlamaScratch:
    torch.manual_seed(1234)
    return LlamaScratch()


# ---------------------------------------------------------------------------------------------- a hidden head count
class HiddenHeadsAttention(NanoAttention):
    """Says ``n_head`` but reshapes with ``self.groups``, which no rule divides."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = HEADS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = (t.view(B, T, self.groups, -1).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class HiddenHeadsBlock(NanoBlock):
    def __init__(self) -> None:
        super().__init__()
        self.attn = HiddenHeadsAttention()


class HiddenHeadsGPT(NanoGPT):
    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList(HiddenHeadsBlock() for _ in range(4))


def hidden_heads() -> HiddenHeadsGPT:
    torch.manual_seed(1234)
    return HiddenHeadsGPT()


# ---------------------------------------------------------------------------------------------- other structures
class _Structured(FamilyLM):
    """A Hugging Face model built here (not one of the family matrix's), trained as :class:`FamilyLM` trains it."""

    def __init__(self, kind: str, architecture: str, config: str, **settings) -> None:
        _Trainable.__init__(self)
        self.family = architecture
        self.kind, self.model = _hf(kind, architecture, config, **settings)()


def albert() -> _Structured:
    """ALBERT: one layer group applied to every position of the stack (4 times) with the same weights."""
    torch.manual_seed(1234)
    return _Structured(
        "masked",
        "AlbertForMaskedLM",
        "AlbertConfig",
        embedding_size=16,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def funnel() -> _Structured:
    """Funnel Transformer: its encoder's blocks are lists of layers (a list of lists), the sequence pooled between
    them; the decoder upsamples back."""
    torch.manual_seed(1234)
    return _Structured(
        "masked",
        "FunnelForMaskedLM",
        "FunnelConfig",
        block_sizes=[1, 1],
        num_decoder_layers=1,
        d_model=HIDDEN,
        n_head=HEADS,
        d_head=HIDDEN // HEADS,
        d_inner=2 * HIDDEN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )


def swin() -> _Structured:
    """Swin: two stages of one block each, the first merging patches (4x fewer tokens, twice the width)."""
    torch.manual_seed(1234)
    return _Structured(
        "vision",
        "SwinForImageClassification",
        "SwinConfig",
        image_size=8,
        patch_size=1,
        num_channels=1,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )


# ---------------------------------------------------------------------------------------------- hand-written loops
class WideningBlock(nn.Module):
    """A pre-norm block whose residual stream widens at its end (``widen``: a stage boundary, as Swin's patch merging
    widens, here without fewer positions)."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = NanoAttention(), NanoMLP()
        if width != HIDDEN:
            self.attn.c_attn, self.attn.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.attn.n_embd = width
            self.mlp.c_fc, self.mlp.c_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.widen = nn.Linear(width, out) if out != width else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return self.widen(x + self.mlp(self.norm_2(x)))


class WideningLM(_Trainable):
    """Four blocks of widths 32, 32 -> 48, 48, 48."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.positions = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        widths = (HIDDEN, HIDDEN, 48, 48, 48)
        self.blocks = nn.ModuleList(WideningBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(48, VOCAB)

    def logits(self, batch):
        inputs, _ = batch
        x = self.embedding(inputs) + self.positions(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def widening() -> WideningLM:
    torch.manual_seed(1234)
    return WideningLM()


class GatedBlock(NanoBlock):
    """A block that also takes and returns a gate: the loop carries it from block to block."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + gate * self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x, torch.sigmoid(x.mean(-1, keepdim=True))


class CarriedGateLM(NanoGPT):
    """Its loop carries a gate tensor besides the hidden states, of the same shape at every block."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList(GatedBlock() for _ in range(4))

    def logits(self, batch):
        inputs, _ = batch
        x = self.transformer.wte(inputs) + self.transformer.wpe(torch.arange(inputs.shape[1], device=inputs.device))
        gate = torch.ones_like(x[..., :1])
        for block in self.transformer.h:
            x, gate = block(x, gate)
        return self.lm_head(self.transformer.ln_f(x))


def carried_gate() -> CarriedGateLM:
    torch.manual_seed(1234)
    return CarriedGateLM()


class DepthScaledBlock(NanoBlock):
    """A block scaling its residual branches by its depth, which the loop counts and hands on (a Python int)."""

    def forward(self, x: torch.Tensor, depth: int) -> tuple[torch.Tensor, int]:
        x = x + self.attn(self.ln_1(x)) / math.sqrt(depth + 1)
        return x + self.mlp(self.ln_2(x)) / math.sqrt(depth + 1), depth + 1


class CarriedDepthLM(NanoGPT):
    """Its loop carries a count besides the hidden states (as Swin's carries its stages' sizes): a pipeline stage
    would restart it at 0 and train something else without an error."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList(DepthScaledBlock() for _ in range(4))

    def logits(self, batch):
        inputs, _ = batch
        x = self.transformer.wte(inputs) + self.transformer.wpe(torch.arange(inputs.shape[1], device=inputs.device))
        depth = 0
        for block in self.transformer.h:
            x, depth = block(x, depth)
        return self.lm_head(self.transformer.ln_f(x))


def carried_depth() -> CarriedDepthLM:
    torch.manual_seed(1234)
    return CarriedDepthLM()


class UnlistedBlocksLM(NanoGPT):
    """Its blocks are attributes of their own (``first``, ``second``), in no list: nothing tells the strategy where
    they are, so ``plan="auto"`` trains the whole model as one unit."""

    def __init__(self) -> None:
        super().__init__()
        del self.transformer.h
        self.first, self.second = NanoBlock(), NanoBlock()

    def logits(self, batch):
        inputs, _ = batch
        x = self.transformer.wte(inputs) + self.transformer.wpe(torch.arange(inputs.shape[1], device=inputs.device))
        return self.lm_head(self.transformer.ln_f(self.second(self.first(x))))


def unlisted_blocks() -> UnlistedBlocksLM:
    torch.manual_seed(1234)
    return UnlistedBlocksLM()


class ConditionedBlock(NanoBlock):
    """Scales its input by a per-sample factor its model hands it through an attribute before the loop (``scale``,
    one per sample), as conditioned models hand on a per-sample embedding."""

    scale: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.scale.view(x.shape[0], 1, 1))


class ConditionedLM(NanoGPT):
    """Its blocks read per-sample state from an attribute the model sets on them: the profiler, which runs a block
    alone on other batch sizes than the step's, fails where DDP trains it."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer.h = nn.ModuleList(ConditionedBlock() for _ in range(4))

    def logits(self, batch):
        inputs, _ = batch
        scale = 1 + (inputs[:, 0] % 3).float() / 10
        x = self.transformer.wte(inputs) + self.transformer.wpe(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.transformer.h:
            block.scale = scale
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def conditioned() -> ConditionedLM:
    torch.manual_seed(1234)
    return ConditionedLM()
