"""Model families (issue 8): each trains under GalvatronStrategy on 4 processes and matches one process.

Families: Hugging Face GPT-2 and Llama (also in test_parity_tensor_parallel / test_pipeline), a
Hugging Face BERT classifier with a padding mask, PyTorch's ``nn.TransformerEncoder`` (its layers'
``nn.MultiheadAttention`` split by heads), an encoder-decoder of ``nn.TransformerEncoder`` and
``nn.TransformerDecoder`` (two block lists, found automatically) and a plain list of blocks that no
tensor-parallel plan knows. Tolerances as in test_parity_data_parallel (fp32): losses 1e-5,
first-step gradients 1e-3 of their RMS, parameters 1e-4 after 3 AdamW steps.

The ``torch.nn`` models use a global batch of 12: their causal mask is ``[SEQ, SEQ] = [8, 8]`` and
the runtime moves extra block inputs whose first dimension equals the local batch along the batch,
so no layout may hold 8 samples (see the README's known limits).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import lightning.pytorch as L
import pytest
import torch.distributed as dist
from torch import nn

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.families._common import GatherWidth
from lightning_galvatron.model.tensor_parallel_plans import (
    block_tensor_parallel_plans,
    tensor_parallel_plan,
    tensor_parallel_plan_or_reason,
)
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiler import profile
from lightning_galvatron.runtime.tensor_parallel import PerHeadWeights, SplitPerHead
from lightning_galvatron.search import evaluate
from tests.conftest import LITGPT_INSTALLED
from tests.helpers.hf_models import hf_llama
from tests.helpers.model_families import (
    declared_folded_scale,
    family,
    folded_scale,
    hf_bert,
    literal_heads,
    per_sample_positions,
    plain_blocks,
    torch_encoder,
    torch_seq2seq,
)
from tests.helpers.training import QUICK_TRIALS, assert_close_runs, dataset, run_distributed, run_single
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(900)

TORCH_BATCH = 12

PLANS = {
    "hf_bert_tp_megatron_sp": (
        hf_bert,
        8,
        ParallelPlan(
            world_size=4,
            layers=(
                S(tp=2, sp="megatron", dp_type="zero3"),
                S(tp=2, recompute=True),
                S(tp=2, sp="megatron", dp_type="zero2", recompute=True),
                S(tp=2, dp_type="zero3"),
            ),
            vocab=S(tp=2),
        ),
    ),
    "torch_encoder_heterogeneous": (
        torch_encoder,
        TORCH_BATCH,
        ParallelPlan(
            world_size=4,
            layers=(
                S(tp=2, dp_type="zero3"),
                S(tp=4, recompute=True),
                S(tp=2, dp_type="zero2", tp_consecutive=False),
                S(dp_type="zero3", recompute=True),
            ),
            vocab=S(tp=2),
        ),
    ),
    "torch_encoder_decoder_two_block_lists": (
        torch_seq2seq,
        TORCH_BATCH,
        ParallelPlan(
            world_size=4,
            layers=(
                S(tp=2),
                S(tp=2, dp_type="zero3", recompute=True),
                S(tp=2, dp_type="zero2"),
                S(tp=2, dp_type="zero3", recompute=True),
            ),
            vocab=S(tp=2),
        ),
    ),
    "plain_blocks_without_tp_plan": (
        plain_blocks,
        8,
        ParallelPlan(
            world_size=4,
            layers=(S(dp_type="zero3"), S(dp_type="zero2", recompute=True), S(), S(dp_type="zero3", recompute=True)),
            vocab=S(tp=2),
        ),
    ),
    "torch_encoder_pipelined_with_tp": (
        torch_encoder,
        TORCH_BATCH,
        ParallelPlan.uniform(4, 4, S(tp=2, dp_type="zero2"), vocab=S(tp=2), pp=2, schedule="1f1b", micro_batches=2),
    ),
    # Fused projections not laid out per head: CodeGen's heads in 4 partitions (its output projection split in
    # 4 strided sections too), MPT's [q | k | v] with an ALiBi bias sliced per head.
    **{
        name: (
            family(name),
            8,
            ParallelPlan(
                world_size=4,
                layers=(
                    S(tp=2, sp="megatron", dp_type="zero3"),
                    S(tp=2, recompute=True),
                    S(tp=2, tp_consecutive=False, dp_type="zero2"),
                    S(dp_type="zero3"),
                ),
                vocab=S(tp=2),
            ),
        )
        for name in ("codegen", "mpt")
    },
    # Later stages compute the rotary tables per sample from their own micro-batches (the layers outside the
    # blocks are stand-ins there, the rotary embedding holds no parameters and runs).
    "hf_llama_per_sample_positions_pipelined": (
        per_sample_positions,
        8,
        ParallelPlan.uniform(4, 4, S(tp=2), vocab=S(tp=2), pp=2, schedule="1f1b", micro_batches=2),
    ),
    "hf_llama_pipelined_with_tp": (
        hf_llama,
        8,
        ParallelPlan.uniform(4, 4, S(tp=2, dp_type="zero3"), vocab=S(tp=2), pp=2, schedule="1f1b", micro_batches=2),
    ),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_family_matches_single_process(pools, name):
    model, batch, plan = PLANS[name]
    expected = run_single(model=model, global_batch=batch)
    result = pools(4).run(run_distributed, plan, model=model, global_batch=batch)[0]
    assert_close_runs(result, expected, **FP32_TOL)


# Blocks whose data-parallel layouts differ from the embedding's and from each other: a block's extra
# batch-major inputs (BERT's attention mask, the decoder's memory and padding mask) are made outside the
# blocks, so they are relocated from the embedding's layout, not from the previous block's.
HETEROGENEOUS = {
    "hf_bert": (
        hf_bert,
        8,
        ParallelPlan(
            world_size=4,
            layers=(
                S(tp=2, sp="megatron", dp_type="zero3"),
                S(tp=4, recompute=True),
                S(dp_type="zero2"),
                S(tp=2, sp="megatron", recompute=True, tp_consecutive=False),
            ),
            vocab=S(tp=2),
        ),
    ),
    "torch_encoder_decoder": (
        torch_seq2seq,
        TORCH_BATCH,
        ParallelPlan(
            world_size=4,
            layers=(S(tp=2), S(tp=4, dp_type="zero3"), S(tp=2, dp_type="zero2", recompute=True), S(dp_type="zero3")),
            vocab=S(dp_type="zero2"),
        ),
    ),
    # Rotary tables per sample, a (cos, sin) tuple: moved with their samples between consecutive and strided
    # tensor-parallel groups (the same number of samples per shard, other samples) and data-parallel blocks.
    "hf_llama_per_sample_positions": (
        per_sample_positions,
        8,
        ParallelPlan(
            world_size=4,
            layers=(S(tp=2), S(tp=2, tp_consecutive=False), S(dp_type="zero3"), S(tp=2, tp_consecutive=False)),
            vocab=S(tp=2),
        ),
    ),
}


@pytest.mark.parametrize("name", list(HETEROGENEOUS))
def test_heterogeneous_layouts_with_extra_block_inputs(pools, name):
    model, batch, plan = HETEROGENEOUS[name]
    expected = run_single(model=model, global_batch=batch)
    result = pools(4).run(run_distributed, plan, model=model, global_batch=batch)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_validation_with_split_attention_matches(pools):
    """Evaluation mode (no gradients): nn.TransformerEncoder's own fast paths must stay off under the plan."""
    model, batch, plan = PLANS["torch_encoder_heterogeneous"]
    expected = run_single(model=model, global_batch=batch, validate=True, max_steps=1)
    result = pools(4).run(run_distributed, plan, model=model, global_batch=batch, validate=True, max_steps=1)[0]
    assert result.val_loss == pytest.approx(expected.val_loss, abs=1e-5)


