"""The plan data model: validation messages, exact JSON round-trips, the reference system's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan, PlanError, even_partition, load_plan

DATA = Path(__file__).parent / "data" / "galvatron-profiles"
REFERENCE_PLAN = DATA / "galvatron_config_llama2-7b_1nodes_8gpus_per_node_36GB_bf16.json"


def plan(**kwargs):
    defaults = dict(world_size=8, layers=(S(),) * 4)
    return ParallelPlan(**{**defaults, **kwargs})


# Each invalid plan, and the words its error must contain (what is wrong and what to do).
INVALID = [
    (lambda: S(tp=0), "tp must be a positive integer"),
    (lambda: S(sp="ring"), "sp must be one of"),
    (lambda: S(dp_type="zero1"), "dp_type must be one of"),
    (lambda: S(sp="megatron"), "sp='megatron' needs a group to split the sequence over: set tp > 1"),
    (lambda: S(sp="ulysses", tp=1), "sp='ulysses' needs a group"),
    (lambda: S(recompute="yes"), "must be booleans"),
    (lambda: plan(world_size=0), "world_size must be a positive integer"),
    (lambda: plan(pp=3), "pp=3 does not divide world_size=8: choose pp among [1, 2, 4, 8]"),
    (lambda: plan(layers=(S(tp=3),) * 4), "tp=3 does not divide the 8 devices"),
    (lambda: plan(pp=2, layers=(S(tp=8),) * 4), "layers[0]: tp=8 does not divide the 4 devices of a pipeline stage"),
    (lambda: plan(vocab=S(tp=16)), "vocab: tp=16 does not divide"),
    (lambda: plan(layers=(), pp=2), "at least one layer strategy"),
    (lambda: plan(schedule="pipedream"), "schedule must be one of"),
    (lambda: plan(pp=2, schedule="interleaved_1f1b"), "needs virtual_stages >= 2"),
    (lambda: plan(schedule="interleaved_1f1b", virtual_stages=2), "needs pp >= 2"),
    (lambda: plan(pp=2, virtual_stages=2), "needs schedule='interleaved_1f1b'"),
    (lambda: plan(pp=8), "8 pipeline chunks (pp=8 x virtual_stages=1) for only 4 blocks"),
    (lambda: plan(pp=2, partition=(4,)), "partition has 1 entries but the plan has 2 pipeline chunks"),
    (lambda: plan(pp=2, partition=(4, 0)), "every pipeline chunk needs at least one block"),
    (lambda: plan(pp=2, partition=(2, 3)), "sums to 5 but the model has 4 blocks"),
    (lambda: plan(micro_batches=0), "micro_batches must be a positive integer"),
    (lambda: plan(global_batch_size=12), "global batch size 12 is not divisible by dp=8 x micro_batches=1"),
    (lambda: plan(micro_batches=2, global_batch_size=8), "use a multiple of 16"),
    (lambda: plan(layers=(S(tp=2),) * 4, global_batch_size=6), "use a multiple of 8"),
    (
        lambda: ParallelPlan.from_dict({"world_size": 8, "layers": [{"tp": 1}], "pipeline": 2}),
        "unknown plan keys ['pipeline']",
    ),
    (
        lambda: ParallelPlan.from_dict({"world_size": 8, "layers": [{"tensor": 2}]}),
        "unknown layer strategy keys ['tensor']",
    ),
    (lambda: ParallelPlan.from_dict({"world_size": 8}), "a plan needs 'layers'"),
    (lambda: ParallelPlan.from_dict({"layers": [{}], "version": 99}), "newer than this lightning_galvatron"),
    (
        lambda: ParallelPlan.from_dict({"world_size": 4, "layers": [{}]}, world_size=8),
        "the plan is for world_size=4 but 8",
    ),
    (lambda: ParallelPlan.from_dict(json.loads(REFERENCE_PLAN.read_text())), "pass world_size"),
    (lambda: load_plan(Path("/nonexistent/plan.json")), "does not exist"),
    (lambda: load_plan(42), "plan must be a ParallelPlan, a dict or a path"),
    (lambda: plan(layers=(S(sp="megatron", tp=2),) * 4).to_galvatron(), "no per-layer Megatron"),
    (lambda: plan(layers=(S(dp_type="ddp"), S(dp_type="zero2"), S(), S())).to_galvatron(), "mixes ['ddp', 'zero2']"),
]


@pytest.mark.parametrize(("make", "message"), INVALID, ids=[m for _, m in INVALID])
def test_invalid_plans_say_what_to_change(make, message):
    with pytest.raises(PlanError) as error:
        make()
    assert message in str(error.value)


def test_messages_are_distinct():
    assert len({m for _, m in INVALID}) == len(INVALID)


def test_json_round_trip_is_exact(tmp_path):
    original = ParallelPlan(
        world_size=8,
        layers=(
            S(tp=2, sp="megatron", dp_type="zero3", recompute=True),
            S(tp=4, sp="ulysses", tp_consecutive=False),
            S(),
            S(),
        ),
        vocab=S(tp=2, dp_type="zero2"),
        pp=2,
        partition=(1, 3),
        schedule="gpipe",
        micro_batches=4,
        global_batch_size=32,
    )
    assert ParallelPlan.from_json(original.to_json()) == original
    original.save(tmp_path / "plan.json")
    assert ParallelPlan.load(tmp_path / "plan.json") == original
    assert json.loads(original.to_json()) == original.to_dict()


def test_reference_format_round_trip_is_exact():
    reference = json.loads(REFERENCE_PLAN.read_text())
    imported = ParallelPlan.from_galvatron(reference, world_size=8)
    assert imported.to_galvatron() == reference
    assert ParallelPlan.from_galvatron(imported.to_galvatron(), 8) == imported
    # and the file is accepted wherever a plan is
    assert load_plan(REFERENCE_PLAN, world_size=8) == imported
    assert load_plan(reference, world_size=8) == imported


def test_reference_format_meaning():
    imported = load_plan(REFERENCE_PLAN, world_size=8)
    assert imported.num_layers == 32 and imported.pp == 1 and imported.schedule == "1f1b"
    assert all(s.dp_type == "zero3" for s in imported.layers)  # dp_types_enc 1 = ZeRO-3
    assert [s.recompute for s in imported.layers] == [True] * 20 + [False] * 12
    assert imported.vocab == S(tp=2, sp="ulysses", dp_type="zero3")  # vtp=2, vsp=1, embed_sdp=1
    assert imported.global_batch_size == 16


def test_derived_quantities():
    p = plan(pp=2, layers=(S(tp=2),) * 5, micro_batches=2)
    assert p.devices_per_stage == 4 and p.dp_of(p.layers[0]) == 2 and p.dp_of(p.vocab) == 4
    assert p.chunk_sizes == (3, 2) and list(p.stage_layers(1)) == [3, 4]
    assert p.batch_granularity == 8
    interleaved = plan(pp=2, layers=(S(),) * 8, schedule="interleaved_1f1b", virtual_stages=2)
    assert interleaved.stage_layers(0) == [0, 1, 4, 5] and interleaved.stage_layers(1) == [2, 3, 6, 7]
    assert even_partition(10, 4) == (3, 3, 2, 2)


def test_plans_are_immutable_and_hashable():
    p = plan()
    with pytest.raises(AttributeError):
        p.pp = 2  # type: ignore[misc]
    assert hash(p) == hash(plan(layers=[S()] * 4))
    assert p.replace(pp=2).pp == 2 and p.pp == 1
