"""Parity of data-parallel plans (DDP, ZeRO-2, ZeRO-3, recompute mixed per block) on 4 processes.

Each distributed run is compared with a single-process run on the same global batches: the loss
at every step, the first step's gradients and every parameter after 3 AdamW steps (lr 1e-2).

Tolerances: fp32 runs differ only in the order of floating-point sums: losses 1e-5, gradients 1e-3
of their RMS, parameters 1e-4 (1% of one Adam step at lr 1e-2: Adam divides by the gradient's RMS,
which amplifies rounding in the few gradients that are nearly zero). bf16-mixed is compared with the single-process
bf16-mixed run (autocast); both round to 8 mantissa bits, in different places (per-rank partial gradients are
rounded before the fp32 reduction), so: losses 1e-2, gradients 0.15 of their RMS, parameters 3e-3
on average per tensor and 5e-2 at most (Adam moves a weight by up to lr per step whatever its
gradient's size, so a near-zero gradient rounded to the other sign moves it the other way). The
bf16 model has no biases, whose key-projection gradient is zero up to rounding.
"""

from __future__ import annotations

import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.training import assert_close_runs, run_distributed, run_single

MIXED_DP_PLAN = ParallelPlan(
    world_size=4,
    layers=(
        S(dp_type="zero3"),
        S(dp_type="zero2", recompute=True),
        S(dp_type="ddp"),
        S(dp_type="zero3", recompute=True),
    ),
    vocab=S(dp_type="zero2"),
)

pytestmark = pytest.mark.timeout(600)


FP32_TOL = dict(loss_tol=1e-5, param_rtol=2e-2, param_mean_rtol=2e-3, grad_rtol=1e-3)
BF16_TOL = dict(loss_tol=1e-2, param_rtol=3.0, param_mean_rtol=0.25, grad_rtol=0.15)


def test_mixed_dp_types_and_recompute_match_single_process_fp32(pools):
    expected = run_single()
    result = pools(4).run(run_distributed, MIXED_DP_PLAN)[0]
    assert_close_runs(result, expected, **FP32_TOL)


def test_mixed_dp_types_and_recompute_match_single_process_bf16_mixed(pools):
    model = dict(bias=False)
    expected = run_single(precision="bf16-mixed", model_kwargs=model)
    result = pools(4).run(run_distributed, MIXED_DP_PLAN, precision="bf16-mixed", model_kwargs=model)[0]
    assert_close_runs(result, expected, **BF16_TOL)
