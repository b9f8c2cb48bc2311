"""Measured selection (issue 15): trials choose the plan, never change what is trained, are cached, can be off."""

from __future__ import annotations

import itertools
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPTModule
from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import evaluate, search
from lightning_galvatron.search.candidates import Candidate, diverse_candidates, plan_kind, trial_order
from lightning_galvatron.selection import TrialSettings
from lightning_galvatron.selection.resolution import TIE, complexity, measurably_faster
from lightning_galvatron.strategy.display import setup_report
from tests.helpers.training import TINY_GPT, dataset, run_distributed

pytestmark = pytest.mark.timeout(600)

DROPOUT = {"dropout": 0.1}  # trials draw random numbers: training must not see it
TRIALS = {"budget_s": 60, "warmup_steps": 1, "timed_steps": 1, "max_candidates": 3}


def _auto_cached_and_off(cache_dir: str) -> dict:
    """Auto with trials, the chosen plan given explicitly, auto again from the cache, auto with trials off."""
    kwargs = dict(memory_budget="1GB", profile_cache=cache_dir, save_plan=False)
    measured = GalvatronStrategy(**kwargs, trials=TRIALS)
    auto = run_distributed(strategy=measured, model_kwargs=DROPOUT)
    explicit = run_distributed(plan=measured.plan, model_kwargs=DROPOUT)
    again = GalvatronStrategy(**kwargs, trials=TRIALS)
    run_distributed(strategy=again, model_kwargs=DROPOUT, max_steps=1)
    off = GalvatronStrategy(**kwargs, trials=False)
    run_distributed(strategy=off, model_kwargs=DROPOUT, max_steps=1)
    return dict(
        auto=auto,
        explicit=explicit,
        plan=measured.plan,
        selection=measured.selection,
        prediction=measured.prediction,
        again_prediction=again.prediction,
        off_prediction=off.prediction,
        again=again.selection,
        again_plan=again.plan,
        off_selection=off.selection,
        off_plan=off.plan,
    )


def test_measured_selection_trains_exactly_the_chosen_plan_is_cached_and_can_be_off(pools, profile_cache):
    out = pools(2).run(_auto_cached_and_off, str(profile_cache))[0]
    selection = out["selection"]
    assert len(selection.trials) >= 2 and not selection.from_cache
    assert all(t.step_s is not None and t.step_s > 0 and t.peak_bytes > 0 for t in selection.trials), selection.report()
    assert selection.plan == out["plan"] and selection.chosen is not None
    # The fastest measured plan that fits, or a simpler one the trials cannot tell from it (said in the note).
    fastest = min((t for t in selection.trials if t.fits(selection.memory_budget_bytes)), key=lambda t: t.step_s)
    if selection.chosen.step_s != fastest.step_s:
        assert complexity(selection.chosen.plan) < complexity(fastest.plan), selection.report()
        assert not measurably_faster(fastest.steps, selection.chosen.steps), selection.report()
        assert selection.chosen.step_s <= (1 + TIE) * fastest.step_s, selection.report()
        assert "so the simpler plan is trained" in selection.note

    # Parity: trials on copies, random state restored -- bit for bit what training the chosen plan from the start gives.
    auto, explicit = out["auto"], out["explicit"]
    assert auto.losses == explicit.losses
    assert auto.state.keys() == explicit.state.keys()
    for name, value in explicit.state.items():
        assert torch.equal(auto.state[name], value), name

    # The second setup reads the decision, the measurements and the calibration from the cache.
    again = out["again"]
    assert again.from_cache and out["again_plan"] == out["plan"]
    assert again.trials == selection.trials and again.calibration == selection.calibration
    assert (profile_cache / "selections").is_dir() and again.cache_file.startswith(str(profile_cache / "selections"))

    # The setup report, the loggers and the first steps' check use one prediction: the calibrated model's price of
    # the chosen plan, from the trials or from the cache alike; without trials the search's own.
    for prediction in (out["prediction"], out["again_prediction"]):
        assert prediction.calibrated and prediction.plan == out["plan"]
        assert prediction.estimate.step_time_s == pytest.approx(selection.chosen.calibrated_step_s)
        assert "calibrated from the trials" in setup_report(prediction)
    assert not out["off_prediction"].calibrated and "calibrated" not in setup_report(out["off_prediction"])

    # Off: the search's own plan, no trials.
    (profile_file,) = profile_cache.glob("*.json")
    searched = search(Profile.load(profile_file), 2, "1GB", global_batch_size=8, precision="32-true", optimizer="adamw")
    assert out["off_selection"] is None and out["off_plan"] == searched.plan


