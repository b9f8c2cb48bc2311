"""Cost-model terms against hand-computed values on a tiny profile with round numbers."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError
from lightning_galvatron.profiles import (
    CollectiveFit,
    DegreeTable,
    HardwareProfile,
    LayerTypeProfile,
    LinearFit,
    ModelProfile,
    Profile,
    VocabProfile,
)
from lightning_galvatron.search.cost import (
    CostModel,
    StageContext,
    accumulates_unsharded_gradients,
    activation_bytes,
    block_costs,
    data_parallel_comm_times,
    model_state_bytes,
    optimizer_state_bytes,
    overlap_time,
    ranks_per_node,
    relocation_time,
    resolve_precision,
    tensor_parallel_comm_time,
)
from lightning_galvatron.search.estimate import evaluate
from lightning_galvatron.search.pipeline import (
    in_flight_micro_batches,
    p2p_transfers,
    pipeline_step_time,
    schedule_overhead,
)
from lightning_galvatron.search.space import Layout, StrategyArrays

P = 1_000_000
S, H = 16, 64
BW = 1e9


def tiny_profile(alpha: float = 1.0) -> Profile:
    layer = LayerTypeProfile(
        name="block",
        parameters=P,
        hidden_size=H,
        num_heads=8,
        ffn_hidden_size=256,
        seq_length=S,
        forward_time=LinearFit(0.0, 1e-3),
        activation_bytes_per_sample=DegreeTable(((1, 1000.0), (2, 500.0), (4, 250.0), (8, 125.0))),
        recompute_activation_bytes_per_sample=100.0,
        replicated_activation_bytes_per_sample=200.0,
    )
    vocab = VocabProfile(
        vocab_size=1024,
        embedding_parameters=2000,
        head_parameters=3000,
        embedding_forward_time=LinearFit(0.0, 0.0),
        head_forward_time=LinearFit(0.0, 1e-4),
        embedding_activation_bytes_per_sample=DegreeTable(((1, 10.0),)),
        head_activation_bytes_per_sample=DegreeTable(((1, 40.0),)),
    )
    model = ModelProfile("tiny", (layer,), (0,) * 4, vocab, hidden_size=H, seq_length=S)
    hardware = HardwareProfile("flat", 8, alpha, tuple(CollectiveFit("all_reduce", g, g, 0.0, BW) for g in (2, 4, 8)))
    return Profile(model, hardware)


def arrays(*strategies: LayerStrategy) -> StrategyArrays:
    return StrategyArrays.build(strategies)


def test_precision_and_optimizer_bytes():
    mixed = resolve_precision("bf16-mixed")
    assert (mixed.param_bytes, mixed.grad_bytes, mixed.compute_bytes, mixed.reduce_bytes) == (4, 4, 2, 4)
    assert optimizer_state_bytes("adamw", mixed) == 8
    assert optimizer_state_bytes("sgd-momentum", mixed) == 4
    assert optimizer_state_bytes("sgd", mixed) == 0
    assert optimizer_state_bytes("adamw", resolve_precision("bf16-true")) == 4
    assert optimizer_state_bytes(6.0, mixed) == 6.0
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_state_bytes("lion", mixed)
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_precision("fp8")


def test_model_states_per_dp_type():
    cm = CostModel(tiny_profile())
    ctx = StageContext(world_size=8, pp=1, global_batch=8, micro_batches=1)
    sa = arrays(
        LayerStrategy(),  # ddp, d = 8
        LayerStrategy(dp_type="zero2"),
        LayerStrategy(dp_type="zero3"),
        LayerStrategy(tp=2, sp="megatron", dp_type="zero3"),  # weights / 2, d = 4
        LayerStrategy(tp=2, sp="ulysses", dp_type="zero3"),  # weights whole, d = 4
    )
    full = P * (4 + 4 + 8)
    # DDP: autocast's bf16 copy of the weights; ZeRO-2: the gathered bf16 weights.
    expected = [full + 2 * P, full / 8 + 2 * P, full / 8, full / 2 / 4, full / 4]
    assert np.allclose(model_state_bytes(cm, sa, ctx, P), expected)
    # The runtime reduces gradients after every micro-batch, pipelined or not: they stay sharded.
    piped = StageContext(world_size=8, pp=2, global_batch=8, micro_batches=2)
    assert not accumulates_unsharded_gradients(2, 2) and not accumulates_unsharded_gradients(1, 4)
    states = model_state_bytes(cm, arrays(LayerStrategy(dp_type="zero3"), LayerStrategy()), piped, P)
    assert np.allclose(states, [full / 4, full + 2 * P])


def test_activations_recompute_and_tp_without_sp():
    cm = CostModel(tiny_profile())
    sa = arrays(
        LayerStrategy(),
        LayerStrategy(recompute=True),
        LayerStrategy(tp=2, sp="megatron"),
        LayerStrategy(tp=2, sp="megatron", recompute=True),
        LayerStrategy(tp=2, sp="none"),
    )
    b = np.array([2.0, 2.0, 4.0, 4.0, 4.0])
    got = activation_bytes(cm, sa, b, DegreeTable(((1, 1000.0), (2, 500.0))).at, 100.0, 200.0)
    assert np.allclose(got, [2000, 200, 2000, 200, 4 * (500 + 0.5 * 200)])
    # The profile was measured in bf16; with fp32 compute the activations double.
    fp32 = CostModel(tiny_profile(), "32-true")
    assert np.allclose(
        activation_bytes(fp32, arrays(LayerStrategy()), np.array([1.0]), lambda g: 1000.0, 0.0, 0.0), [2000]
    )


def test_overlap_and_ranks_per_node():
    assert overlap_time(3.0, 1.0, 1.0) == 3.0
    assert overlap_time(3.0, 1.0, 1.2) == pytest.approx(3.2)
    assert ranks_per_node(4, 1, 8, 64) == 4
    assert ranks_per_node(8, 4, 8, 64) == 2
    assert ranks_per_node(8, 8, 8, 64) == 1
    assert ranks_per_node(8, 4, 8, 8) == 8  # the whole world is one node


def test_tensor_parallel_communication():
    cm = CostModel(tiny_profile())
    ctx = StageContext(world_size=2, pp=1, global_batch=4, micro_batches=1)
    sa = arrays(
        LayerStrategy(tp=2, sp="none"),
        LayerStrategy(tp=2, sp="megatron"),
        LayerStrategy(tp=2, sp="ulysses"),
        LayerStrategy(tp=2, sp="none", recompute=True),
    )
    b = np.full(4, 4.0)
    message = 4 * S * H * 2
    all_reduce = 2 * (1 / 2) * message / BW
    got = tensor_parallel_comm_time(cm, sa, ctx, b, H, S, 2, 2, 4)
    # Megatron: 2 all-reduces per pass, forward and backward; SP: all-gather + reduce-scatter (same volume);
    # Ulysses: 4 all-to-alls of the rank's half per pass (all-to-all falls back to all-reduce bandwidth);
    # recompute repeats the forward's.
    a2a = (1 / 2) * (message / 2) / BW
    assert np.allclose(got, [4 * all_reduce, 4 * all_reduce, 8 * a2a, 6 * all_reduce])
    assert tensor_parallel_comm_time(cm, arrays(LayerStrategy()), ctx, b[:1], H, S, 2, 2, 4)[0] == 0.0


def test_data_parallel_communication_and_step_extra():
    cm = CostModel(tiny_profile())
    ctx = StageContext(world_size=4, pp=1, global_batch=4, micro_batches=1)
    sa = arrays(LayerStrategy(), LayerStrategy(dp_type="zero2"), LayerStrategy(dp_type="zero3"))
    forward, backward, per_step = data_parallel_comm_times(cm, sa, ctx, P)
    gather = (3 / 4) * P * 2 / BW
    scatter = (3 / 4) * P * 4 / BW
    reduce = 2 * (3 / 4) * P * 4 / BW
    assert np.allclose(forward, [0, gather, gather])
    # ZeRO: every micro-batch's backward reduce-scatters; DDP sums once per step, after the last micro-batch.
    assert np.allclose(backward, [0, scatter, gather + scatter])
    assert np.allclose(per_step, [reduce, 0, 0])
    costs = block_costs(cm, tiny_profile().model.layer_types[0], sa, ctx)
    f = 1e-3  # b = 4 / 4 = 1 sample at 1 ms per sample; backward 2f; overlap coefficient 1: overlap = max
    assert np.allclose(
        costs.time, [f + 2 * f, max(f, gather) + max(2 * f, scatter), max(f, gather) + max(2 * f, gather + scatter)]
    )
    assert np.allclose(costs.last_extra, [max(2 * f, reduce) - 2 * f, 0.0, 0.0])


def test_pipeline_terms():
    assert in_flight_micro_batches("gpipe", 4, 8, 0) == 8
    assert [in_flight_micro_batches("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches("1f1b", 4, 2, 0) == 2
    assert in_flight_micro_batches("interleaved_1f1b", 4, 8, 0, 2) == pytest.approx(11 / 2)
    assert in_flight_micro_batches("1f1b", 1, 8, 0) == 1
    assert [p2p_transfers(4, s) for s in range(4)] == [1, 2, 2, 1]
    assert p2p_transfers(4, 0, 2) == 3
    uniform = np.full(4, 2.0)
    assert pipeline_step_time(uniform, 8) == pytest.approx((8 + 4 - 1) * 2.0)
    assert pipeline_step_time(uniform, 8, 2) == pytest.approx(8 * 2.0 + 3 * 2.0 / 2)
    assert pipeline_step_time(np.array([np.inf]), 1) == np.inf


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 1, 1), (2, 4, 1), (4, 2, 2), (2, 2, 2), (4, 8, 2), (3, 6, 3)])
def test_schedule_overhead_is_what_each_chunk_adds_per_micro_batch(pp, m, v):
    """The inverse of pricing: a schedule adding ``x`` per micro-batch to each of a rank's ``v`` chunks, i.e. ``v x``
    to every stage's time per micro-batch, is found to add ``x`` -- by the fit from probes and trials alike."""
    times = np.linspace(1.0, 2.0, pp)
    x = 0.125
    measured = float(pipeline_step_time(times + v * x, m, v))
    assert schedule_overhead(measured, times, m, v) == pytest.approx(x)
    assert schedule_overhead(float(pipeline_step_time(times, m, v)), times, m, v) == pytest.approx(0.0, abs=1e-12)


