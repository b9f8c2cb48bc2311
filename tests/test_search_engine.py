"""The whole search on the imported Llama-2-7B / 8xA100 profile and on synthetic models."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

from lightning_galvatron.plan import LayerStrategy, ParallelPlan
from lightning_galvatron.search import InfeasibleBudgetError, NoValidPlanError, evaluate, search
from tests.search_profiles import REFERENCE_PLAN, llama_profile, synthetic_profile


@pytest.fixture(scope="module")
def profile():
    return llama_profile()


@pytest.fixture(scope="module")
def llama_8_gpus(profile):
    return search(profile, 8, "36GB", global_batch_size=16)


def test_search_modules_import_neither_torch_nor_lightning():
    """The search runs on a laptop for a cluster the user does not have: numpy only."""
    import ast
    import pathlib
    import subprocess

    import lightning_galvatron

    root = pathlib.Path(lightning_galvatron.__file__).parent
    files = [
        *sorted((root / "search").glob("*.py")),
        *sorted((root / "profiles").glob("*.py")),
        *sorted((root / "plan").glob("*.py")),
        root / "units.py",
    ]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] in ("torch", "lightning", "pytorch_lightning")], (
                path,
                names,
            )
    # And at run time: importing the search adds no torch/Lightning module to what the package itself loads.
    code = (
        "import sys, lightning_galvatron; before = set(sys.modules);"
        "import lightning_galvatron.search, lightning_galvatron.profiles;"
        "bad = [m for m in set(sys.modules) - before if m.split('.')[0] in ('torch', 'lightning', "
        "'pytorch_lightning')];"
        "print(bad); sys.exit(bool(bad))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_beats_the_reference_systems_own_plan(profile, llama_8_gpus):
    """Same cost model, same budget: the searched plan is at least as fast as Hetu-Galvatron's choice."""
    reference = ParallelPlan.from_galvatron(json.loads(REFERENCE_PLAN.read_text()), world_size=8)
    theirs = evaluate(profile, reference, memory_budget_bytes="36GB")
    ours = llama_8_gpus
    assert theirs.fits  # the reference plan is valid under our model too
    assert ours.throughput_samples_per_s >= theirs.throughput_samples_per_s
    # Recorded figures (samples/s): ours 15.94, the reference plan 15.12, on the imported A100 profile.
    assert ours.throughput_samples_per_s == pytest.approx(15.94, rel=0.01)
    assert theirs.throughput_samples_per_s == pytest.approx(15.12, rel=0.01)


def test_result_is_a_valid_plan_within_budget_with_breakdown_and_baselines(llama_8_gpus):
    r = llama_8_gpus
    assert r.peak_memory_bytes_per_device <= 36e9
    assert r.plan.global_batch_size == 16 and r.plan.world_size == 8
    r.plan.check_batch_size(16)
    assert len(r.estimate.blocks) == 32 and all(b.memory_bytes > 0 for b in r.estimate.blocks)
    assert len(r.peak_memory_bytes_per_stage) == r.plan.pp
    names = [b.name for b in r.baselines]
    assert names == ["ddp", "zero3", "tp", "uniform_3d"]
    ddp = r.baselines[0]
    assert not ddp.fits  # 7B parameters with AdamW do not fit 36 GB per GPU replicated
    for b in r.baselines:
        if b.fits:
            assert r.throughput_samples_per_s >= b.estimate.throughput_samples_per_s
    data = json.loads(json.dumps(r.to_dict()))
    for key in (
        "throughput_samples_per_s",
        "step_time_s",
        "peak_memory_bytes_per_device",
        "plan",
        "blocks",
        "baselines",
    ):
        assert key in data
    assert ParallelPlan.from_dict(data["plan"]) == r.plan


def test_infeasible_budget_names_the_smallest_budget_that_fits(profile):
    with pytest.raises(InfeasibleBudgetError, match="the smallest budget that fits is") as err:
        search(profile, 8, "4GB", global_batch_size=8, baselines=False)
    smallest = err.value.smallest_budget_bytes
    assert isinstance(err.value, ValueError) and 4e9 < smallest < 36e9
    assert "at global batch size 1 it is" in str(err.value)
    found = search(profile, 8, smallest, global_batch_size=8, baselines=False)
    assert found.peak_memory_bytes_per_device <= smallest
    with pytest.raises(InfeasibleBudgetError):
        search(profile, 8, int(smallest * 0.97), global_batch_size=8, baselines=False)


def test_no_valid_plan_for_a_world_size(profile):
    small = profile.with_num_blocks(4)
    with pytest.raises(NoValidPlanError, match="no executable plan for 4 blocks on 7 devices"):
        search(small, 7, "80GB", global_batch_size=16)  # tp 7 splits no head count, pp 7 > 4 blocks, 16 % 7 != 0