class _CountingGPT(GPTModule):
    """The tiny GPT, counting the optimizers it made (trials make theirs on copies); with ``refuse_sharded``, its
    training step fails where its weights are sharded (a user's code that cannot run under ZeRO-3)."""

    refuse_sharded = False

    def configure_optimizers(self):
        self.optimizers_made = getattr(self, "optimizers_made", 0) + 1
        return super().configure_optimizers()

    def training_step(self, batch, batch_idx):
        from torch.distributed.tensor import DTensor

        if self.refuse_sharded and any(isinstance(p, DTensor) for p in self.parameters()):
            raise ValueError("this step cannot run on sharded weights")
        return super().training_step(batch, batch_idx)


def _trials_on_copies() -> dict:
    import lightning.pytorch as L
    from lightning.pytorch.plugins.precision import Precision
    from torch.distributed.tensor import DTensor

    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.model.outside_layers import trace_outside_layers
    from lightning_galvatron.runtime.mesh import MeshCache
    from lightning_galvatron.search.report import plan_summary
    from lightning_galvatron.selection import preserved_rng
    from lightning_galvatron.strategy.trials import TrialRunner, global_batch_samples

    torch.manual_seed(1234)
    module = _CountingGPT(**{**TINY_GPT, **DROPOUT})
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    loader = torch.utils.data.DataLoader(dataset(32), batch_size=4, shuffle=True)
    batch = global_batch_samples(loader, 8)
    runner = TrialRunner(
        module,
        trainer,
        None,
        batch,
        MeshCache.shared("cpu"),
        Precision(),
        torch.device("cpu"),
        ["training_step"],
        False,
        lambda: trace_outside_layers(module, find_blocks(module), "training_step", batch),
    )
    settings = TrialSettings(timed_steps=2)
    plans = [
        ParallelPlan.uniform(2, 4, S(), pp=2, schedule="1f1b", micro_batches=2, global_batch_size=8),
        ParallelPlan.uniform(2, 4, S(dp_type="zero3", recompute=True), vocab=S(dp_type="zero3"), global_batch_size=8),
    ]
    rng = torch.get_rng_state()
    with preserved_rng(torch.device("cpu")):
        results = [runner.run(plan, settings) for plan in plans]
    restored = torch.equal(rng, torch.get_rng_state())
    runner.run(plans[1], settings)  # without preserved_rng: a trial draws from the random state (dropout)
    drawn = not torch.equal(rng, torch.get_rng_state())
    stopped, _ = runner.run(plans[1], settings, stop_above=0.0)  # slower than any plan could be: stops at once
    marks = []
    runner.progress = marks.append
    module.refuse_sharded = True  # the trial fails (on every rank); the runner goes on with the next
    failed, failed_observations = runner.run(plans[1], settings)
    after_failure, _ = runner.run(plans[0], settings)
    module.refuse_sharded = False
    return dict(
        failed=failed,
        failed_observations=failed_observations,
        after_failure=after_failure,
        marks=marks,
        failed_plan=plan_summary(plans[1]),
        results=results,
        restored=restored,
        drawn=drawn,
        rank=dist.get_rank(),
        stopped=stopped,
        unchanged=all(torch.equal(before[k], v) for k, v in module.state_dict().items()),
        plain=not any(isinstance(p, DTensor) for p in module.parameters()),
        blocks=len(module.model.blocks),
        hooks=sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules()),
        grads=any(p.grad is not None for p in module.parameters()),
        optimizers_made=getattr(module, "optimizers_made", 0),
        logs_patched="log" in vars(module),
    )