def test_the_pipeline_overhead_is_priced_per_model_chunk():
    from lightning_galvatron.search.coefficients import Calibration

    profile = tiny_profile().with_num_blocks(8)
    x = 0.01
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        plan = ParallelPlan.uniform(
            4, 8, LayerStrategy(), pp=2, micro_batches=4, schedule=schedule, virtual_stages=v, global_batch_size=16
        )
        with_it = evaluate(profile, plan, precision="32-true", calibration=Calibration(pipeline_overhead_s=x))
        without = evaluate(profile, plan, precision="32-true", calibration=Calibration())
        times = np.array([s.time_per_micro_batch_s for s in without.stages])
        assert schedule_overhead(with_it.step_time_s, times, 4, v) == pytest.approx(x)


def test_relocation():
    cm = CostModel(tiny_profile())
    ctx = StageContext(world_size=4, pp=1, global_batch=4, micro_batches=1)
    share = 1 * S * H * 2
    plain, split2, rep2 = Layout(1, False, True), Layout(2, False, True), Layout(2, True, True)
    assert relocation_time(cm, split2, split2, ctx, H, S) == 0.0
    a2a = (1 / 2) * share / BW
    assert relocation_time(cm, plain, split2, ctx, H, S) == pytest.approx(2 * a2a)
    gather = (1 / 2) * 2 * share / BW
    assert relocation_time(cm, plain, rep2, ctx, H, S) == pytest.approx(gather)
    assert relocation_time(cm, rep2, plain, ctx, H, S) == pytest.approx(gather)


