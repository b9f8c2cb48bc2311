"""bf16 parity (issue 12): tensor parallelism, Megatron-SP, Ulysses and a pipeline in ``bf16-mixed``, and a
``bf16-true`` plan, each against one process in the same precision.

Tolerances are ``BF16_TOL`` of test_parity_data_parallel (losses 1e-2; first-step gradients 0.15 of
their RMS; parameters relative to how far training moved them). They are not so loose that a lost
reduction passes: ``test_bf16_tolerance_catches_a_missing_gradient_sum`` trains the tensor-parallel
plan with one block's data-parallel gradients left unsummed and requires the comparison to fail.
"""

from __future__ import annotations

import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.training import assert_close_runs, run_distributed, run_single
from tests.test_parity_data_parallel import BF16_TOL
from tests.test_parity_tensor_parallel import HETEROGENEOUS
from tests.test_pipeline import PP2_TP2

pytestmark = pytest.mark.timeout(600)

NO_BIAS = dict(bias=False)  # a key projection's bias has a gradient that is zero up to rounding (see BF16_TOL)
PLANS = {
    "tp_heterogeneous": HETEROGENEOUS,
    "megatron_sp2": ParallelPlan.uniform(4, 4, S(tp=2, sp="megatron", dp_type="zero2"), vocab=S()),
    "ulysses2": ParallelPlan.uniform(4, 4, S(tp=2, sp="ulysses"), vocab=S()),
    "pp2_tp2_zero3": PP2_TP2,
}
_REFERENCE: dict[str, object] = {}


def _single(precision: str):
    if precision not in _REFERENCE:
        _REFERENCE[precision] = run_single(precision=precision, model_kwargs=NO_BIAS)
    return _REFERENCE[precision]


@pytest.mark.parametrize("name", list(PLANS))
def test_bf16_mixed_matches_one_process(pools, name):
    result = pools(4).run(run_distributed, PLANS[name], precision="bf16-mixed", model_kwargs=NO_BIAS)[0]
    assert_close_runs(result, _single("bf16-mixed"), **BF16_TOL)


def test_bf16_true_matches_one_process(pools):
    plan = ParallelPlan(
        world_size=4,
        layers=(S(tp=2, dp_type="zero3"), S(tp=2, sp="megatron"), S(dp_type="zero2", recompute=True), S(tp=4)),
        vocab=S(tp=2),
    )
    result = pools(4).run(run_distributed, plan, precision="bf16-true", model_kwargs=NO_BIAS)[0]
    assert_close_runs(result, _single("bf16-true"), **BF16_TOL)


def _without_summing_one_block(plan: ParallelPlan) -> object:
    """Train with the first block's DDP gradients left unsummed over its data-parallel group."""
    from lightning_galvatron.runtime.gradient_sync import GradientReducer

    add = GradientReducer.add
    calls = []

    def add_without_the_first_group(self, params, group, reduce_last=False):
        calls.append(reduce_last)
        return add(self, params, None if calls.count(False) == 1 and not reduce_last else group, reduce_last)

    GradientReducer.add = add_without_the_first_group
    try:
        return run_distributed(plan, precision="bf16-mixed", model_kwargs=NO_BIAS, check_plan=False)
    finally:
        GradientReducer.add = add


def test_bf16_tolerance_catches_a_missing_gradient_sum(pools):
    plan = ParallelPlan.uniform(4, 4, S(tp=2))  # dp=2 per block, DDP
    broken = pools(4).run(_without_summing_one_block, plan)[0]
    expected = _single("bf16-mixed")
    with pytest.raises(AssertionError, match="error"):  # parameters of every block, through block 0's wrong update
        assert_close_runs(broken, expected, **BF16_TOL)
    with pytest.raises(AssertionError, match="gradient of model.blocks.0"):  # the gradient check alone sees it too
        assert_close_runs(broken, expected, **{**BF16_TOL, "param_rtol": float("inf"), "param_mean_rtol": float("inf")})