def test_trials_leave_the_module_its_optimizer_and_the_random_state_untouched(pools):
    outs = pools(2).run(_trials_on_copies)
    for out in outs:
        assert out["restored"] and out["drawn"]
        assert out["unchanged"] and out["plain"] and out["blocks"] == 4 and out["hooks"] == 0 and not out["grads"]
        assert out["optimizers_made"] == 0 and not out["logs_patched"]
        stopped = out["stopped"]
        assert stopped.stopped_early and stopped.step_s > 0 and stopped.peak_bytes is None and stopped.error is None
        assert stopped.steps == (stopped.step_s,)
        failed = out["failed"]
        assert failed.step_s is None and failed.error == "ValueError: this step cannot run on sharded weights"
        assert out["failed_observations"] == [] and out["after_failure"].error is None
        assert out["after_failure"].step_s > 0
        # What the watchdog reports where this rank waits, if the others were stuck in the trial's collectives.
        assert out["marks"] == [f"setup: the trial of {out['failed_plan']} failed on this rank ({failed.error})"]
        for measurement, observations in out["results"]:
            assert measurement.error is None and measurement.step_s > 0 and measurement.peak_bytes > 0
            # The trial's step is the median of its timed steps (what training runs at), not the fastest one.
            assert len(measurement.steps) == 2 and measurement.step_s == statistics.median(measurement.steps)
            assert len(observations) == (2 if out["rank"] == 0 else 0)  # every rank's, gathered on rank 0
            assert all(o.blocks for o in observations)


def test_candidates_are_distinct_fit_and_cover_other_kinds():
    from tests.search_profiles import llama_profile

    profile = llama_profile()
    arguments = dict(
        world_size=8, memory_budget_bytes="60GB", global_batch_size=8, precision="bf16-mixed", optimizer="adamw"
    )
    result = search(profile, **arguments)
    candidates = diverse_candidates(profile, result, arguments, max_candidates=6)
    assert candidates[0].plan == result.plan and candidates[0].name == "searched"
    assert len({c.plan for c in candidates}) == len(candidates) >= 3
    assert all(c.estimate.fits for c in candidates)
    assert len({plan_kind(c.plan) for c in candidates}) >= 3


def test_a_plan_is_tried_once_whether_its_even_partition_is_given_or_not():
    """The search's pipeline names its partition, the uniform baseline leaves the same one out: tried twice, the
    plan would get two draws of the trials' noise (and did, and won on the luckier one)."""
    from tests.test_search_cost import tiny_profile

    profile = tiny_profile().with_num_blocks(8)
    implicit = ParallelPlan.uniform(4, 8, S(), pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batches=2)
    explicit = implicit.replace(partition=(2, 2, 2, 2))
    other = ParallelPlan.uniform(4, 8, S(), micro_batches=2)
    assert implicit != explicit and implicit.chunk_sizes == explicit.chunk_sizes
    found = [
        Candidate(name, plan, evaluate(profile, plan, global_batch_size=16))
        for name, plan in (("searched", explicit), ("uniform ddp", other), ("uniform pp2", implicit))
    ]
    assert [c.name for c in trial_order(found)] == ["searched", "uniform ddp"]


