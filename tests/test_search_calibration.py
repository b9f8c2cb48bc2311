"""Calibration of the cost model from measured steps: the fit inverts the model, the search uses it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.search import evaluate, search
from lightning_galvatron.search.calibration import (
    BLOCK_TERMS,
    CALIBRATION_VERSION,
    BlockTiming,
    Calibration,
    Observation,
    _analytic_parts,
    _arrays,
    block_features,
    fit_calibration,
    nonnegative_least_squares,
)
from lightning_galvatron.search.cost import CostModel
from lightning_galvatron.search.pipeline import step_span
from tests.test_search_cost import tiny_profile

PRECISION = "32-true"
TRUTH = Calibration(
    block={
        "compute": 1.5,
        "compute_tensor_parallel": 2.0,
        "compute_ulysses": 1.2,
        "recompute": 2.2,
        "communication": 1.3,
        "call": 2e-3,
        "zero2": 1e-3,
        "zero3": 2e-3,
        "tensor_parallel": 8e-3,
        "megatron_sp": 1e-3,
        "ulysses": 3e-3,
        "recompute_call": 4e-3,
    },
    optimizer_s_per_tensor=5e-4,
    optimizer_s_per_element=2e-9,
    optimizer_s_per_dtensor=1.5e-3,
    tensors_per_layer_type={"block": 12},
    vocab_tensors=3,
)
PROBE = ParallelPlan(
    4,
    (
        S(),
        S(dp_type="zero2"),
        S(dp_type="zero3", recompute=True),
        S(tp=2, dp_type="zero2"),
        S(tp=4),
        S(tp=2, sp="megatron"),
        S(tp=4, sp="ulysses"),
        S(dp_type="zero3"),
    ),
    global_batch_size=16,
)


def synthetic_observations(profile, truth: Calibration, plans, step_overhead: float = 0.02) -> list[Observation]:
    """What a rank would measure if the machine behaved exactly as ``truth`` says (the fit's inverse problem)."""
    cm = CostModel(profile, PRECISION)
    out = []
    for plan in plans:
        parts = _analytic_parts(cm, plan)
        n = plan.devices_per_stage
        for rank in range(plan.world_size):
            stage = rank // n
            timings, block_time, tensors, dtensors, elements = [], 0.0, 0, 0, 0
            for i in plan.stage_layers(stage):
                forward, beta, analytic, relocation, s = parts.blocks[i]
                call = (
                    float(
                        block_features(np.array([forward]), beta, np.array([analytic]), _arrays([s]))[0]
                        @ truth.coefficients
                    )
                    + relocation
                )
                timings.append(BlockTiming(i, 0.4 * call, 0.6 * call, plan.micro_batches, parameter_tensors=12))
                block_time += call * plan.micro_batches
                tensors += 12
                dtensors += 12 if s.dp_type != "ddp" or s.splits_weights else 0  # ZeRO shards, TP splits
                weights = profile.model.layer_types[0].parameters / (s.tp if s.splits_weights else 1)
                elements += weights / (n // s.tp) if s.dp_type != "ddp" else weights
            tensors += truth.vocab_tensors
            optimizer = float(
                truth.optimizer_time(tensors - dtensors, elements) + truth.optimizer_s_per_dtensor * dtensors
            )
            forward_backward = block_time  # the embedding/head of the tiny profile cost nothing measurable
            out.append(
                Observation(
                    plan,
                    rank,
                    forward_backward + optimizer + step_overhead,
                    forward_backward,
                    optimizer,
                    tensors,
                    int(elements),
                    tuple(timings),
                    optimizer_dtensors=dtensors,
                )
            )
    return out


def test_nonnegative_least_squares_solves_and_clips():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (30, 4))
    x = np.array([1.0, 0.5, 0.0, 2.0])
    np.testing.assert_allclose(nonnegative_least_squares(a, a @ x), x, atol=1e-9)
    y = a @ np.array([1.0, -1.0, 0.5, 0.0])  # the unconstrained optimum has a negative coefficient
    solution = nonnegative_least_squares(a, y)
    assert (solution >= 0).all() and solution[1] == 0.0
    assert (
        np.linalg.norm(a @ solution - y)
        <= np.linalg.norm(a @ np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 0, None) - y) + 1e-12
    )


