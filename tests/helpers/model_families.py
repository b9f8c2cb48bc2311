"""One small LightningModule per supported model family, trained on the parity tests' token batches.

Every model takes the ``(inputs, targets)`` batches of :class:`examples.gpt.ArithmeticText` (``SEQ``
tokens from a vocabulary of 16), so the shared parity harness (:mod:`tests.helpers.training`) runs
them unchanged; what each one predicts is derived from those tokens. Factories are module-level
functions (the worker pool pickles them) that seed the initialisation, so every run starts from the
same weights. Dropout is 0: parity compares against one process exactly.

AdamW runs with ``eps=1e-6``: gradients that are zero in exact arithmetic (the key bias of
``nn.MultiheadAttention``: softmax ignores a constant added to every logit of a query) are rounding
noise of ~1e-10 that differs between one process and four; with the default ``eps=1e-8`` Adam turns
that noise into steps of ~2% of the learning rate in random directions. Real gradients (> 1e-4 here)
are stepped the same with either ``eps``.
"""

from __future__ import annotations

import functools

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import ALPHABET

VOCAB, HIDDEN, HEADS, FFN = 16, 32, 4, 64
SEMICOLON = ALPHABET.index(";")


class _Trainable(L.LightningModule):
    def __init__(self, learning_rate: float = 1e-2) -> None:
        super().__init__()
        self.learning_rate = learning_rate

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        """The inputs (to align predictions across data shards) and the model's logits for them."""
        inputs, _ = batch
        return inputs, self.logits(batch).float()

    def loss(self, batch):
        _, targets = batch
        logits = self.logits(batch)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate, eps=1e-6)


# ---------------------------------------------------------------------------------------------- Hugging Face BERT
def padding_mask(inputs: torch.Tensor) -> torch.Tensor:
    """1 = attend, 0 = padding: the last position of every sample, and the one before it where the first
    token is even. Every sample has padding: Hugging Face drops the mask of a batch without any (see the
    README's known limits), and ranks must agree on which inputs their blocks receive."""
    mask = torch.ones_like(inputs)
    mask[:, -1] = 0
    mask[:, -2] = (inputs[:, 0] % 2 != 0).long()
    return mask


class BertClassifier(_Trainable):
    """``transformers.BertForSequenceClassification`` (post-norm encoder, padding mask): is the last target odd?"""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=4,
            num_attention_heads=HEADS,
            intermediate_size=FFN,
            max_position_embeddings=8,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=2,
        )
        config._attn_implementation = "sdpa"
        self.model = transformers.BertForSequenceClassification(config)

    def loss(self, batch):
        inputs, targets = batch
        logits = self.model(input_ids=inputs, attention_mask=padding_mask(inputs)).logits
        return F.cross_entropy(logits.float(), targets[:, -1] % 2)


def hf_bert() -> BertClassifier:
    torch.manual_seed(1234)
    return BertClassifier()


# ---------------------------------------------------------------------------------------------- torch.nn Transformers
def _encoder_layer() -> nn.TransformerEncoderLayer:
    # GELU rather than the default ReLU: at ReLU's kink a pre-activation rounded differently in another
    # process flips a gate, and that token's whole gradient contribution with it.
    return nn.TransformerEncoderLayer(
        HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )


