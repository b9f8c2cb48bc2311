"""Parity matrix of per-layer tensor and sequence parallelism (issue 4).

Every plan is trained for 3 AdamW steps against a single-process run of the same model on the
same global batches; losses (1e-5), first-step gradients (1e-3 of their RMS) and all parameters
(1e-4, gathered into full tensors; see test_parity_data_parallel) must agree. These are fp32 runs, so the only
differences are the order of floating-point sums.
"""

from __future__ import annotations

import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.hf_models import hf_gpt2, hf_llama
from tests.helpers.training import assert_close_runs, run_distributed, run_single
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(900)
DEFAULT_STRATEGY = S()


def uniform(world: int, strategy: S, vocab: S = DEFAULT_STRATEGY) -> ParallelPlan:
    return ParallelPlan.uniform(world, 4, strategy, vocab=vocab)


HETEROGENEOUS = ParallelPlan(
    world_size=4,
    layers=(
        S(tp=1, dp_type="zero3"),
        S(tp=2, dp_type="ddp", recompute=True),
        S(tp=4, dp_type="zero2"),
        S(tp=2, dp_type="zero3", recompute=True),
    ),
)
HETEROGENEOUS_MIXED_LAYOUTS = HETEROGENEOUS.replace(
    layers=(
        HETEROGENEOUS.layers[0],
        S(tp=2, dp_type="ddp", recompute=True, tp_consecutive=False),
        HETEROGENEOUS.layers[2],
        S(tp=2, dp_type="zero3", recompute=True, tp_consecutive=True),
    ),
    vocab=S(tp=2, tp_consecutive=False),
)

FOUR_PROCESS_PLANS = {
    "tp2": uniform(4, S(tp=2)),
    "tp4": uniform(4, S(tp=4)),
    "megatron_sp2": uniform(4, S(tp=2, sp="megatron")),
    "ulysses2": uniform(4, S(tp=2, sp="ulysses")),
    "ulysses4": uniform(4, S(tp=4, sp="ulysses")),
    "tp2_zero3": uniform(4, S(tp=2, dp_type="zero3")),
    "vtp4": uniform(4, S(), vocab=S(tp=4)),
    "vtp2_strided_tied": uniform(4, S(tp=2, tp_consecutive=False), vocab=S(tp=2, tp_consecutive=False)),
    "vtp4_uneven_vocab": uniform(4, S(), vocab=S(tp=4)),
    "vtp4_parallel_loss_uneven_vocab": uniform(4, S(tp=2), vocab=S(tp=4)),
    "heterogeneous": HETEROGENEOUS,
    "heterogeneous_mixed_layouts": HETEROGENEOUS_MIXED_LAYOUTS,
}
MODEL_OPTIONS = {
    "vtp2_strided_tied": dict(tie_weights=True),
    "vtp4_uneven_vocab": dict(vocab_size=15),  # 4, 4, 4, 3 rows per rank
    "vtp4_parallel_loss_uneven_vocab": dict(vocab_size=15),
}
STRATEGY_OPTIONS = {"vtp4_parallel_loss_uneven_vocab": dict(vocab_parallel_loss=True)}


@pytest.mark.parametrize("name", list(FOUR_PROCESS_PLANS))
def test_four_processes(pools, name):
    model_kwargs = MODEL_OPTIONS.get(name, {})
    expected = run_single(model_kwargs=model_kwargs)
    result = pools(4).run(
        run_distributed, FOUR_PROCESS_PLANS[name], model_kwargs=model_kwargs, strategy_kwargs=STRATEGY_OPTIONS.get(name)
    )[0]
    assert_close_runs(result, expected, **FP32_TOL)


EIGHT_HEADS = dict(n_head=8)
EIGHT_PROCESS_PLANS = {
    "tp_8_4_2_1": ParallelPlan(
        world_size=8,
        layers=(S(tp=8), S(tp=4, dp_type="zero3"), S(tp=2, dp_type="zero2", recompute=True), S(tp=1)),
        vocab=S(tp=2),
    ),
    "mixed_sequence_parallel": ParallelPlan(
        world_size=8,
        layers=(
            S(tp=2, sp="megatron", dp_type="zero3"),
            S(tp=4, sp="ulysses", recompute=True),
            S(tp=8, sp="megatron", dp_type="zero2"),
            S(tp=2, sp="ulysses", tp_consecutive=False, dp_type="zero3"),
        ),
        vocab=S(tp=4),
    ),
}


@pytest.mark.parametrize("name", list(EIGHT_PROCESS_PLANS))
def test_eight_processes(pools, name):
    expected = run_single(model_kwargs=EIGHT_HEADS)
    result = pools(8).run(run_distributed, EIGHT_PROCESS_PLANS[name], model_kwargs=EIGHT_HEADS)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_hugging_face_gpt2_heterogeneous(pools):
    """GPT-2's fused q/k/v Conv1D, tied embedding/head under vocabulary parallelism."""
    plan = HETEROGENEOUS_MIXED_LAYOUTS
    expected = run_single(model=hf_gpt2)
    result = pools(4).run(run_distributed, plan, model=hf_gpt2)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_hugging_face_llama_heterogeneous(pools):
    """Llama with grouped-query attention (2 key/value heads: tp up to 2)."""
    plan = HETEROGENEOUS.replace(layers=(*HETEROGENEOUS.layers[:2], S(tp=2, dp_type="zero2"), HETEROGENEOUS.layers[3]))
    expected = run_single(model=hf_llama)
    result = pools(4).run(run_distributed, plan, model=hf_llama)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_degree_that_splits_a_head_is_refused(pools):
    plan = HETEROGENEOUS  # block 2 has tp=4 but the Llama config has 2 key/value heads
    with pytest.raises(
        AssertionError,
        match=r"layers\[2\]: LlamaDecoderLayer cannot run tp=4, sp='none': "
        r"degree 4 does not divide the 2 key/value heads",
    ):
        pools(4).run(run_distributed, plan, model=hf_llama)