def test_blocks_and_plans_are_found():
    bert = find_blocks(hf_bert())
    assert [bl.path for bl in bert.block_lists] == ["model.bert.encoder.layer"]
    assert tensor_parallel_plan(bert.blocks[0]).megatron_sp
    seq2seq = find_blocks(torch_seq2seq())
    assert [bl.path for bl in seq2seq.block_lists] == ["encoder.layers", "decoder.layers"]
    assert [bl.block_type for bl in seq2seq.block_lists] == ["TransformerEncoderLayer", "TransformerDecoderLayer"]
    assert all(tensor_parallel_plan(b).unsupported(4, "none") is None for b in seq2seq.blocks)
    assert tensor_parallel_plan(seq2seq.blocks[0]).unsupported(2, "megatron") is not None
    assert tensor_parallel_plan(find_blocks(plain_blocks()).blocks[0]) is None
    sequence_first = nn.TransformerEncoderLayer(32, 4, 64, batch_first=False)
    assert tensor_parallel_plan(sequence_first) is None  # the runtime moves activations along dim 0 as the batch
    small_head = nn.Module()
    small_head.encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 4, enable_nested_tensor=False
    )
    small_head.heads = nn.ModuleList(nn.Sequential(nn.Linear(32, 2), nn.Linear(2, 2)) for _ in range(2))
    assert [bl.path for bl in find_blocks(small_head).block_lists] == ["encoder.layers"]