def test_candidates_include_ddp_over_micro_batches_of_another_size():
    """Trials of one micro-batch size leave a block's per-call time and its compute interchangeable; DDP over
    2 or 4 micro-batches (a plan users pick anyway) is among the candidates that tell them apart."""
    from tests.test_search_cost import tiny_profile

    profile = tiny_profile().with_num_blocks(8)
    arguments = dict(
        world_size=4, memory_budget_bytes="64GB", global_batch_size=16, precision="bf16-mixed", optimizer="adamw"
    )
    result = search(profile, **arguments)
    candidates = diverse_candidates(profile, result, arguments, max_candidates=20)
    micro = [c for c in candidates if c.name == "uniform ddp, micro-batches"]
    assert len(micro) == 1 and micro[0].plan.pp == 1 and micro[0].plan.micro_batches in (2, 4)
    assert all(s.dp_type == "ddp" and s.tp == 1 for s in micro[0].plan.layers)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("yes", "trials must be True, False, a budget"),
        ({"budget": 3}, r"unknown trials settings \['budget'\]"),
        (0, "budget_s must be a positive number"),
        ({"timed_steps": 0}, "timed_steps must be an integer >= 1"),
    ],
)
def test_bad_trials_argument_is_refused_when_the_strategy_is_made(value, message):
    with pytest.raises(ValueError, match=message):
        GalvatronStrategy(trials=value)


def test_the_calibrated_search_leaves_out_what_no_trial_measured():
    from lightning_galvatron.search.candidates import unmeasured

    ddp = ParallelPlan.uniform(4, 4, S(), global_batch_size=8)
    tp_pipeline = ParallelPlan.uniform(
        4, 4, S(tp=2, sp="megatron", dp_type="zero3"), vocab=S(tp=2), pp=2, global_batch_size=8
    )
    assert unmeasured([ddp]) == {
        "zero2",
        "zero3",
        "recompute",
        "tensor_parallel",
        "tp_without_sp",
        "megatron_sp",
        "ulysses",
        "vocab_parallel",
        "strided",
        "pipeline",
    }
    assert unmeasured([ddp, tp_pipeline]) == {"zero2", "recompute", "tp_without_sp", "ulysses", "strided"}


def test_extra_machinery_must_beat_a_simpler_plan_by_more_than_the_trials_can_resolve():
    from lightning_galvatron.selection.measured import TrialRecord
    from lightning_galvatron.selection.resolution import simplest_within_resolution

    uniform = ParallelPlan.uniform(2, 4, S(), micro_batches=2)
    mixed = ParallelPlan(world_size=2, layers=(S(),) * 2 + (S(recompute=True),) * 2)
    pipeline = ParallelPlan.uniform(2, 4, S(), pp=2, micro_batches=4)
    assert uniform.is_uniform and not mixed.is_uniform

    def record(name, plan, steps, **kwargs):
        return TrialRecord(name, plan, 0.1, 1.0, statistics.median(steps), 1, steps=tuple(steps), **kwargs)

    noisy = [0.100, 0.092, 0.108, 0.097, 0.104, 0.110, 0.095, 0.101, 0.106]
    baseline = record("uniform ddp", uniform, [s + 0.001 for s in noisy])
    close = record("searched", mixed, noisy)  # 1 ms ahead, steps spread over 18 ms: not resolved
    assert simplest_within_resolution(close, [close, baseline]) is baseline
    clear = record("searched", mixed, [s - 0.015 for s in noisy])  # 16 ms ahead: resolved
    assert simplest_within_resolution(clear, [clear, baseline]) is clear
    steady = record("searched", mixed, [0.0995] * 9)  # both steady (GPU-like): 0.5 ms ahead is resolved
    steady_baseline = record("uniform ddp", uniform, [0.1] * 9)
    assert simplest_within_resolution(steady, [steady, steady_baseline]) is steady
    assert simplest_within_resolution(baseline, [close, baseline]) is baseline  # the simplest fastest needs no proof
    # A pipeline is uniform too, but more machinery than DDP over micro-batches.
    piped = record("pp2", pipeline, [s - 0.002 for s in noisy])
    assert simplest_within_resolution(piped, [piped, baseline, close]) is baseline
    # Sharding is machinery too: DDP over 2 micro-batches is simpler than ZeRO-3 over one.
    zero3 = ParallelPlan.uniform(2, 4, S(dp_type="zero3"), vocab=S(dp_type="zero3"))
    assert complexity(uniform) < complexity(zero3) and complexity(ParallelPlan.uniform(2, 4, S(tp=2))) > (
        complexity(zero3)
    )
    # A trial so noisy that a plan twice as slow is "indistinguishable" does not make it win: the tie must be close.
    wild = record("uniform ddp", ParallelPlan.uniform(2, 4, S()), [0.150, 0.215, 0.400])
    assert simplest_within_resolution(clear, [clear, wild]) is clear
    within_tie = record("uniform ddp", ParallelPlan.uniform(2, 4, S()), [0.090, 0.104, 0.140])
    assert simplest_within_resolution(baseline, [baseline, within_tie]) is within_tie
    # Simpler but not measured (stopped early) or clearly slower: the fastest stays.
    stopped = record("ddp", ParallelPlan.uniform(2, 4, S()), [0.5], stopped_early=True)
    assert simplest_within_resolution(clear, [clear, stopped]) is clear
    assert simplest_within_resolution(stopped, [stopped]) is stopped