class TorchEncoderLM(_Trainable):
    """``nn.TransformerEncoder`` with a causal mask as a next-token model (its layers use ``nn.MultiheadAttention``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(8, HIDDEN)
        self.encoder = nn.TransformerEncoder(_encoder_layer(), num_layers=4, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def logits(self, batch):
        inputs, _ = batch
        seq = inputs.shape[1]
        x = self.embedding(inputs) + self.positions(torch.arange(seq, device=inputs.device))
        causal = nn.Transformer.generate_square_subsequent_mask(seq, device=inputs.device)
        x = self.encoder(x, mask=causal, is_causal=True)
        return self.head(self.norm(x))


def torch_encoder() -> TorchEncoderLM:
    torch.manual_seed(1234)
    return TorchEncoderLM()


class TorchSeq2Seq(_Trainable):
    """Encoder-decoder from ``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` (two block lists):
    the encoder reads the inputs (with a key padding mask), the decoder predicts the targets from the
    targets shifted by one (causal self-attention, cross-attention to the encoder's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(8, HIDDEN)
        self.encoder = nn.TransformerEncoder(_encoder_layer(), num_layers=2, enable_nested_tensor=False)
        decoder_layer = nn.TransformerDecoderLayer(
            HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.decoder = nn.TransformerDecoder(decoder_layer, num_layers=2)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))

    def loss(self, batch):
        inputs, targets = batch
        seq = targets.shape[1]
        padding = inputs == SEMICOLON  # True = ignore this key (at most a few per sample)
        memory = self.encoder(self.embed(inputs), src_key_padding_mask=padding)
        shifted = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], dim=1)
        causal = nn.Transformer.generate_square_subsequent_mask(seq, device=inputs.device)
        x = self.decoder(
            self.embed(shifted), memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=padding
        )
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def torch_seq2seq() -> TorchSeq2Seq:
    torch.manual_seed(1234)
    return TorchSeq2Seq()


# ---------------------------------------------------------------------------------------------- any list of blocks
class MixerBlock(nn.Module):
    """A block no tensor-parallel plan knows (unrecognised layer names, a depthwise convolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.token_mixer = nn.Conv1d(HIDDEN, HIDDEN, kernel_size=3, padding=2, groups=HIDDEN)
        self.channel_in = nn.Linear(HIDDEN, FFN)
        self.channel_out = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.token_mixer(self.norm(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)  # causal
        x = x + mixed
        return x + self.channel_out(F.gelu(self.channel_in(x)))


class PlainBlocksLM(_Trainable):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(MixerBlock() for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def loss(self, batch):
        inputs, targets = batch
        x = self.embedding(inputs)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), targets.flatten())


def plain_blocks() -> PlainBlocksLM:
    torch.manual_seed(1234)
    return PlainBlocksLM()


class LiteralHeadsAttention(nn.Module):
    """Causal attention that reshapes with a literal head count: the names of its layers infer a tensor-parallel
    plan, which passes the static checks and fails only when a split block runs."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class LiteralHeadsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = LiteralHeadsAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class LiteralHeadsLM(PlainBlocksLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LiteralHeadsBlock() for _ in range(4))


def literal_heads() -> LiteralHeadsLM:
    torch.manual_seed(1234)
    return LiteralHeadsLM()


# ---------------------------------------------------------------------------------------------- the family matrix
class FamilyLM(_Trainable):
    """A model of one family built from a small config at its defaults (only dropout off), trained on the token
    batches: causal LMs predict the targets from the inputs, BERT fills them in (with a padding mask), encoder-
    decoders translate the inputs into the targets (the decoder reads the targets shifted by one)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        self.kind, self.model = FAMILY_MODELS[family]()

    def logits(self, batch):
        inputs, targets = batch
        if self.kind == "vision":
            config = getattr(self.model.config, "vision_config", self.model.config)
            return self.model(pixel_values=pixels(inputs, config)).logits
        if self.kind == "causal":
            return self.model(input_ids=inputs).logits
        if self.kind == "litgpt":
            return self.model(inputs)
        if self.kind == "masked":
            return self.model(input_ids=inputs, attention_mask=padding_mask(inputs)).logits
        shifted = torch.cat([torch.zeros_like(targets[:, :1]), targets[:, :-1]], dim=1)
        if self.kind == "audio":
            return self.model(input_features=frames(inputs, self.model.config), decoder_input_ids=shifted).logits
        return self.model(input_ids=inputs, decoder_input_ids=shifted).logits

    def loss(self, batch):
        if self.kind != "vision":
            return super().loss(batch)
        _, targets = batch
        return F.cross_entropy(self.logits(batch).float(), targets[:, 0])  # the image's class: its first target


def pixels(inputs: torch.Tensor, config) -> torch.Tensor:
    """Images for a vision transformer from token batches: each token a patch of fixed random pixels, the tokens
    repeated as often as ``config.image_size`` holds patches, row by row."""
    size = config.image_size
    height, width = size if isinstance(size, (tuple, list)) else (size, size)
    patch, channels = config.patch_size, config.num_channels
    rows, columns = height // patch, width // patch
    table = torch.randn(VOCAB, channels, patch, patch, generator=torch.Generator().manual_seed(0))
    tokens = inputs.repeat(1, -(-rows * columns // inputs.shape[1]))[:, : rows * columns]
    grid = table.to(inputs.device)[tokens].view(inputs.shape[0], rows, columns, channels, patch, patch)
    return grid.permute(0, 3, 1, 4, 2, 5).reshape(inputs.shape[0], channels, height, width)


def frames(inputs: torch.Tensor, config) -> torch.Tensor:
    """Audio features for a speech model (Whisper) from token batches: each token two frames of fixed random
    features, ``[batch, mel bins, frames]``."""
    table = torch.randn(VOCAB, config.num_mel_bins, generator=torch.Generator().manual_seed(0))
    return table.to(inputs.device)[inputs].repeat_interleave(2, dim=1).transpose(1, 2)


def _hf(kind: str, architecture: str, config: str, **settings):
    import transformers

    def build():
        sizes = {"num_labels": VOCAB} if kind == "vision" else {"vocab_size": VOCAB}
        return kind, getattr(transformers, architecture)(getattr(transformers, config)(**sizes, **settings))

    return build


def _litgpt(**settings):
    from litgpt import GPT, Config

    config = Config(
        name="tiny-llama",
        block_size=8,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=4,
        n_head=HEADS,
        n_query_groups=2,
        n_embd=HIDDEN,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=FFN,
        **settings,
    )
    return "litgpt", GPT(config)


_SIZES = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=8)
_ROTARY = dict(_SIZES, num_hidden_layers=4, intermediate_size=FFN)
_VISION = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=4, intermediate_size=FFN, patch_size=2)
#: family -> factory of (kind, model): small configs, every setting at its default except the sizes and dropout.
FAMILY_MODELS = {
    # decoder-only, learned positions, fused q/k/v (Conv1D), sequential residual
    "gpt2": _hf(
        "causal",
        "GPT2LMHeadModel",
        "GPT2Config",
        n_embd=HIDDEN,
        n_layer=4,
        n_head=HEADS,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    # rotary (partial), fused q/k/v per head, parallel residual
    "gpt_neox": _hf(
        "causal", "GPTNeoXForCausalLM", "GPTNeoXConfig", **_ROTARY, hidden_dropout=0.0, attention_dropout=0.0
    ),
    # rotary, grouped-query attention (2 key/value heads), gated MLP
    "llama": _hf("causal", "LlamaForCausalLM", "LlamaConfig", **_ROTARY, num_key_value_heads=2),
    "qwen2": _hf("causal", "Qwen2ForCausalLM", "Qwen2Config", **_ROTARY, num_key_value_heads=2),
    "mistral": _hf("causal", "MistralForCausalLM", "MistralConfig", **_ROTARY, num_key_value_heads=2),
    # multi-query attention with separate projections (as Gemma-2B)
    "gemma": _hf(
        "causal", "GemmaForCausalLM", "GemmaConfig", **_ROTARY, num_key_value_heads=1, head_dim=HIDDEN // HEADS
    ),
    # learned positions, separate q/k/v, fc1/fc2 on the layer
    "opt": _hf(
        "causal",
        "OPTForCausalLM",
        "OPTConfig",
        **_SIZES,
        num_hidden_layers=4,
        ffn_dim=FFN,
        word_embed_proj_dim=HIDDEN,
        dropout=0.0,
        attention_dropout=0.0,
    ),
    # multi-query attention fused [q | k | v], rotary, parallel attention and MLP
    "falcon": _hf(
        "causal",
        "FalconForCausalLM",
        "FalconConfig",
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_hidden_layers=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    # ALiBi, fused q/k/v per head (eager attention)
    "bloom": _hf(
        "causal",
        "BloomForCausalLM",
        "BloomConfig",
        hidden_size=HIDDEN,
        n_head=HEADS,
        n_layer=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    # rotary inside the attention (eager), parallel residual
    "gptj": _hf(
        "causal",
        "GPTJForCausalLM",
        "GPTJConfig",
        n_embd=HIDDEN,
        n_head=2 * HEADS,  # its attention groups the heads in 4 partitions: 8 heads split over 2 ranks
        n_layer=4,
        n_positions=8,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    # partial rotary, parallel residual, dense output projection
    "phi": _hf(
        "causal", "PhiForCausalLM", "PhiConfig", **_ROTARY, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0
    ),
    # multi-query attention fused [q | k | v], learned positions
    "gpt_bigcode": _hf(
        "causal",
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        n_embd=HIDDEN,
        n_head=2 * HEADS,  # its attention groups the heads in 4 partitions: 8 heads split over 2 ranks
        n_layer=4,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    # encoder-only (post-norm, padding mask)
    "bert": _hf(
        "masked",
        "BertForMaskedLM",
        "BertConfig",
        **_SIZES,
        num_hidden_layers=4,
        intermediate_size=FFN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    # encoder-decoder with a relative position bias per head (eager attention)
    "t5": _hf(
        "seq2seq",
        "T5ForConditionalGeneration",
        "T5Config",
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=FFN,
        num_layers=2,
        num_heads=HEADS,
        dropout_rate=0.0,
    ),
    # encoder-decoder, post-norm, learned positions
    "bart": _hf(
        "seq2seq",
        "BartForConditionalGeneration",
        "BartConfig",
        d_model=HIDDEN,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=8,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    ),
    # LitGPT's GPT: fused [q | k | v] with grouped queries, RMSNorm, LLaMA MLP
    "litgpt": _litgpt,
    # and with a norm over each head's queries and keys (norm_qk), or over all heads at once (OLMo-2's)
    "litgpt_norm_qk": functools.partial(_litgpt, norm_qk=True),
    "litgpt_norm_qk_olmo2": functools.partial(_litgpt, norm_qk=True, norm_qk_type="olmo2"),
    # Defaults but for the sizes, dropout where it is on, a pad id inside the 16-token vocabulary (Phi-3, SmolLM3,
    # GLM), RoBERTa's positions (they start after its padding index: 8 tokens need 10), CodeGen's rotary width
    # (its default is wider than a head) and ELECTRA's embedding width (narrower than its blocks, as by default).
    # Qwen3 and Gemma-3 normalise each head's queries and keys, OLMo-2 all heads' at once.
    "qwen3": _hf(
        "causal", "Qwen3ForCausalLM", "Qwen3Config", **_ROTARY, num_key_value_heads=2, head_dim=HIDDEN // HEADS
    ),
    "gemma2": _hf(
        "causal", "Gemma2ForCausalLM", "Gemma2Config", **_ROTARY, num_key_value_heads=2, head_dim=HIDDEN // HEADS
    ),
    "gemma3": _hf(
        "causal", "Gemma3ForCausalLM", "Gemma3TextConfig", **_ROTARY, num_key_value_heads=2, head_dim=HIDDEN // HEADS
    ),
    "phi3": _hf(
        "causal",
        "Phi3ForCausalLM",
        "Phi3Config",
        **_ROTARY,
        num_key_value_heads=2,
        original_max_position_embeddings=8,
        pad_token_id=0,
    ),
    "olmo2": _hf("causal", "Olmo2ForCausalLM", "Olmo2Config", **_ROTARY, num_key_value_heads=2),
    "starcoder2": _hf("causal", "Starcoder2ForCausalLM", "Starcoder2Config", **_ROTARY, num_key_value_heads=2),
    "stablelm": _hf("causal", "StableLmForCausalLM", "StableLmConfig", **_ROTARY, num_key_value_heads=2),
    "granite": _hf("causal", "GraniteForCausalLM", "GraniteConfig", **_ROTARY, num_key_value_heads=2),
    "cohere": _hf("causal", "CohereForCausalLM", "CohereConfig", **_ROTARY, num_key_value_heads=2),
    "mixtral": _hf("causal", "MixtralForCausalLM", "MixtralConfig", **_ROTARY, num_key_value_heads=2),
    # GPT-OSS: attention sinks (one learned logit per head), alternating sliding and full attention, experts
    "gpt_oss": _hf(
        "causal",
        "GptOssForCausalLM",
        "GptOssConfig",
        **_ROTARY,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": _hf(
        "causal",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        **_ROTARY,
        num_key_value_heads=2,
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=FFN,
    ),
    # OLMoE: experts, and a norm over all heads' queries and keys at once
    "olmoe": _hf(
        "causal",
        "OlmoeForCausalLM",
        "OlmoeConfig",
        **_ROTARY,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        eos_token_id=1,
    ),
    # Whisper: audio frames through two convolutions (pre-norm encoder-decoder), 16 frames -> 8 positions
    "whisper": _hf(
        "audio",
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        d_model=HIDDEN,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        num_mel_bins=4,
        max_source_positions=8,
        max_target_positions=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    ),
    # GPT-Neo: global and local (sliding-window) attention layers reading self.num_heads
    "gpt_neo": _hf(
        "causal",
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        hidden_size=HIDDEN,
        num_layers=4,
        num_heads=HEADS,
        attention_types=[[["global", "local"], 2]],
        max_position_embeddings=8,
        intermediate_size=FFN,
        window_size=4,
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
        bos_token_id=1,
        eos_token_id=1,
    ),
    # RoBERTa's positions start after padding_idx (1): 8 tokens need 10 position embeddings
    "roberta": _hf(
        "masked",
        "RobertaForMaskedLM",
        "RobertaConfig",
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        max_position_embeddings=10,
        num_hidden_layers=4,
        intermediate_size=FFN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "distilbert": _hf(
        "masked",
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        dim=HIDDEN,
        n_heads=HEADS,
        n_layers=4,
        hidden_dim=FFN,
        max_position_embeddings=8,
        dropout=0.0,
        attention_dropout=0.0,
    ),
    "electra": _hf(
        "masked",
        "ElectraForMaskedLM",
        "ElectraConfig",
        **_SIZES,
        embedding_size=HIDDEN // 2,
        num_hidden_layers=4,
        intermediate_size=FFN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "mpt": _hf(
        "causal",
        "MptForCausalLM",
        "MptConfig",
        d_model=HIDDEN,
        n_heads=HEADS,
        n_layers=4,
        expansion_ratio=FFN // HIDDEN,
        max_seq_len=8,
    ),
    "codegen": _hf(
        "causal",
        "CodeGenForCausalLM",
        "CodeGenConfig",
        n_embd=HIDDEN,
        n_head=2 * HEADS,  # its attention groups the heads in 4 partitions: 8 heads split over 2 ranks
        n_layer=4,
        n_positions=8,
        n_ctx=8,
        n_inner=FFN,
        rotary_dim=4,
    ),
    "smollm3": _hf("causal", "SmolLM3ForCausalLM", "SmolLM3Config", **_ROTARY, num_key_value_heads=2, pad_token_id=0),
    "glm": _hf(
        "causal",
        "GlmForCausalLM",
        "GlmConfig",
        **_ROTARY,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        pad_token_id=0,
    ),
    # Vision transformers: patches through a convolution (no token table), a class token (and DeiT's distillation
    # token) before them: 7 (6) patches of 2 x 2 pixels make sequences of 8.
    "vit": _hf(
        "vision",
        "ViTForImageClassification",
        "ViTConfig",
        **_VISION,
        image_size=(2, 14),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "deit": _hf(
        "vision",
        "DeiTForImageClassification",
        "DeiTConfig",
        **_VISION,
        image_size=(2, 12),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    "glm4": _hf(
        "causal",
        "Glm4ForCausalLM",
        "Glm4Config",
        **_ROTARY,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        pad_token_id=0,
    ),
    "olmo": _hf("causal", "OlmoForCausalLM", "OlmoConfig", **_ROTARY, num_key_value_heads=2),
    "mt5": _hf(
        "seq2seq",
        "MT5ForConditionalGeneration",
        "MT5Config",
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=FFN,
        num_layers=2,
        num_heads=HEADS,
        dropout_rate=0.0,
    ),
    "mbart": _hf(
        "seq2seq",
        "MBartForConditionalGeneration",
        "MBartConfig",
        d_model=HIDDEN,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=8,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    ),
    "helium": _hf(
        "causal", "HeliumForCausalLM", "HeliumConfig", **_ROTARY, num_key_value_heads=2, head_dim=HIDDEN // HEADS
    ),
}


def family(name: str):
    """A factory (picklable for the worker pool) of the family's LightningModule, seeded."""
    return functools.partial(_family, name)


def _family(name: str) -> L.LightningModule:
    torch.manual_seed(1234)
    if name == "torch_encoder":
        return TorchEncoderLM()
    return FamilyLM(name)


# ---------------------------------------------------------------------------------------------- per-sample positions
class PerSamplePositionsLM(FamilyLM):
    """Llama given position ids that differ per sample (as packed or left-padded batches do): its rotary tables
    reach every block as a ``(cos, sin)`` tuple of ``[batch, seq, head_dim]`` tensors, which must move with their
    samples between blocks of different layouts."""

    def logits(self, batch):
        inputs, _ = batch
        # Positions 1, 2 or 3 apart, from the sample itself (rotary attention sees only distances: an offset alone
        # would change nothing).
        stride = 1 + inputs.sum(dim=1, keepdim=True) % 3
        positions = torch.arange(inputs.shape[1], device=inputs.device) * stride
        return self.model(input_ids=inputs, position_ids=positions).logits


def per_sample_positions() -> PerSamplePositionsLM:
    torch.manual_seed(1234)
    return PerSamplePositionsLM("llama")


# ---------------------------------------------------------------------------------------------- unrecognised rows
class _Attention(nn.Module):
    """Causal attention by the usual layer names, reshaping with -1 heads: its tensor-parallel plan is inferred."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS  # what the inferred plan divides by the degree
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, -1, HIDDEN // HEADS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class FoldedScaleBlock(nn.Module):
    """Attention scaled per sample by an input of two rows per sample, ``[2 x samples, 1]``: rows per sample in a
    shape the runtime cannot recognise."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x) * scale.view(x.shape[0], 2).mean(dim=1).view(-1, 1, 1)


class DeclaredFoldedScaleBlock(FoldedScaleBlock):
    """The same block, its scale declared as two rows per sample (:func:`declared_folded_scale`)."""


class FoldedScaleLM(_Trainable):
    def __init__(self, block: type[nn.Module] = FoldedScaleBlock) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def logits(self, batch):
        inputs, _ = batch
        scale = (1 + inputs.sum(dim=1) % 3).float().repeat_interleave(2).view(-1, 1)
        x = self.embedding(inputs)
        for block in self.blocks:
            x = block(x, scale)
        return self.head(x)


def folded_scale() -> FoldedScaleLM:
    torch.manual_seed(1234)
    return FoldedScaleLM()


def declared_folded_scale() -> FoldedScaleLM:
    """What the refusal of :func:`folded_scale` asks for: the block's plan declares its scale (positional argument
    1) as two rows per sample, so it moves with its samples."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_galvatron import register_tensor_parallel_plan

    register_tensor_parallel_plan(
        DeclaredFoldedScaleBlock,
        {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(),
        },
        divisible={"attention heads": HEADS},
        folded_inputs={1: 2},
    )
    torch.manual_seed(1234)
    return FoldedScaleLM(DeclaredFoldedScaleBlock)
