"""Per-call overheads measured with the profile: their JSON, the calibration they give, who uses it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import (
    CallProbe,
    OptimizerProbe,
    Overheads,
    PipelineProbe,
    Profile,
    ProfileError,
    ReductionProbe,
)
from lightning_galvatron.search import evaluate, search
from lightning_galvatron.search.coefficients import BLOCK_TERMS, Calibration, block_features
from lightning_galvatron.search.cost import CostModel, StageContext, block_costs, forward_compute_time
from lightning_galvatron.search.overheads import (
    CALL_TERMS,
    COMPUTE_TERMS,
    applicable_calibration,
    profile_calibration,
)
from lightning_galvatron.search.pipeline import p2p_transfers, pipeline_step_time
from lightning_galvatron.search.space import StrategyArrays
from tests.test_search_cost import tiny_profile

PRECISION = "32-true"
TRUTH = {
    "call": 1e-3,
    "zero2": 4e-3,
    "zero3": 6e-3,
    "tensor_parallel": 2e-2,
    "megatron_sp": 3e-3,
    "ulysses": 5e-3,
    "recompute_call": 2e-3,
}
STRATEGIES = (
    S(),
    S(recompute=True),
    S(dp_type="zero2"),
    S(dp_type="zero3"),
    S(tp=2),
    S(tp=2, sp="megatron"),
    S(tp=2, sp="ulysses"),
    S(tp=4),
    S(tp=4, sp="megatron"),
)
PLAN = ParallelPlan.uniform(4, 4, S(dp_type="zero3"), global_batch_size=8)


def modelled(profile: Profile, probe: CallProbe) -> tuple[float, np.ndarray]:
    """The model's own time of the probe's block call, and its feature row."""
    layer = profile.model.layer_types[probe.layer_type]
    sa = StrategyArrays.build([probe.strategy])
    ctx = StageContext(probe.group_size, 1, probe.local_batch * probe.group_size // probe.strategy.tp, 1)
    analytic = block_costs(CostModel(profile, PRECISION), layer, sa, ctx).time
    forward = forward_compute_time(layer.forward_time, np.array([float(probe.local_batch)]), sa.tp)
    return float(analytic[0]), block_features(forward, layer.backward_to_forward, analytic, sa)[0]


def synthetic(profile: Profile, compute_slots: int | None = None) -> Profile:
    """``profile`` with the probes a machine that adds exactly :data:`TRUTH` per call would measure; with
    ``compute_slots`` cores for its 4 ranks, one that also computes ``4 / compute_slots`` times slower than the
    profile's fits (timed on a core to itself) say."""
    calls = []
    scale = max(4 / compute_slots, 1.0) if compute_slots else 1.0
    for s in STRATEGIES:
        probe = CallProbe(0, s, 4, 2, 0.0)
        base, features = modelled(profile, probe)
        extra = sum(features[BLOCK_TERMS.index(t)] * TRUTH[t] for t in CALL_TERMS)
        extra += (scale - 1) * sum(features[BLOCK_TERMS.index(t)] for t in COMPUTE_TERMS)
        calls.append(dataclasses.replace(probe, seconds=base + extra))
    optimizer = [  # 1e-4 s per tensor, 3e-4 per DTensor, 2 ns per element
        OptimizerProbe(8, n, d, 8 * (3e-4 if d else 1e-4) + 2e-9 * n) for d in (False, True) for n in (2048, 131072)
    ]
    overheads = Overheads(
        4, tuple(calls), tuple(optimizer), compute_slots=compute_slots, block_tensors=(12,), vocab_tensors=3
    )
    return dataclasses.replace(profile, overheads=overheads)


#: What the pipeline schedule of the synthetic machine adds per micro-batch and model chunk.
SCHEDULE_S = 3e-3