def test_a_close_call_by_measurement_or_by_price_is_measured_again():
    from lightning_galvatron.selection.measured import TrialRecord, close_call

    def record(name, step, predicted, **kwargs):
        plan = ParallelPlan.uniform(2, 4, S(), micro_batches=2)
        return TrialRecord(name, plan, predicted, 1.0, step, 1, steps=(step,), **kwargs)

    mixed = record("fewer micro-batches", 0.1048, 0.1187)
    ddp = record("searched", 0.1389, 0.1169)  # one disturbed trial: 1.33x, though priced alike
    zero2 = record("zero2", 0.1794, 0.1564)
    stopped = record("tp", 0.3670, 0.1000, stopped_early=True)  # stopped early: never measured again
    assert close_call([ddp, mixed, zero2, stopped], 2**30) == [mixed, ddp]
    near = record("near", 0.115, 0.30)
    assert close_call([ddp, mixed, near], 2**30) == [mixed, near]  # the measured runner-up first
    far = record("far", 0.2, 0.2)
    assert close_call([mixed, far, zero2], 2**30) == []  # neither measured nor priced close
    assert close_call([mixed], 2**30) == [] and close_call([mixed, ddp], 0) == []  # nothing fits a tiny budget


class _ScriptedTrials:
    """Stands in for the trial runner in a test of the confirmation rule only: each plan's second trial (the one
    with more steps) measures what the script says; the runner itself is tested above."""

    def __init__(self, again: dict) -> None:
        self.again, self.calls = again, []

    def run(self, plan, settings, observe=True, stop_above=None):
        from lightning_galvatron.selection.settings import Measurement

        step = self.again[plan.micro_batches]
        self.calls.append(plan.micro_batches)
        return Measurement(step, 1, 0.1, steps=(step,) * settings.timed_steps), []


def _confirm_until_settled() -> dict:
    from lightning_galvatron.selection.measured import TrialRecord, _confirm_close_calls

    def record(name, micro_batches, step, predicted):
        plan = ParallelPlan.uniform(2, 4, S(), micro_batches=micro_batches)
        return TrialRecord(name, plan, predicted, 1.0, step, 1, steps=(step,) * 3)

    # The benchmark's case: DDP (m2) 113 ms and a mixed plan (here m1) 116 ms are measured again and come out at
    # 124 and 119 ms; the pipeline (here m4) at 116 ms, tried once, is then the fastest: it is measured again too.
    records = [record("pipeline", 4, 0.1164, 0.117), record("mixed", 1, 0.1161, 0.135), record("ddp", 2, 0.1133, 0.14)]
    runner = _ScriptedTrials({2: 0.1239, 1: 0.1188, 4: 0.1370})
    _confirm_close_calls(records, runner, TrialSettings(timed_steps=3), 2**30, time.perf_counter(), print, print)
    return dict(calls=runner.calls, steps={r.name: r.step_s for r in records})