@pytest.mark.parametrize("world_size", [6, 12, 24])
def test_world_sizes_that_are_not_powers_of_two(profile, world_size):
    r = search(profile, world_size, "36GB", global_batch_size=2 * world_size, baselines=False)
    assert r.plan.world_size == world_size and r.peak_memory_bytes_per_device <= 36e9
    r.plan.check_batch_size(2 * world_size)
    assert r.estimate.warnings == ()  # everything the runtime can execute


def test_limits_are_respected(profile):
    r = search(profile, 8, "36GB", global_batch_size=16, max_tp=2, disable=["zero3"], baselines=False)
    assert all(s.tp <= 2 and s.dp_type != "zero3" for s in (*r.plan.layers, r.plan.vocab))
    r = search(profile, 8, "20GB", global_batch_size=16, schedules=["gpipe"], baselines=False)
    assert r.plan.pp == 1 or r.plan.schedule == "gpipe"
    r = search(profile, 8, "20GB", global_batch_size=16, max_pp=1, baselines=False)
    assert r.plan.pp == 1


@pytest.mark.parametrize("max_tp", [1, 2])
def test_pipelines_when_states_cannot_be_sharded(profile, max_tp):
    r = search(profile, 8, "36GB", global_batch_size=16, max_tp=max_tp, disable=["zero2", "zero3"], baselines=False)
    plan = r.plan
    assert plan.pp > 1 and r.peak_memory_bytes_per_device <= 36e9
    if plan.schedule in ("1f1b", "interleaved_1f1b"):
        assert plan.micro_batches >= plan.pp
    if plan.schedule == "interleaved_1f1b":
        assert plan.micro_batches % plan.pp == 0
    assert sum(plan.chunk_sizes) == 32
    assert r.estimate.warnings == ()


def test_layer_type_without_tensor_parallel_support(profile):
    layer = dataclasses.replace(profile.model.layer_types[0], supports_tensor_parallel=False, supports_ulysses=False)
    model = dataclasses.replace(profile.model, layer_types=(layer,))
    r = search(dataclasses.replace(profile, model=model), 8, "36GB", global_batch_size=16, baselines=False)
    assert all(s.tp == 1 for s in r.plan.layers)


def test_batch_size_search_is_opt_in(profile):
    fixed = search(profile, 8, "36GB", baselines=False)
    assert fixed.global_batch_size == 8  # default: one sample per device, as DDP would train
    found = search(profile, 8, "36GB", search_batch_size=True, max_global_batch_size=32, baselines=False)
    assert found.global_batch_size <= 32
    assert found.throughput_samples_per_s >= fixed.throughput_samples_per_s
    assert any("global batch size searched" in n for n in found.notes)


def test_encoder_decoder_models_with_two_block_types():
    profile = synthetic_profile(np.random.default_rng(5), num_blocks=8, num_types=2)
    r = search(profile, 8, "8GB", global_batch_size=16)
    assert r.plan.num_layers == 8 and r.peak_memory_bytes_per_device <= 8e9
    tight = search(profile, 8, r.peak_memory_bytes_per_device * 0.6, global_batch_size=16, baselines=False)
    assert tight.peak_memory_bytes_per_device <= r.peak_memory_bytes_per_device * 0.6


def test_large_clusters_search_quickly(profile):
    r = search(profile.with_num_blocks(48), 64, "36GB", global_batch_size=128, baselines=False)
    assert r.plan.world_size == 64 and r.search_time_s < 30


def test_search_memory_per_stage_is_what_the_search_fits_into_the_budget(profile, llama_8_gpus):
    """The search's own pricing of its plan fits the budget, and differs from evaluate() only by the working
    reserve (the bound of the plan's reserve level, here with no recomputed block, instead of the plan's own
    transient memory)."""
    from lightning_galvatron.search.cost import CostModel, StageContext
    from lightning_galvatron.search.engine import search_memory_per_stage
    from lightning_galvatron.search.options import SearchOptions
    from lightning_galvatron.search.working import reserve_level, working_memory_bytes

    plan, estimate = llama_8_gpus.plan, llama_8_gpus.estimate
    assert not any(s.recompute for s in plan.layers)  # else the reserve depends on the last block (test below)
    priced = search_memory_per_stage(profile, plan)
    assert len(priced) == plan.pp
    assert max(priced) <= llama_8_gpus.memory_budget_bytes
    cm = CostModel(profile)
    ctx = StageContext(plan.world_size, plan.pp, plan.global_batch_size, plan.micro_batches)
    reserve = working_memory_bytes(cm, profile.model.layer_types, ctx, reserve_level(plan.layers))
    for searched, stage in zip(priced, estimate.stages):
        assert searched - stage.peak_memory_bytes == pytest.approx(reserve - stage.working_bytes, rel=1e-9, abs=1)
    # A recomputed ZeRO-3 plan is priced with the reserve of both (evaluate: its own blocks' need, the same here).
    costly = ParallelPlan.uniform(
        8,
        profile.model.num_blocks,
        LayerStrategy(dp_type="zero3", recompute=True),
        vocab=LayerStrategy(dp_type="zero3"),
        global_batch_size=16,
    )
    ctx = StageContext(8, 1, 16, 1)
    reserve = working_memory_bytes(cm, profile.model.layer_types, ctx, "all")
    assert reserve > 0
    (searched,) = search_memory_per_stage(profile, costly)
    assert searched == pytest.approx(evaluate(profile, costly).stages[0].peak_memory_bytes, rel=1e-6)

    with pytest.raises(ValueError, match="not among the search's candidates"):
        zero3 = ParallelPlan.uniform(8, profile.model.num_blocks, LayerStrategy(dp_type="zero3"), global_batch_size=16)
        search_memory_per_stage(profile, zero3, options=SearchOptions(disable=["zero3"]))


