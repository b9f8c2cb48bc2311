"""Pipelines follow the order the step runs the layers outside the blocks in, not the order of ``__init__``
(issue 12, symptom 2), and refuse before training what they could not run exactly.

A GPT whose LM head is registered before its embedding and blocks (LitGPT's layout) trained to the
loss of zero logits under pp=2 because the head was kept on the first stage. The regression tests
train it, and LitGPT's own ``GPT``, under pp=2 (1F1B and interleaved) and compare fit, validate,
test and predict with one process (tolerances of test_parity_data_parallel, fp32). So does a model
whose inputs enter through an ``nn.Linear`` (no token table), once refused as if it asked for vocabulary
parallelism.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.outside_layers import trace_outside_layers
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.runtime.pipeline import PipelineUsageError, StagePartition
from tests.helpers.pipeline_models import input_projection_encoder, litgpt_gpt, lm_head_first_gpt
from tests.helpers.training import assert_close_runs, dataset, run_distributed, run_single
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(600)

PP2 = {
    "1f1b": ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2),
    "interleaved_1f1b": ParallelPlan.uniform(
        2, 4, S(), pp=2, schedule="interleaved_1f1b", micro_batches=2, virtual_stages=2
    ),
}
MODELS = {
    "head_registered_first": lm_head_first_gpt,
    "litgpt": litgpt_gpt,
    "no_token_embedding": input_projection_encoder,
}


@pytest.mark.parametrize("schedule", list(PP2))
@pytest.mark.parametrize("name", list(MODELS))
def test_layers_outside_the_blocks_in_any_layout_match_one_process(pools, name, schedule):
    model = MODELS[name]
    expected = run_single(model=model, evaluate=True)
    result = pools(2).run(run_distributed, PP2[schedule], model=model, evaluate=True)[0]
    assert_close_runs(result, expected, **FP32_TOL)
    assert result.val_loss == pytest.approx(expected.val_loss, abs=1e-5)
    assert result.test_loss == pytest.approx(expected.test_loss, abs=1e-5)
    torch.testing.assert_close(result.predictions, expected.predictions, atol=1e-5, rtol=0)


def test_layers_are_sorted_by_when_they_run():
    module = lm_head_first_gpt()
    outside = trace_outside_layers(module, find_blocks(module), "training_step", dataset(2)[0:2])
    assert outside.before == ("net.transformer.wte", "net.transformer.wpe")
    assert outside.after == ("net.lm_head", "net.transformer.ln_f")  # registration order within a side


# ---------------------------------------------------------------------------------------------- refusals
HIDDEN = 8


class Toy(nn.Module):
    """Embedding, 3 blocks, norm, head; ``variant`` is one thing a pipeline cannot run exactly."""

    def __init__(self, variant: str = "fine") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.wte = nn.Embedding(16, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(3))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 16)
        if variant == "root_parameter":
            self.scale = nn.Parameter(torch.ones(()))
        if variant == "tied":
            self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        v = self.variant
        x = e = self.wte(tokens)
        if v == "norm_before_and_after":
            x = self.norm(x)
        blocks = list(self.blocks)
        if v == "blocks_twice":
            blocks += blocks
        for i, block in enumerate(blocks):
            x = block(x)
            if v == "norm_between_blocks" and i == 0:
                x = self.norm(x)
            if v == "hidden_changed_between_blocks":
                x = x * 2
        if v == "embedding_used_after":
            x = x + e
        x = self.norm(x)
        if v == "functional_head":
            return F.linear(x, self.wte.weight)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())


class AuxLossBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.linear(x if bias is None else x + bias))
        return y, y.pow(2).mean()


class ToyWithBlockOutputs(Toy):
    """Blocks return (hidden, auxiliary loss) and take a bias: the step sums the auxiliary losses, or passes the
    embedding or a block's output as the bias."""

    def __init__(self, variant: str) -> None:
        super().__init__(variant)
        self.blocks = nn.ModuleList(AuxLossBlock() for _ in range(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = e = self.wte(tokens)
        aux, first = 0.0, None
        for block in self.blocks:
            bias = {"block_output_into_later_blocks": first, "embedding_into_every_block": e}.get(self.variant)
            x, a = block(x, bias=bias)
            first = x if first is None else first
            aux = aux + a
        return self.head(self.norm(x)) + (aux if self.variant == "auxiliary_losses" else 0.0)


REFUSED = {  # the start of the message naming what is refused
    "root_parameter": "Toy holds parameters itself (scale) and contains the blocks",
    "norm_before_and_after": "norm runs both before and after the blocks",
    "norm_between_blocks": "norm holds parameters outside the blocks but runs between the blocks",
    "functional_head": "wte.weight is used after the blocks outside a call of wte (e.g. F.linear(x, wte.weight))",
    "hidden_changed_between_blocks": "blocks.1 does not receive the hidden states blocks.0 returned",
    "embedding_into_every_block": "blocks.0 receives an input (bias=) computed from parameters",
    "embedding_used_after": "the step uses the output of wte (a layer before the blocks) after the blocks",
    "blocks_twice": "the step called the blocks in the order [0, 1, 2, 0, 1, 2]",
    "auxiliary_losses": "the step uses outputs of blocks.0 other than the hidden states",
    "block_output_into_later_blocks": "blocks.1 receives an input (bias=) computed from parameters or from the hidden",
}


@pytest.mark.parametrize("variant", list(REFUSED))
def test_what_a_pipeline_cannot_run_exactly_is_refused(variant):
    with_outputs = ("auxiliary_losses", "block_output_into_later_blocks", "embedding_into_every_block")
    module = ToyWithBlockOutputs(variant) if variant in with_outputs else Toy(variant)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(PlanError, match=re.escape(REFUSED[variant])):
        trace_outside_layers(module, find_blocks(module, "blocks"), "training_step", dataset(2)[0:2])
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())


def test_tied_embedding_and_head_are_on_both_ends():
    module = Toy("tied")
    outside = trace_outside_layers(module, find_blocks(module, "blocks"), "training_step", dataset(2)[0:2])
    assert (outside.before, outside.after) == (("wte",), ("norm", "head"))
    plan = ParallelPlan.uniform(2, 3, S(), pp=2, schedule="1f1b", micro_batches=2)
    partition = StagePartition(find_blocks(module, "blocks"), plan, 1, boundary_dtype=torch.float32, outside=outside)
    assert partition.has_tied_weights and [p is module.head.weight for p in partition.tied] == [True]


def test_stand_ins_refuse_to_be_used():
    """A later stage's stand-in for a layer before the blocks refuses to run after them, and gives the layer's
    shapes and dtypes without values; a block of another stage gives its configuration, not its tensors."""
    module = Toy()
    structure = find_blocks(module, "blocks")
    outside = trace_outside_layers(module, structure, "training_step", dataset(2)[0:2])
    plan = ParallelPlan.uniform(2, 3, S(), pp=2, schedule="1f1b", micro_batches=2, partition=(1, 2))
    partition = StagePartition(structure, plan, rank=1, boundary_dtype=torch.float32, outside=outside)
    (chunk,) = partition.chunks
    tokens = dataset(2)[0:2][0]
    with partition.running(chunk, torch.zeros(2, tokens.shape[1], HIDDEN)):
        stand_in = module.wte(tokens)  # zeros of the embedding's shape and dtype, discarded by the first block
        assert stand_in.shape == (2, tokens.shape[1], HIDDEN) and not stand_in.any()
        for block in module.blocks:
            block(stand_in)
        with pytest.raises(PipelineUsageError, match="wte runs before the Transformer blocks .* after the blocks"):
            module.wte(tokens)
    # What a step reads of it without running it (ViT reads weight.dtype) is the layer's; its values are nowhere.
    weight = module.wte.weight
    assert (weight.shape, weight.dtype, weight.device.type) == ((16, HIDDEN), torch.float32, "meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        F.embedding(tokens, weight).sum().item()
    with pytest.raises(AttributeError, match="wte lives on the first pipeline stage only; 'scale' was read on"):
        _ = module.wte.scale
    assert module.blocks[0].training  # configuration of a block of another stage
    with pytest.raises(AttributeError, match="block 0 lives on another pipeline stage; its '0.weight' is not"):
        _ = getattr(module.blocks[0], "0").weight