def test_close_calls_are_measured_again_until_the_fastest_two_were(pools):
    for out in pools(2).run(_confirm_until_settled):
        assert out["calls"] == [1, 2, 4]  # each plan once: the runner-up first, then the new fastest
        assert out["steps"] == {"pipeline": pytest.approx(0.1370), "mixed": 0.1188, "ddp": 0.1239}


def test_the_runner_up_is_named_only_when_its_trial_was_measurably_faster_than_training(monkeypatch):
    from lightning_galvatron.strategy import trials
    from lightning_galvatron.strategy.trials import StepClock

    noisy = [0.100, 0.092, 0.108, 0.097, 0.104]
    plan = ParallelPlan.uniform(2, 4, S(), micro_batches=2)

    def report_after(training_steps, runner_up_steps):
        lines = []
        clock = StepClock(0.1, 0.1, ("uniform ddp", plan, runner_up_steps), lines.append, skip=0, steps=5)
        moments = iter([0.0, *itertools.accumulate(training_steps)])
        monkeypatch.setattr(trials.time, "perf_counter", lambda: next(moments))
        for _ in range(6):
            clock.step_started()
        (line,) = lines
        return line

    # 1 ms ahead within steps spread over 16 ms (the benchmark saw 104.0 against 104.9 ms): not named.
    assert "runner-up" not in report_after([s + 0.001 for s in noisy], noisy)
    assert "runner-up" in report_after([s + 0.020 for s in noisy], noisy)  # 20 ms: named
    assert "runner-up" not in report_after(noisy, [s + 0.020 for s in noisy])  # slower: never


@pytest.mark.parametrize(
    ("source", "header"),
    [
        ("searched", "(searched)"),
        ("searched, chosen by measurement", "(searched, chosen by measurement)"),
        ("configs/plan.json", "(given: configs/plan.json)"),
    ],
)
def test_the_report_names_a_plan_measurement_chose_as_searched_not_given(source, header):
    """When the trials pick another candidate than the search's own, the plan is still searched (it read
    "given: searched, chosen by measurement" on a CPU where the trials overturned the search)."""
    from lightning_galvatron.strategy.prediction import Prediction

    plan = ParallelPlan.uniform(1, 2, S(recompute=True), micro_batches=2, global_batch_size=8)
    prediction = Prediction(plan, source, memory_budget_bytes=2**30, missing="not priced here")
    assert prediction.searched == source.startswith("searched")
    assert setup_report(prediction).splitlines()[0] == f"Galvatron plan for 1 device {header}, global batch 8"


def test_a_plan_over_micro_batches_is_tried_beside_the_best_with_at_most_half_as_many():
    """A profile taken on a quiet core can price a micro-batch's fixed costs at nothing (measured: the benchmark
    GPT's search picked DDP over 4 micro-batches, which ran 1.2-1.3x slower than over 1), so the best plan with at
    most half the micro-batches is a candidate too."""
    import dataclasses

    from tests.test_search_cost import tiny_profile

    profile = tiny_profile().with_num_blocks(8)
    arguments = dict(
        world_size=4, memory_budget_bytes="64GB", global_batch_size=16, max_pp=1, disable=["zero2", "zero3"]
    )
    result = search(profile, **arguments)
    over_four = ParallelPlan.uniform(4, 8, S(), micro_batches=4, global_batch_size=16)
    result = dataclasses.replace(result, plan=over_four, estimate=evaluate(profile, over_four), baselines=())
    candidates = diverse_candidates(profile, result, arguments, max_candidates=20)
    fewer = [c for c in candidates if c.name == "searched, fewer micro-batches"]
    assert len(fewer) == 1 and fewer[0].plan.micro_batches <= 2 and fewer[0].estimate.fits
    with pytest.raises(ValueError, match="max_micro_batches must be a positive integer"):
        search(profile, **{**arguments, "max_micro_batches": 0})