def test_weights_inside_a_split_attention_are_kept_per_head_or_refused():
    """What an attention holds besides its projections sees only a rank's heads under tensor parallelism: a norm
    one head wide (Qwen3's and Gemma3's q_norm/k_norm, LitGPT's with norm_qk) sums its gradient over the group (the
    family matrix proves the parity); a norm over all heads runs on the width each rank gathers for it in OLMo-2's
    registered plan (GatherWidth) and is refused with the reason in LitGPT's OLMo-2 variant, where LitGPT's plan once
    trained apart from one process. An attention
    reshaping with its global head count (StableLM) has it divided by the degree, once the split is proven."""
    for name, norms in (
        ("qwen3", ("self_attn.q_norm", "self_attn.k_norm")),
        ("gemma3", ("self_attn.q_norm", "self_attn.k_norm")),
        ("litgpt_norm_qk", ("attn.norm_q", "attn.norm_k")),  # a family plan of its own: the check is in every plan
    ):
        if name.startswith("litgpt") and not LITGPT_INSTALLED:
            continue
        block = find_blocks(family(name)()).blocks[0]
        styles = tensor_parallel_plan_or_reason(block).styles(False)
        assert all(type(styles[n]) is PerHeadWeights for n in norms), name
    if LITGPT_INSTALLED:
        litgpt_olmo2 = tensor_parallel_plan_or_reason(find_blocks(family("litgpt_norm_qk_olmo2")()).blocks[0])
        assert "attn.norm_q (RMSNorm) holds weights of shape (32,)" in litgpt_olmo2
    olmo2 = tensor_parallel_plan_or_reason(find_blocks(family("olmo2")()).blocks[0]).styles(False)
    assert all(type(olmo2[n]) is GatherWidth for n in ("self_attn.q_norm", "self_attn.k_norm"))
    # StableLM's attention reshapes with self.num_heads: divided by the degree, proven on a real call (issue 43).
    stablelm = find_blocks(family("stablelm")())
    proven = block_tensor_parallel_plans(stablelm, "training_step", lambda: dataset(2)[0:2])[0]
    assert not isinstance(proven, str), proven
    # One entry per head on the attention itself (GPT-OSS's sinks): split with the heads (all 8 cases of the matrix
    # with GALVATRON_ALL_FAMILIES=1; refused before, as a weight inside the split attention).
    gpt_oss = block_tensor_parallel_plans(find_blocks(family("gpt_oss")()), "training_step", lambda: dataset(2)[0:2])[0]
    assert type(gpt_oss.styles(False)["self_attn"]) is SplitPerHead


