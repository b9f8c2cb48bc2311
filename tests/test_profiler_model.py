"""Model profiler on one process: exact activation bytes of known blocks, times, parameters, no side effects."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.profiler.model import SavedTensorCounter, profile_model
from lightning_galvatron.profiler.model.setup import TIMING_QUANTILE, quiet_seconds
from tests.helpers.training import SEQ, dataset, tiny_gpt

FP32 = 4


class LinearGelu(nn.Module):
    """``gelu(x W + b)``: autograd saves the linear's input and the GELU's input, nothing else."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class ToyLM(nn.Module):
    def __init__(self, vocab: int = 11, hidden: int = 16, layers: int = 3, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LinearGelu(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_step(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(module(tokens).flatten(0, 1), targets.flatten())


def toy_batch(batch: int = 2, seq: int = 6, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g)


def test_saved_tensor_counter_counts_storages_once_and_skips_parameters():
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorCounter([*layer.parameters()]) as counter:
        y = layer(x)
        z = y * y  # saves y twice (both operands): one storage
        w = z[:, :4].exp()  # saves its output
    assert counter.total == (4 * 8 + 4 * 8 + 4 * 4) * FP32
    del w


def test_known_block_activation_bytes_are_exact():
    hidden, seq, vocab = 16, 6, 11
    model = ToyLM(vocab, hidden)
    profile = profile_model(model, find_blocks(model), toy_batch(seq=seq), step=lm_step, batch_sizes=(1, 3))
    (layer,) = profile.layer_types
    # Linear input [s, h] + GELU input [s, h], fp32, per sample.
    assert layer.activation_bytes_per_sample.at(1) == 2 * seq * hidden * FP32
    assert layer.recompute_activation_bytes_per_sample == seq * hidden * FP32  # only the block's input
    assert layer.parameters == hidden * hidden + hidden
    assert (layer.hidden_size, layer.seq_length) == (hidden, seq)
    assert not layer.supports_tensor_parallel  # "proj" is no known projection name: no TP plan
    assert profile.blocks == (0, 0, 0)
    assert profile.activation_dtype_bytes == FP32
    vocab_profile = profile.vocab
    # The head keeps its input [s, h] and log-softmax's output [s, V]; the embedding only the token ids (the batch).
    assert vocab_profile.head_activation_bytes_per_sample.at(1) == seq * (hidden + vocab) * FP32
    assert vocab_profile.embedding_activation_bytes_per_sample.at(1) == 0
    assert (vocab_profile.vocab_size, vocab_profile.embedding_parameters, vocab_profile.head_parameters) == (
        vocab,
        vocab * hidden,
        hidden * vocab,
    )
    assert not vocab_profile.tied


def test_tied_head_is_counted_once():
    model = ToyLM(tied=True)
    vocab = profile_model(model, find_blocks(model), toy_batch(), step=lm_step).vocab
    assert vocab.tied and vocab.head_parameters == 0 and vocab.embedding_parameters == 11 * 16


def test_times_are_positive_and_grow_with_the_batch():
    model = ToyLM(hidden=256, layers=2)
    profile = profile_model(model, find_blocks(model), toy_batch(seq=64), step=lm_step, batch_sizes=(1, 32))
    fit = profile.layer_types[0].forward_time
    assert fit.per_sample_s > 0 and fit(32) > fit(1) > 0
    assert profile.layer_types[0].backward_to_forward > 0
    vocab = profile.vocab
    assert vocab.head_forward_time(1) > 0 and vocab.embedding_forward_time(1) > 0


def test_a_point_keeps_the_quiet_end_of_its_repeats():
    # Preemption on shared cores only adds time: a few slow repeats do not move the kept value, the fast ones do.
    quiet = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0]
    assert quiet_seconds(quiet) == pytest.approx(1.0 + TIMING_QUANTILE * 10 * 0.1)
    assert quiet_seconds([*quiet[:-3], 9.0, 9.0, 9.0]) == pytest.approx(quiet_seconds(quiet))
    assert quiet_seconds(reversed(quiet)) == quiet_seconds(quiet)  # order does not matter
    assert quiet_seconds([0.5, 0.6, *quiet[2:]]) < quiet_seconds(quiet)
    assert quiet_seconds([3.0]) == 3.0
    with pytest.raises(ValueError, match="no timings"):
        quiet_seconds([])


def test_example_gpt_without_process_group_derives_degrees():
    model = tiny_gpt()
    data = dataset(4)
    profile = profile_model(model, find_blocks(model), (data.inputs[:2], data.targets[:2]), degrees=(1, 2, 4))
    (layer,) = profile.layer_types
    assert (layer.num_heads, layer.hidden_size, layer.ffn_hidden_size, layer.seq_length) == (4, 32, 128, SEQ)
    assert layer.supports_tensor_parallel and layer.supports_megatron_sp and layer.supports_ulysses
    assert layer.tp_collectives_per_forward == 2 and layer.ulysses_all_to_alls_per_forward == 4
    table = layer.activation_bytes_per_sample
    # Sequence parallelism splits all but the (gathered) inputs of the column-parallel projections.
    column_inputs = 2 * SEQ * 32 * FP32  # the outputs of ln_1 and ln_2
    for g in (2, 4):
        assert table.at(g) == pytest.approx(column_inputs + (table.at(1) - column_inputs) / g)
    # Without SP the two LayerNorms (input and statistics) stay whole on every rank.
    assert layer.replicated_activation_bytes_per_sample == 2 * (SEQ * 32 + 2 * SEQ) * FP32
    assert layer.recompute_activation_bytes_per_sample == SEQ * 32 * FP32
    assert profile.vocab.vocab_size == 16
    # A valid profile once a hardware part is added: the JSON round trip of the model part is exact.
    assert type(profile).from_dict(profile.to_dict()) == profile


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_activations_are_about_half(precision):
    model = tiny_gpt()
    data = dataset(4)
    batch = (data.inputs[:2], data.targets[:2])
    fp32 = profile_model(model, find_blocks(model), batch).layer_types[0].activation_bytes_per_sample.at(1)
    profile = profile_model(model, find_blocks(model), batch, precision=precision)
    assert profile.activation_dtype_bytes == 2
    assert 0.4 * fp32 < profile.layer_types[0].activation_bytes_per_sample.at(1) < 0.6 * fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the module itself stays fp32


def test_profiling_leaves_no_trace():
    model = tiny_gpt()
    model.eval()
    data = dataset(4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    profile_model(model, find_blocks(model), (data.inputs[:2], data.targets[:2]))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())  # training draws the same random numbers as without profiling
    assert all(p.grad is None for p in model.parameters())
    assert not any(m.training for m in model.modules())
    assert "log" not in vars(model) and "forward" not in vars(model.model.blocks[1])


def test_manual_optimisation_and_odd_steps_get_clear_errors():
    model = tiny_gpt()
    model.automatic_optimization = False
    data = dataset(4)
    with pytest.raises(ValueError, match="manual optimisation"):
        profile_model(model, find_blocks(model), (data.inputs[:2], data.targets[:2]))
    toy = ToyLM()
    with pytest.raises(ValueError, match="batch_sizes"):
        profile_model(toy, find_blocks(toy), toy_batch(), step=lm_step, batch_sizes=(0,))