def with_pipelines(profile: Profile) -> Profile:
    """``profile`` (with :func:`synthetic` call probes) plus the pipeline probes of a machine whose schedules add
    :data:`SCHEDULE_S` per micro-batch and chunk to stages priced by the probes' own calibration."""
    shared = dataclasses.replace(profile_calibration(profile), compute_slots_per_node=2)
    cm = CostModel(profile, PRECISION, calibration=shared)
    layer = profile.model.layer_types[0]
    probes = []
    for schedule, v, per_chunk, micro_batch in (("1f1b", 1, 2, 2), ("interleaved_1f1b", 2, 1, 2), ("gpipe", 1, 1, 4)):
        ctx = StageContext(4, 2, micro_batch * 2 * 2, 2, 1.0, v)
        block = float(block_costs(cm, layer, StrategyArrays.build([S()]), ctx).time[0])
        times = np.array(
            [
                v * (per_chunk * block + SCHEDULE_S)
                + p2p_transfers(2, s, v) * cm.p2p_time(ctx, layer.hidden_size, layer.seq_length)
                for s in range(2)
            ]
        )
        seconds = float(pipeline_step_time(times, 2, v))
        probes.append(PipelineProbe(0, 2, schedule, 2, v, per_chunk, micro_batch, seconds))
    return dataclasses.replace(profile, overheads=dataclasses.replace(profile.overheads, pipelines=tuple(probes)))


def test_overheads_round_trip_and_old_profiles_load():
    profile = synthetic(tiny_profile())
    again = Profile.from_json(profile.to_json())
    assert again == profile and again.overheads.calls[5].strategy == S(tp=2, sp="megatron")
    old = profile.to_dict()
    del old["overheads"]
    assert Profile.from_dict(old).overheads is None
    bad = profile.to_dict()
    bad["overheads"]["calls"][0]["layer_type"] = 3
    with pytest.raises(ProfileError, match="layer type 3"):
        Profile.from_dict(bad)
    bad = profile.to_dict()
    bad["overheads"]["calls"][0]["strategy"]["dp_type"] = "zero4"
    with pytest.raises(ProfileError, match="dp_type"):
        Profile.from_dict(bad)
    piped = with_pipelines(profile)
    assert Profile.from_json(piped.to_json()) == piped and piped.overheads.pipelines[1].virtual_stages == 2
    bad = piped.to_dict()
    bad["overheads"]["pipelines"][0]["layer_type"] = 2
    with pytest.raises(ProfileError, match="pipeline probe names layer type 2"):
        Profile.from_dict(bad)
    bad = piped.to_dict()
    bad["overheads"]["pipelines"][0]["schedule"] = "zigzag"
    with pytest.raises(ProfileError, match="schedule must be one of"):
        Profile.from_dict(bad)


def test_the_profile_calibration_recovers_the_per_call_terms():
    profile = synthetic(tiny_profile())
    calibration = profile_calibration(profile)
    for term in CALL_TERMS:
        assert calibration.block[term] == pytest.approx(TRUTH[term], rel=1e-6, abs=1e-9)
    for term in ("compute", "communication", "recompute"):
        assert calibration.block[term] == 1.0  # the profile's own prices stay
    assert calibration.optimizer_s_per_tensor == pytest.approx(1e-4)
    assert calibration.optimizer_s_per_dtensor == pytest.approx(3e-4)
    assert calibration.optimizer_s_per_element == pytest.approx(2e-9)
    assert calibration.tensors_per_layer_type == {"block": 12} and calibration.vocab_tensors == 3
    assert calibration.compute_slots_per_node is None  # no pipeline probes: no sharing of cores either
    assert calibration.pipeline_overhead_s == 0.0
    assert calibration.residual == pytest.approx(0.0, abs=1e-6)
    assert profile_calibration(tiny_profile()) is None


def test_on_shared_cores_the_compute_runs_at_a_busy_ranks_speed():
    """The profile's compute fits time a block on a core to itself; 4 ranks sharing 2 cores compute at half that
    speed, every kind of compute (plain, tensor-parallel, Ulysses, the recompute replay) and the embedding and head
    alike, and the per-call terms are what the probes add beyond that."""
    calibration = profile_calibration(synthetic(tiny_profile(), compute_slots=2))
    for term in COMPUTE_TERMS:
        assert calibration.block[term] == 2.0
    for term in CALL_TERMS:
        assert calibration.block[term] == pytest.approx(TRUTH[term], rel=1e-5, abs=1e-9)
    assert calibration.vocab_compute == 2.0 and calibration.block["communication"] == 1.0
    assert calibration.residual == pytest.approx(0.0, abs=1e-6)
    assert profile_calibration(synthetic(tiny_profile(), compute_slots=8)).block["compute"] == 1.0  # a core each