@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan.uniform(4, 4, S(), global_batch_size=16),
        ParallelPlan.uniform(
            4, 4, S(tp=2, sp="megatron", dp_type="zero3", recompute=True), vocab=S(tp=2), global_batch_size=16
        ),
        ParallelPlan.uniform(4, 4, S(dp_type="zero2"), pp=2, micro_batches=4, global_batch_size=16),
    ],
)
def test_identity_calibration_is_the_uncalibrated_model(plan):
    profile = tiny_profile(alpha=1.3)
    plain = evaluate(profile, plan, precision=PRECISION)
    calibrated = evaluate(profile, plan, precision=PRECISION, calibration=Calibration())
    assert calibrated.step_time_s == pytest.approx(plain.step_time_s, rel=1e-12)
    assert calibrated.peak_memory_bytes == plain.peak_memory_bytes


def test_fit_recovers_the_machine_and_predicts_unseen_plans():
    profile = tiny_profile(alpha=1.3).with_num_blocks(8)
    # The pipeline's stages differ in how many of their tensors are DTensors (plain: S() and Ulysses with DDP),
    # so the optimizer's per-tensor costs can be told apart.
    staged = (
        S(),
        S(tp=2, sp="ulysses"),
        S(dp_type="zero2"),
        S(dp_type="zero3", recompute=True),
        S(tp=2, dp_type="zero2"),
        S(tp=2),
        S(tp=2, sp="megatron"),
        S(dp_type="zero3"),
    )
    probes = [
        PROBE,
        PROBE.replace(micro_batches=4),
        ParallelPlan(4, staged, pp=2, micro_batches=4, global_batch_size=16),
    ]
    fitted = fit_calibration(profile, synthetic_observations(profile, TRUTH, probes), precision=PRECISION)
    assert fitted.residual < 1e-6
    for term in BLOCK_TERMS:
        assert fitted.block[term] == pytest.approx(TRUTH.block[term], rel=1e-4, abs=1e-9), term
    assert fitted.optimizer_s_per_tensor == pytest.approx(TRUTH.optimizer_s_per_tensor, rel=1e-4)
    assert fitted.optimizer_s_per_dtensor == pytest.approx(TRUTH.optimizer_s_per_dtensor, rel=1e-4)
    assert fitted.optimizer_s_per_element == pytest.approx(TRUTH.optimizer_s_per_element, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(0.02, rel=1e-6)
    assert fitted.pipeline_overhead_s == pytest.approx(0.0, abs=1e-9)
    # A plan none of the probes ran, priced with the fitted terms, is what the machine would measure.
    unseen = ParallelPlan(
        4,
        (S(tp=2, sp="megatron", dp_type="zero3", recompute=True),) * 4 + (S(dp_type="zero2"),) * 4,
        global_batch_size=16,
    )
    (truth,) = {o.step_s for o in synthetic_observations(profile, TRUTH, [unseen], step_overhead=0.02)}
    assert evaluate(profile, unseen, precision=PRECISION, calibration=fitted).step_time_s == pytest.approx(
        truth, rel=1e-3
    )


def test_a_costly_mechanism_steers_the_search_away():
    profile = tiny_profile(alpha=1.0).with_num_blocks(8)
    fast_tp = dataclasses.replace(TRUTH, block={**TRUTH.block, "tensor_parallel": 0.0, "compute_tensor_parallel": 0.1})
    slow_tp = dataclasses.replace(TRUTH, block={**TRUTH.block, "tensor_parallel": 1.0})
    chosen_fast = search(profile, 4, "1GB", global_batch_size=16, precision=PRECISION, calibration=fast_tp).plan
    chosen_slow = search(profile, 4, "1GB", global_batch_size=16, precision=PRECISION, calibration=slow_tp).plan
    assert any(s.splits_weights for s in chosen_fast.layers)
    assert not any(s.splits_weights for s in (*chosen_slow.layers, chosen_slow.vocab))


def test_calibration_json_round_trip(tmp_path):
    path = tmp_path / "calibration.json"
    TRUTH.save(path)
    assert Calibration.load(path) == TRUTH
    # A file of version 1 (before the DDP reduction term) loads without it; a newer version is refused by name.
    old = {k: v for k, v in TRUTH.to_dict().items() if k != "ddp_reduction_s"}
    assert Calibration.from_dict({**old, "version": 1}) == TRUTH
    with pytest.raises(ValueError, match="newer than this lightning_galvatron understands"):
        Calibration.from_dict({**old, "version": CALIBRATION_VERSION + 1})
    with pytest.raises(ValueError, match="unknown block terms"):
        Calibration(block={"warp_speed": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        Calibration(step_overhead_s=-1.0)


def test_shared_cores_speed_up_pipeline_stages_only():
    shared = Calibration(compute_slots_per_node=2)
    assert shared.sharing_factor(pp=1, micro_batches=4, ranks_per_node=4) == 1.0
    assert Calibration().sharing_factor(pp=4, micro_batches=4, ranks_per_node=4) == 1.0  # a device per rank
    # GPipe/1F1B keep a stage busy m / (m + pp - 1) of the step: 4 ranks busy 4/7 of it share 2 cores.
    assert shared.sharing_factor(pp=4, micro_batches=4, ranks_per_node=4) == pytest.approx(4 / 7)
    assert shared.sharing_factor(pp=4, micro_batches=1, ranks_per_node=4) == pytest.approx(
        0.5
    )  # one busy rank: a whole core
    # Interleaving shortens fill and drain: 4 micro-batches in a step of 4 + 3/2 of them, or 2 + 1/2 with m < pp.
    assert shared.sharing_factor(pp=4, micro_batches=4, ranks_per_node=4, virtual_stages=2) == pytest.approx(4 / 5.5)
    profile = tiny_profile().with_num_blocks(8)
    plan = ParallelPlan.uniform(4, 8, S(), pp=4, micro_batches=4, schedule="gpipe", global_batch_size=16)
    busy = dataclasses.replace(TRUTH, compute_slots_per_node=None)
    idle = dataclasses.replace(TRUTH, compute_slots_per_node=2)
    assert (
        evaluate(profile, plan, precision=PRECISION, calibration=idle).step_time_s
        < evaluate(profile, plan, precision=PRECISION, calibration=busy).step_time_s
    )


def test_the_trials_tell_whether_waiting_pipeline_stages_leave_their_cores_to_the_busy_ones():
    """On 4 processes sharing 2 cores the calls of pipeline stages measured as slow as without a pipeline (waiting
    ranks kept their cores), and assuming the sharing priced pipelines 10-30% fast: the fit keeps it only where the
    trials' block calls show it."""
    profile = tiny_profile(alpha=1.3).with_num_blocks(8)
    plans = [
        ParallelPlan.uniform(4, 8, S(), global_batch_size=16),
        ParallelPlan.uniform(4, 8, S(dp_type="zero2"), global_batch_size=16),
        ParallelPlan.uniform(4, 8, S(), pp=2, micro_batches=2, schedule="gpipe", global_batch_size=16),
    ]
    shared = Calibration(compute_slots_per_node=2)

    def observed(sharing: bool) -> list:
        out = []
        for obs in synthetic_observations(profile, TRUTH, plans):
            plan = obs.plan
            factor = shared.sharing_factor(plan.pp, plan.micro_batches, 4, plan.virtual_stages) if sharing else 1.0
            blocks = tuple(
                dataclasses.replace(t, forward_s=t.forward_s * factor, backward_s=t.backward_s * factor)
                for t in obs.blocks
            )
            out.append(dataclasses.replace(obs, blocks=blocks, compute_slots=2))
        return out

    assert observed(True)[-1].blocks[0].call_s < observed(False)[-1].blocks[0].call_s  # the pipeline's calls differ
    for sharing, slots in ((True, 2), (False, None)):
        fitted = fit_calibration(profile, observed(sharing), precision=PRECISION)
        assert fitted.compute_slots_per_node == slots
        assert fitted.residual == pytest.approx(0.0, abs=1e-6)  # every call explained, the pipeline's too


def test_a_prior_decides_what_the_observations_cannot_and_moves_the_rest_little():
    profile = tiny_profile(alpha=1.3).with_num_blocks(8)
    # Trials of DDP and ZeRO plans at one batch size: no Ulysses or Megatron block was measured.
    plans = [
        ParallelPlan.uniform(4, 8, S(), global_batch_size=16),
        ParallelPlan.uniform(4, 8, S(dp_type="zero3"), global_batch_size=16),
        ParallelPlan.uniform(4, 8, S(tp=2), global_batch_size=16),
    ]
    observations = synthetic_observations(profile, TRUTH, plans)
    prior = dataclasses.replace(
        TRUTH,
        block={**TRUTH.block, "ulysses": 0.004, "megatron_sp": 0.002, "zero3": 2 * TRUTH.block["zero3"]},
        optimizer_s_per_element=7e-9,
    )
    alone = fit_calibration(profile, observations, precision=PRECISION)
    guided = fit_calibration(profile, observations, precision=PRECISION, prior=prior)
    assert alone.block["ulysses"] == 0.0 and alone.block["megatron_sp"] == 0.0  # no column: nothing to fit
    assert guided.block["ulysses"] == pytest.approx(0.004) and guided.block["megatron_sp"] == pytest.approx(0.002)
    # One batch size leaves compute and per-call time interchangeable: alone, the fit puts it all per call;
    # the prior keeps the compute scale it knows.
    assert alone.block["compute"] == pytest.approx(0.0, abs=1e-6)
    assert guided.block["compute"] == pytest.approx(TRUTH.block["compute"], rel=0.01)
    # The measured plans are priced as without the prior (its wrong ZeRO-3 term does not win over the data).
    assert guided.block["zero3"] < 1.9 * TRUTH.block["zero3"]
    for plan in plans:
        priced = evaluate(profile, plan, precision=PRECISION, calibration=guided).step_time_s
        assert priced == pytest.approx(
            evaluate(profile, plan, precision=PRECISION, calibration=alone).step_time_s, rel=0.02
        )


def test_the_embedding_and_head_split_between_compute_and_calls_only_where_the_trials_tell():
    """Trials with micro-batches of one size cannot tell the embedding/head's compute from its per-call time: the
    per-call time stays the prior's (fitted both ways, all of it went per call and a plan of 4 micro-batches paid
    the head 4 times). Micro-batches of two sizes tell them apart."""
    profile = tiny_profile(alpha=1.3).with_num_blocks(8)
    cm = CostModel(profile, PRECISION)
    call = 0.002  # the machine's embedding/head: twice the analytic compute and 2 ms per micro-batch

    def observed(plans):
        out = []
        for obs in synthetic_observations(profile, TRUTH, plans):
            parts = _analytic_parts(cm, obs.plan)  # its communication as modelled
            outside = obs.plan.micro_batches * (2.0 * parts.vocab_compute + call + parts.vocab_communication)
            out.append(
                dataclasses.replace(
                    obs, step_s=obs.step_s + outside, forward_backward_s=obs.forward_backward_s + outside
                )
            )
        return out

    one_size = [
        ParallelPlan.uniform(4, 8, S(), global_batch_size=16),
        ParallelPlan.uniform(4, 8, S(dp_type="zero3"), global_batch_size=16),
    ]
    prior = dataclasses.replace(TRUTH, vocab_compute=1.5, vocab_call_s=0.0)
    fitted = fit_calibration(profile, observed(one_size), precision=PRECISION, prior=prior)
    assert fitted.vocab_call_s == 0.0
    measured = 2.0 * _analytic_parts(cm, one_size[0]).vocab_compute + call
    assert fitted.vocab_compute * _analytic_parts(cm, one_size[0]).vocab_compute == pytest.approx(measured, rel=0.01)

    two_sizes = [*one_size, ParallelPlan.uniform(4, 8, S(), micro_batches=4, global_batch_size=16)]
    fitted = fit_calibration(profile, observed(two_sizes), precision=PRECISION, prior=prior)
    assert fitted.vocab_compute == pytest.approx(2.0, rel=0.1)
    assert fitted.vocab_call_s == pytest.approx(call, rel=0.1)
    assert fitted.ddp_reduction_s == pytest.approx(0.0, abs=1e-4)  # the plans differ in DDP, which added nothing


def test_the_trials_measure_the_ddp_reduction_a_backward_leaves_exposed():
    """DDP's last buckets are summed after backward (outside every block's timing), once per step: plans with and
    without DDP blocks, or with DDP over different micro-batches, tell that time per reduced block from the
    embedding/head's; the calibrated model then prices it once per step and reduced block, pipeline stages too.
    Plans that all reduce the same blocks per micro-batch cannot tell it: it stays the prior's."""
    profile = tiny_profile(alpha=1.3).with_num_blocks(8)
    cm = CostModel(profile, PRECISION)
    reduction = 0.003  # per DDP block and step

    def observed(plans):
        out = []
        for obs in synthetic_observations(profile, TRUTH, plans):
            parts = _analytic_parts(cm, obs.plan)
            outside = obs.plan.micro_batches * (2.0 * parts.vocab_compute + parts.vocab_communication)
            outside += reduction * parts.reduced_blocks[0]
            out.append(
                dataclasses.replace(
                    obs, step_s=obs.step_s + outside, forward_backward_s=obs.forward_backward_s + outside
                )
            )
        return out

    ddp, zero3 = S(), S(dp_type="zero3")
    mixed = [
        ParallelPlan.uniform(4, 8, ddp, global_batch_size=16),
        ParallelPlan.uniform(4, 8, zero3, global_batch_size=16),
    ]
    prior = dataclasses.replace(TRUTH, vocab_compute=1.5, ddp_reduction_s=0.0)
    fitted = fit_calibration(profile, observed(mixed), precision=PRECISION, prior=prior)
    assert fitted.ddp_reduction_s == pytest.approx(reduction, rel=0.05)
    assert fitted.vocab_compute == pytest.approx(2.0, rel=0.05)

    # Priced once per step and reduced block, carried per micro-batch as every per-step term (the optimizer's) is:
    # a plan of 4 micro-batches and each stage of a pipeline alike.
    with_reduction = dataclasses.replace(TRUTH, ddp_reduction_s=reduction)
    for plan, reduced in (
        (ParallelPlan.uniform(4, 8, ddp, micro_batches=4, global_batch_size=16), [8]),
        (ParallelPlan.uniform(4, 8, zero3, global_batch_size=16), [0]),
        (ParallelPlan.uniform(4, 8, ddp, pp=2, micro_batches=2, schedule="gpipe", global_batch_size=16), [4, 4]),
        (ParallelPlan.uniform(4, 8, S(tp=4), global_batch_size=16), [0]),  # no replicas: nothing to sum
    ):
        base = evaluate(profile, plan, precision=PRECISION, calibration=TRUTH).stages
        priced = evaluate(profile, plan, precision=PRECISION, calibration=with_reduction).stages
        added = [p.time_per_micro_batch_s - b.time_per_micro_batch_s for p, b in zip(priced, base)]
        span = step_span(plan.pp, plan.micro_batches, plan.virtual_stages)  # the step counts it once
        assert added == pytest.approx([reduction * r / span for r in reduced], abs=1e-12), plan

    same = [
        ParallelPlan.uniform(4, 8, ddp, global_batch_size=16),
        ParallelPlan.uniform(4, 8, S(recompute=True), global_batch_size=16),
    ]
    kept = fit_calibration(
        profile, observed(same), precision=PRECISION, prior=dataclasses.replace(prior, ddp_reduction_s=0.002)
    )
    assert kept.ddp_reduction_s == 0.002
