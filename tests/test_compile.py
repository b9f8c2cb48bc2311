"""``GalvatronStrategy(compile=...)``: blocks compiled per block train as uncompiled ones do (issue 16).

Compiled with ``backend="aot_eager"``: the graphs Dynamo captures and AOTAutograd's forward/backward split
(where recomputation and graph selection can go wrong) without Inductor's C++ code generation, which takes
about 25 s per graph on this CPU. A counting backend proves the blocks did run compiled.
"""

from __future__ import annotations

import pytest
import torch

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.plan.rules import compile_problem
from lightning_galvatron.runtime.compile import compile_options
from tests.helpers.hf_models import hf_llama
from tests.helpers.training import assert_close_runs, run_distributed, run_single
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(900)

# Every per-block kind on 2 processes: ZeRO-3, Megatron-SP with recomputation, Ulysses with ZeRO-2, DDP recomputed.
MIXED = ParallelPlan(
    world_size=2,
    layers=(
        S(dp_type="zero3"),
        S(tp=2, sp="megatron", recompute=True),
        S(tp=2, sp="ulysses", dp_type="zero2"),
        S(recompute=True),
    ),
)
PIPELINE = ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2)
# Hugging Face blocks get a KV cache in training too, which their recomputation cannot have (see runtime/compile.py).
RECOMPUTED = ParallelPlan.uniform(2, 4, S(recompute=True), vocab=S())


def _compiled_run(plan: ParallelPlan, **kwargs: object) -> tuple:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # workers are reused: compile afresh, within Dynamo's recompile limit
    counter = CompileCounterWithBackend("aot_eager")
    result = run_distributed(plan, strategy_kwargs={"compile": {"backend": counter}}, **kwargs)
    return result, counter.frame_count


@pytest.mark.parametrize(("plan", "validate"), [(MIXED, True), (PIPELINE, False)], ids=["mixed_kinds", "pipeline"])
def test_compiled_blocks_train_as_uncompiled_ones(pools, plan, validate):
    expected = run_single(validate=validate)
    result, graphs = pools(2).run(_compiled_run, plan, validate=validate)[0]
    assert graphs >= 1
    assert_close_runs(result, expected, **FP32_TOL)
    if validate:  # evaluation after fit reuses the compiled model (graphs without gradients)
        assert result.val_loss == pytest.approx(expected.val_loss, abs=1e-5)


def test_compiled_hugging_face_blocks_with_recomputation(pools):
    expected = run_single(model=hf_llama)
    result, graphs = pools(2).run(_compiled_run, RECOMPUTED, model=hf_llama)[0]
    assert graphs >= 1
    assert_close_runs(result, expected, **FP32_TOL)


def test_compile_arguments_are_checked_before_launch():
    assert compile_options(True) == {"dynamic": False} and compile_options(False) is None
    assert compile_options({"mode": "max-autotune"}) == {"dynamic": False, "mode": "max-autotune"}
    with pytest.raises(ValueError, match=r"compile: \['modee'\] are not arguments of torch.compile"):
        GalvatronStrategy(compile={"modee": "max-autotune"})
    with pytest.raises(ValueError, match="compile must be True, False or a dict of torch.compile arguments"):
        GalvatronStrategy(compile="inductor")
    assert compile_problem(RECOMPUTED, compile_options({"backend": "inductor"})) is None
    assert compile_problem(PIPELINE, {"dynamic": None}) is None  # no recomputation: dynamic shapes are fine
    problem = compile_problem(RECOMPUTED, compile_options({"dynamic": None}))
    assert problem is not None and problem.startswith(
        "compile={'dynamic': None} with recomputation (layers [0, 1, 2, 3])"
    )