#: What the synthetic machine's DDP leaves exposed per block and step, beyond the modelled all-reduce.
REDUCTION_S = 4e-3


def with_reductions(profile: Profile) -> Profile:
    """``profile`` plus the reduction probe of a machine whose DDP adds :data:`REDUCTION_S` per block and step to a
    backward of 4 blocks."""
    plain = 0.05
    probe = ReductionProbe(0, 4, 4, 2, plain, plain + 4 * REDUCTION_S)
    return dataclasses.replace(profile, overheads=dataclasses.replace(profile.overheads, reductions=(probe,)))


def test_reduction_probes_give_the_ddp_reduction_a_backward_leaves_exposed():
    profile = with_reductions(synthetic(tiny_profile()))
    assert Profile.from_json(profile.to_json()) == profile
    bad = profile.to_dict()
    bad["overheads"]["reductions"][0]["blocks"] = 0
    with pytest.raises(ProfileError, match="reduction probe: blocks"):
        Profile.from_dict(bad)
    calibration = profile_calibration(profile)
    assert calibration.ddp_reduction_s == pytest.approx(REDUCTION_S, rel=1e-6)
    assert profile_calibration(synthetic(tiny_profile())).ddp_reduction_s == 0.0  # not probed: nothing added
    # The model adds it once per step for every block whose gradients DDP sums over replicas, and only those.
    without = dataclasses.replace(calibration, ddp_reduction_s=0.0)
    for strategy, reduced in ((S(), 4), (S(dp_type="zero2"), 0), (S(tp=4), 0), (S(tp=2), 4)):
        plan = ParallelPlan.uniform(4, 4, strategy, global_batch_size=8)
        added = (
            evaluate(profile, plan, precision=PRECISION, calibration=calibration).step_time_s
            - evaluate(profile, plan, precision=PRECISION, calibration=without).step_time_s
        )
        assert added == pytest.approx(REDUCTION_S * reduced, abs=1e-12), strategy


def test_pipeline_probes_give_the_sharing_of_cores_and_the_schedule_overhead():
    profile = with_pipelines(synthetic(tiny_profile(), compute_slots=2))
    calibration = profile_calibration(profile)
    assert calibration.compute_slots_per_node == 2
    assert calibration.pipeline_overhead_s == pytest.approx(SCHEDULE_S, rel=1e-6)
    for term in CALL_TERMS:  # the per-call terms are the call probes' alone
        assert calibration.block[term] == pytest.approx(TRUTH[term], rel=1e-6, abs=1e-9)
    # A pipeline the probes did not run is priced with both: the interleaved plan pays the overhead per chunk.
    plan = ParallelPlan.uniform(
        4, 4, S(), pp=2, micro_batches=4, schedule="interleaved_1f1b", virtual_stages=2, global_batch_size=8
    )
    without = dataclasses.replace(calibration, pipeline_overhead_s=0.0)
    gap = (
        evaluate(profile, plan, precision=PRECISION).step_time_s
        - evaluate(profile, plan, precision=PRECISION, calibration=without).step_time_s
    )
    assert gap == pytest.approx(SCHEDULE_S * float(pipeline_step_time(np.full(2, 2.0), 4, 2)))
    # A machine whose schedules cost nothing (probes faster than their stage times): no negative overhead.
    fast = dataclasses.replace(
        profile.overheads, pipelines=tuple(dataclasses.replace(p, seconds=0.0) for p in profile.overheads.pipelines)
    )
    assert profile_calibration(dataclasses.replace(profile, overheads=fast)).pipeline_overhead_s == 0.0