def _unexpected_blocks(registered: str) -> list[nn.Module]:
    """Blocks of the registered class's qualified name laid out as no plan expects: empty; the usual sub-layer names
    holding other kinds of modules; the usual linear names one level off."""
    module_name, _, class_name = registered.rpartition(".")
    made = []
    for build in (
        lambda block: None,
        lambda block: [setattr(block, n, nn.Identity()) for n in ("attention", "attn", "self_attn", "mlp", "ln_1")],
        lambda block: [setattr(block, n, nn.Linear(8, 8)) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc")],
    ):
        block = type(class_name, (nn.Module,), {"__module__": module_name, "__qualname__": class_name})()
        build(block)
        made.append(block)
    return made


def test_every_registered_plan_gives_a_reason_for_a_block_it_does_not_expect():
    """A library release that renames a block's layers (transformers 5.x's ViT: ``attention.attention.query`` became
    ``attention.q_proj``) reached users as an AttributeError from the family plan on every rank. Every registered plan,
    fed blocks of its class laid out otherwise, gives the reason (the block then trains with tp = 1) and never
    raises."""
    from lightning_galvatron.model import plan_registry

    tensor_parallel_plan_or_reason(nn.Linear(2, 2))  # loads the built-in families
    assert len(plan_registry._REGISTRY) > 20
    for registered in sorted(plan_registry._REGISTRY):
        for block in _unexpected_blocks(registered):
            reason = tensor_parallel_plan_or_reason(block)
            assert isinstance(reason, str) and reason, (registered, reason)


def test_vit_plans_follow_the_installed_layout():
    """ViT/DeiT's layers by what they are, in the layout of the installed transformers (both layouts are known)."""
    for name in ("vit", "deit"):
        plan = tensor_parallel_plan_or_reason(find_blocks(family(name)()).blocks[0])
        assert not isinstance(plan, str), plan


def _auto_plan_with_warnings(model: Callable[[], L.LightningModule], cache: str) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = GalvatronStrategy(profile_cache=cache, save_plan=False, trials=QUICK_TRIALS)
        result = run_distributed(model=model, global_batch=8, strategy=strategy)
    return result, [str(w.message) for w in caught]


def test_a_block_that_fails_when_split_is_planned_without_tensor_parallelism(pools, profile_cache):
    """An inferred plan can pass every static check and still not run (a literal head count in a reshape): the proof
    of the guess on the block (a split forward simulated on one process) says why, and ``plan="auto"`` plans it with
    ``tp = 1`` and trains as one process (the profiler, which drops what fails on its split copy, never splits it)."""
    reason = tensor_parallel_plan_or_reason(literal_heads().blocks[0])
    assert re.search(
        r"LiteralHeadsBlock from its nn\.Linear layers is wrong for it: split 2 ways, its forward raises "
        r"RuntimeError: shape",
        reason,
    ), reason
    result, _ = pools(2).run(_auto_plan_with_warnings, literal_heads, str(profile_cache))[0]
    assert all(layer.tp == 1 for layer in result.plan.layers)
    assert_close_runs(result, run_single(model=literal_heads), **FP32_TOL)


def test_ddp_sums_the_gradients_of_a_model_whose_parameters_are_all_split(pools):
    """OLMo's norms have no weights: under tp=2 with vocabulary parallelism every trainable parameter is a DTensor.
    Moving the model to its device after the gradient hooks were installed swapped those parameters and silenced the
    hooks, so no gradient was summed over the replicas (0.65-0.8x one process's); other models were summed only by
    the hooks of their plain parameters (norm weights)."""
    model = family("olmo")
    plan = ParallelPlan.uniform(4, 4, S(tp=2), vocab=S(tp=2))
    assert_close_runs(pools(4).run(run_distributed, plan, model=model)[0], run_single(model=model), **FP32_TOL)


def test_tensor_parallelism_for_a_block_without_plan_is_refused(pools):
    plan = PLANS["plain_blocks_without_tp_plan"][2]
    plan = plan.replace(layers=(S(tp=2), *plan.layers[1:]))
    with pytest.raises(
        AssertionError, match=r"layers\[0\]: MixerBlock has no tensor-parallel plan, so tp=2 cannot run"
    ):
        pools(4).run(run_distributed, plan, model=plain_blocks)


def test_per_sample_inputs_the_runtime_cannot_move_are_refused(pools):
    """An input with rows per sample in a shape the runtime does not recognise (two rows per sample) stays where it
    is while the samples move between consecutive and strided tensor-parallel groups (shards of equal size): each
    rank would scale other samples with its own rows, silently. Its ranks' copies differ, so it is refused in the
    first step, with what to declare."""
    plan = ParallelPlan(world_size=4, layers=(S(tp=2), S(tp=2, tp_consecutive=False)), vocab=S(tp=2))
    with pytest.raises(
        AssertionError,
        match=r"FoldedScaleBlock received input\(s\) positional argument 1 that differ between ranks but do not hold "
        r"one row per sample",
    ):
        pools(4).run(run_distributed, plan, model=folded_scale)
    # Declared as the message says (two rows per sample), it moves with its samples and matches one process.
    result = pools(4).run(run_distributed, plan, model=declared_folded_scale)[0]
    assert_close_runs(result, run_single(model=declared_folded_scale), **FP32_TOL)


def test_encoder_decoder_pipeline_is_refused(pools):
    plan = ParallelPlan.uniform(4, 4, S(), pp=2, schedule="1f1b", micro_batches=2)
    with pytest.raises(
        AssertionError, match=r"pipeline parallelism over several block lists \(encoder.layers, decoder.layers\)"
    ):
        pools(4).run(run_distributed, plan, model=torch_seq2seq, global_batch=TORCH_BATCH)


# ---------------------------------------------------------------------------------------------- automatic plans
def _auto_plan_between_zero3_and_ddp(
    model: Callable[[], L.LightningModule], batch: int, cache_dir: str, **limits
) -> dict:
    """Profile the model as the strategy will (same cache), give the search a budget that pure DDP exceeds
    but pure ZeRO-3 fits, and train with ``plan="auto"`` (``limits``: the strategy's search limits)."""
    world = dist.get_world_size()
    module = model()
    measured = profile(
        module,
        find_blocks(module),
        dataset(batch)[0 : batch // world],
        precision="32-true",
        devices_per_node=world,
        cache=cache_dir,
    )
    num_blocks = measured.model.num_blocks
    peaks = {
        name: evaluate(
            measured,
            ParallelPlan.uniform(world, num_blocks, S(dp_type=name)),
            global_batch_size=batch,
            precision="32-true",
            optimizer="adamw",
        ).peak_memory_bytes
        for name in ("ddp", "zero3")
    }
    budget = int((peaks["ddp"] + peaks["zero3"]) / 2)
    strategy = GalvatronStrategy(
        memory_budget=budget, profile_cache=cache_dir, save_plan=False, trials=QUICK_TRIALS, **limits
    )
    result = run_distributed(strategy=strategy, model=model, global_batch=batch)
    return dict(result=result, plan=strategy.plan, budget=budget, peaks=peaks)


#: Models the family matrix (test_family_matrix's ``auto_tight``: Hugging Face GPT-2 and Llama,
#: ``nn.TransformerEncoder``) does not train under a budget between ZeRO-3's and DDP's.
AUTO = {
    "hf_bert": (hf_bert, 8, {}),
    "torch_encoder_decoder": (torch_seq2seq, TORCH_BATCH, {}),
    "plain_blocks": (plain_blocks, 8, {}),
    # Rotary tables per sample, a (cos, sin) tuple: profiled at other batch sizes part by part.
    "hf_llama_per_sample_positions": (per_sample_positions, 8, {}),
}


@pytest.mark.parametrize("name", list(AUTO))
def test_auto_plan_matches_single_process(pools, profile_cache, name):
    model, batch, limits = AUTO[name]
    out = pools(4).run(_auto_plan_between_zero3_and_ddp, model, batch, str(profile_cache), **limits)[0]
    plan = out["plan"]
    assert out["peaks"]["zero3"] < out["budget"] < out["peaks"]["ddp"]
    assert plan != ParallelPlan.uniform(4, plan.num_layers, S(), global_batch_size=batch)  # pure DDP does not fit
    assert_close_runs(out["result"], run_single(model=model, global_batch=batch), **FP32_TOL)


def test_torch_encoder_runs_on_a_later_pipeline_stage():
    """nn.TransformerEncoder reads ``self.layers[0]`` (for its fast-path checks) before looping over the layers;
    on stage 1 of 2 block "0" lives on stage 0, and its configuration is read from a local block."""
    import torch

    from lightning_galvatron.model.outside_layers import trace_outside_layers
    from lightning_galvatron.runtime.pipeline import StagePartition

    module = torch_encoder()
    plan = ParallelPlan.uniform(4, 4, S(), pp=2, schedule="1f1b", micro_batches=2)
    structure = find_blocks(module)
    inputs, targets = dataset(2)[0:2]
    outside = trace_outside_layers(module, structure, "training_step", (inputs, targets))
    assert (outside.before, outside.after) == (("embedding", "positions"), ("norm", "head"))
    partition = StagePartition(structure, plan, rank=2, boundary_dtype=torch.float32, outside=outside)
    (chunk,) = partition.chunks
    with partition.running(chunk, torch.zeros(2, inputs.shape[1], 32)):
        assert module.loss((inputs, targets)).isfinite()
