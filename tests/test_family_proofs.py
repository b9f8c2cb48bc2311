"""Registered tensor-parallel plans proven on their blocks, in one process (issue 43): the proof that checks a guessed
plan (:mod:`lightning_galvatron.model.tensor_parallel_proof`: every rank's split forward simulated against the whole
block, on the inputs of a real call; plain and Megatron-SP) run on the plans of the mixtures of experts (Mixtral,
Qwen2-MoE, OLMoE: the attention split, the experts whole), OLMo-2 (a norm over all heads), Whisper and GPT-Neo, whose
multi-process runs are in the family matrix under ``GALVATRON_ALL_FAMILIES=1``; and the proof catching a plan that
splits OLMoE's norm over all heads with the heads, or leaves a norm of OLMo-2 on sequence shards without summing its
gradient.
"""

from __future__ import annotations

import pytest

from lightning_galvatron.model.discovery import find_blocks, model_class
from lightning_galvatron.model.families._common import GatherWidth
from lightning_galvatron.model.tensor_parallel_plans import tensor_parallel_plan_or_reason
from lightning_galvatron.model.tensor_parallel_proof import example_calls, proof_degrees, prove_split
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, SplitPerHead
from tests.helpers.model_families import family
from tests.helpers.training import dataset


def _blocks_and_calls(name: str) -> tuple[list, dict]:
    model = family(name)()
    blocks = find_blocks(model).blocks
    kinds = list({model_class(b): b for b in blocks}.values())
    return kinds, example_calls(model, blocks, "training_step", dataset(4)[0:1])


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe", "olmo2", "whisper", "gpt_neo"])
def test_registered_plan_computes_what_the_block_computes(name):
    blocks, calls = _blocks_and_calls(name)
    for block in blocks:
        plan = tensor_parallel_plan_or_reason(block)
        assert isinstance(plan, BlockTensorParallelPlan), plan
        degrees = proof_degrees(plan)
        assert degrees, plan.divisible
        call = calls[model_class(block)]
        assert prove_split(block, plan, degrees, call) is None, type(block).__name__
        assert plan.megatron_sp and prove_split(block, plan, degrees, call, sequence_parallel=True) is None
        assert plan.ulysses == (name != "gpt_neo")
        styles = plan.styles(False)
        assert not any(n.startswith("mlp.experts") for n in styles), "the experts stay whole"


def test_the_experts_stay_whole_and_sum_their_gradients_under_sequence_parallelism():
    """Under Megatron-SP each rank runs the experts on its own positions: their weights are kept whole with their
    gradients summed over the group; under plain TP every rank runs them on every position and nothing is added."""
    (block,), _ = _blocks_and_calls("mixtral")
    plan = tensor_parallel_plan_or_reason(block)
    assert {"mlp.gate", "mlp.experts"} <= plan.styles(True).keys()
    assert not {"mlp.gate", "mlp.experts"} & plan.styles(False).keys()


def test_the_proof_catches_a_norm_over_all_heads_left_unsplit():
    """OLMoE normalises all heads' queries at once: a plan that lets each rank normalise its part of them alone with
    its part of the norm's weight (``SplitPerHead`` instead of ``GatherWidth``) runs without an error and computes
    another function; the proof says so."""
    (block,), calls = _blocks_and_calls("olmoe")
    plan = tensor_parallel_plan_or_reason(block)
    assert isinstance(plan.styles(False)["self_attn.q_norm"], GatherWidth)

    def without_gather(sequence_parallel: bool) -> dict:
        styles = plan.styles(sequence_parallel).items()
        return {k: SplitPerHead() if isinstance(v, GatherWidth) else v for k, v in styles}

    wrong = BlockTensorParallelPlan(without_gather, plan.divisible, localize=plan.localize)
    problem = prove_split(block, wrong, [2], calls[model_class(block)])
    assert problem is not None and "split 2 ways, it computes another function than the whole block" in problem


def test_the_proof_catches_a_norm_on_sequence_shards_whose_gradient_no_style_sums():
    """OLMo-2 normalises the MLP's output after it is reduce-scattered: on each rank's positions under Megatron-SP. A
    plan that forgets that norm computes the same forward, but its weight's gradient would cover one rank's positions;
    the proof's Megatron-SP check says so."""
    (block,), calls = _blocks_and_calls("olmo2")
    plan = tensor_parallel_plan_or_reason(block)
    assert "post_feedforward_layernorm" in plan.styles(True)

    def forgetting(sequence_parallel: bool) -> dict:
        return {k: v for k, v in plan.styles(sequence_parallel).items() if k != "post_feedforward_layernorm"}

    wrong = BlockTensorParallelPlan(forgetting, plan.divisible, megatron_sp=True, localize=plan.localize)
    problem = prove_split(block, wrong, [2], calls[model_class(block)], sequence_parallel=True)
    assert "post_feedforward_layernorm would see only each rank's positions and no style of the plan sums" in problem