def test_the_search_uses_the_profile_calibration_unless_one_is_given():
    plain = tiny_profile()
    profile = synthetic(plain)
    own = profile_calibration(profile)
    priced = evaluate(profile, PLAN, precision=PRECISION).step_time_s
    assert priced == evaluate(plain, PLAN, precision=PRECISION, calibration=own).step_time_s
    assert priced > evaluate(plain, PLAN, precision=PRECISION).step_time_s  # the per-call terms are in it
    explicit = Calibration(block={"call": 0.5})
    assert applicable_calibration(profile, explicit) is explicit
    assert evaluate(profile, PLAN, precision=PRECISION, calibration=explicit).step_time_s == pytest.approx(
        evaluate(plain, PLAN, precision=PRECISION, calibration=explicit).step_time_s
    )
    # The search prices with the same rule: its estimate is evaluate's.
    result = search(profile, 4, "1GB", global_batch_size=8, precision=PRECISION, baselines=False)
    assert result.estimate.step_time_s == pytest.approx(evaluate(profile, result.plan, precision=PRECISION).step_time_s)
    # A machine where a tensor-parallel call costs 10 s more: the search avoids TP.
    heavy = dataclasses.replace(
        profile,
        overheads=dataclasses.replace(
            profile.overheads,
            calls=tuple(
                dataclasses.replace(c, seconds=c.seconds + (10.0 if c.strategy.splits_weights else 0.0))
                for c in profile.overheads.calls
            ),
        ),
    )
    avoided = search(heavy, 4, "1GB", global_batch_size=8, precision=PRECISION, baselines=False).plan
    assert not any(s.splits_weights for s in (*avoided.layers, avoided.vocab))


# ---------------------------------------------------------------------------------------------- measured
def _profile_two_ranks() -> dict:
    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler import profile
    from tests.helpers.training import dataset, tiny_gpt

    model = tiny_gpt()
    data = dataset(8)
    batch = (data.inputs[:2], data.targets[:2])
    return profile(model, find_blocks(model), batch, cache=False, hardware_budget_s=0.5).to_dict()


@pytest.mark.timeout(300)
def test_two_ranks_measure_call_and_optimizer_probes(pools):
    results = pools(2).run(_profile_two_ranks)
    assert results[0] == results[1]
    profile = Profile.from_dict(results[0])
    overheads = profile.overheads
    assert overheads.world_size == 2 and overheads.block_tensors[0] > 0
    measured = {c.strategy: c.seconds for c in overheads.calls}
    for strategy in (S(), S(recompute=True), S(dp_type="zero2"), S(dp_type="zero3"), S(tp=2), S(tp=2, sp="megatron")):
        assert measured[strategy] > 0, strategy
    assert {o.dtensor for o in overheads.optimizer} == {False, True}
    assert all(o.seconds > 0 for o in overheads.optimizer)
    assert [(p.pp, p.schedule, p.micro_batches, p.virtual_stages, p.blocks_per_chunk) for p in overheads.pipelines] == [
        (2, "1f1b", 2, 1, 2),
        (2, "interleaved_1f1b", 2, 2, 1),
        (2, "gpipe", 1, 1, 2),
    ]
    assert all(p.seconds > 0 and p.micro_batch == 2 for p in overheads.pipelines)
    (reduction,) = overheads.reductions  # the runtime's DDP reducer over copies of the block, one per model block
    assert (reduction.blocks, reduction.group_size, reduction.local_batch) == (len(profile.model.blocks), 2, 2)
    assert reduction.plain_seconds > 0 and reduction.reduced_seconds > 0
    calibration = profile_calibration(profile)
    assert calibration.ddp_reduction_s >= 0
    assert calibration.compute_slots_per_node == overheads.compute_slots and calibration.pipeline_overhead_s >= 0
    assert all(v >= 0 for v in calibration.block.values())
    # The fit explains the probes it came from better than the model without per-call terms does. (How closely
    # depends on the timing noise of the machine: test_the_profile_calibration_recovers_the_per_call_terms checks
    # the fit itself on noiseless probes; here the non-negative least squares must beat its own starting point,
    # all per-call terms zero, in the weighting it minimises.)
    without = dataclasses.replace(calibration, block={**calibration.block, **{t: 0.0 for t in CALL_TERMS}})
    y = np.array([probe.seconds for probe in overheads.calls])
    weights = 1.0 / np.sqrt(np.maximum(y, 1e-6))

    def weighted_error(c: Calibration) -> float:
        predicted = np.array([float(modelled(profile, probe)[1] @ c.coefficients) for probe in overheads.calls])
        return float(np.sum(((predicted - y) * weights) ** 2))

    assert weighted_error(calibration) <= weighted_error(without) * (1 + 1e-9)
    assert any(calibration.block[t] > 0 for t in CALL_TERMS)  # the probes carry per-call time the model lacks