def test_a_plain_plan_holds_back_no_reserve_for_recomputation_or_gathering(profile):
    """A budget that plain DDP fits with little to spare gets plain DDP: the reserve of recomputed or ZeRO-3
    blocks is held back only at the levels that admit them."""
    from lightning_galvatron.search.cost import CostModel, StageContext
    from lightning_galvatron.search.options import SearchOptions
    from lightning_galvatron.search.working import working_memory_bytes

    ddp = ParallelPlan.uniform(8, profile.model.num_blocks, LayerStrategy(), global_batch_size=16)
    need = evaluate(profile, ddp).peak_memory_bytes
    # Less to spare than the reserve of a recomputed ZeRO-3 block.
    budget = need + 0.5 * working_memory_bytes(CostModel(profile), profile.model.layer_types, StageContext(8, 1, 16, 1))
    r = search(profile, 8, budget, global_batch_size=16, options=SearchOptions(max_pp=1), baselines=False)
    assert all(s.dp_type != "zero3" and not s.recompute for s in r.plan.layers)
    assert r.peak_memory_bytes_per_device <= budget


def test_a_replay_needs_only_what_the_blocks_after_it_freed(profile):
    """Backward frees the blocks after a recomputed one before it replays: recomputing the first blocks of a stage
    whose last block stores a replay's worth needs no reserve, evaluate() and the search both know it, and the search
    finds such a plan where a reserve for every recomputed block would not have fit it."""
    from lightning_galvatron.search.cost import CostModel, StageContext
    from lightning_galvatron.search.engine import search_memory_per_stage
    from lightning_galvatron.search.options import SearchOptions
    from lightning_galvatron.search.working import working_memory_bytes

    L = profile.model.num_blocks
    plain, recomputed = LayerStrategy(), LayerStrategy(recompute=True)
    replay = working_memory_bytes(
        CostModel(profile), profile.model.layer_types, StageContext(8, 1, 16, 1), "recomputed"
    )
    assert replay > 0

    def priced(layers):
        plan = ParallelPlan(world_size=8, layers=tuple(layers), vocab=plain, global_batch_size=16)
        return plan, evaluate(profile, plan)

    for layers, working in (
        ([recomputed] * L, replay),  # the last block replays with nothing freed behind it
        ([plain] * (L - 1) + [recomputed], replay),
        ([recomputed] * (L // 2) + [plain] * (L - L // 2), 0.0),
        ([plain] * 3 + [recomputed] * (L - 4) + [plain], 0.0),
    ):
        plan, estimate = priced(layers)
        assert estimate.stages[0].working_bytes == pytest.approx(working, rel=1e-9, abs=1)
        # The search prices a stage's reserve by its last block: exact here.
        (searched,) = search_memory_per_stage(profile, plan)
        assert searched == pytest.approx(estimate.peak_memory_bytes, rel=1e-9)

    mixed, estimate = priced([recomputed] * (L - 2) + [plain] * 2)
    budget = int(estimate.peak_memory_bytes * 1.002)  # the DP's rounding (memory_tolerance) needs 0.1%
    assert budget < estimate.peak_memory_bytes + replay  # a reserve for its recomputed blocks would not fit it
    options = SearchOptions(max_pp=1, max_tp=1, disable={"zero2", "zero3"}, memory_tolerance=0.001)
    found = search(profile, 8, budget, global_batch_size=16, options=options, baselines=False)
    assert found.peak_memory_bytes_per_device <= budget
    assert found.step_time_s <= estimate.step_time_s * (1 + 1e-9)
    assert any(s.recompute for s in found.plan.layers) and not found.plan.layers[-1].recompute
    # Recomputed blocks come first in the plan (each replay then has the most freed behind it).
    flags = [s.recompute for s in found.plan.layers]
    assert flags == sorted(flags, reverse=True)