def test_evaluate_adds_up_and_checks_its_inputs():
    profile = tiny_profile()
    plan = ParallelPlan(
        world_size=4,
        layers=(LayerStrategy(dp_type="zero3"),) * 2 + (LayerStrategy(tp=2, sp="megatron"),) * 2,
        pp=2,
        micro_batches=4,
        schedule="1f1b",
        global_batch_size=8,
    )
    e = evaluate(profile, plan, memory_budget_bytes="1GB")
    assert e.fits is True and len(e.stages) == 2 and len(e.blocks) == 4
    for stage in e.stages:
        blocks = [b for b in e.blocks if b.stage == stage.stage]
        assert stage.block_state_bytes + stage.block_activation_bytes == pytest.approx(
            sum(b.memory_bytes for b in blocks)
        )
    assert e.throughput_samples_per_s == pytest.approx(8 / e.step_time_s)
    assert e.blocks[2].time_per_micro_batch_s > 0
    with pytest.raises(PlanError, match="global batch size"):
        evaluate(profile, plan.replace(global_batch_size=None))
    with pytest.raises(PlanError, match="3 layer strategies"):
        evaluate(profile, ParallelPlan.uniform(4, 3, global_batch_size=8))
    odd = ParallelPlan.uniform(6, 4, LayerStrategy(tp=3, sp="megatron"), pp=1, global_batch_size=4)
    assert any(
        "cannot run tp=3, sp='megatron': degree 3 does not divide" in w for w in evaluate(profile, odd).warnings
    )  # 3 does not divide 8 heads
    short = plan.replace(micro_batches=1, global_batch_size=4)
    assert any("micro_batches >= pp" in w for w in evaluate(profile, short).warnings)


def test_vocabulary_layers_are_never_priced_as_recomputed():
    """The runtime recomputes blocks only; a vocab strategy with ``recompute`` (e.g. from ``ParallelPlan.uniform``)
    keeps the embedding's and head's activations, as a dry run of such a plan measures."""
    profile = tiny_profile()
    plain = ParallelPlan.uniform(4, 4, LayerStrategy(recompute=True), vocab=LayerStrategy(), global_batch_size=8)
    flagged = plain.replace(vocab=LayerStrategy(recompute=True))
    assert evaluate(profile, flagged).stages[0].vocab_bytes == evaluate(profile, plain).stages[0].vocab_bytes
    assert evaluate(profile, plain).stages[0].vocab_bytes > 0
