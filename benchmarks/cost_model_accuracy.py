"""Cost-model accuracy: predicted against measured step time and per-rank peak memory, for many plans.

On 4 CPU processes (gloo), the example GPT (``harness.BenchModel``) is profiled by the profiler the
strategy uses, then trained through ``GalvatronStrategy`` with each plan below: uniform DDP, ZeRO-2,
ZeRO-3, ZeRO-3 with recomputation, DDP with 4 micro-batches, TP, Megatron-SP with ZeRO-2, Ulysses,
pipelines (1F1B, GPipe), four heterogeneous plans, and the plans the search picks for an ample and for a
tight budget (with and without calibration, when they differ).

Four predictions of step time per plan:

* ``uncalibrated``: the cost model as the search uses it from the profile alone;
* ``calibrated``: the same model calibrated (``lightning_galvatron.search.calibration``) from what the
  runtime profiler measured on three *probe* plans -- one block of every kind, at two micro-batch sizes,
  and a pipeline (``lightning_galvatron.cli.calibrate.probe_plans``); no evaluated plan is a probe;
* ``held out``: calibrated from the runtime profiler's measurements of every *other* plan and the probes
  (leave one out: a plan's own measurements never price it) -- what a strategy that has run other plans
  on this machine predicts for a new one;
* ``after selection``: calibrated as measured selection calibrates itself from its own trials in the
  default path (``GalvatronStrategy(plan="auto", memory_budget=1 GiB, profile_cache=<fresh directory>)``,
  default ``trials``; ``strategy.selection.calibration``), with the profile that strategy measured; also
  over the plans that use only mechanisms its trials measured (the calibration prices the others by its
  shared terms only: the calibrated search is kept away from them for that reason).

Memory is predicted twice per stage: by :func:`~lightning_galvatron.search.evaluate` (the plan's own transient
memory) and as the search prices the plan against the budget while searching
(:func:`~lightning_galvatron.search.engine.search_memory_per_stage`: a working reserve that depends only on the
plan's reserve level and each stage's last block, so that its block DP stays additive).

Runs are interleaved (every plan and probe once per round, the order rotated) over ``--rounds`` rounds;
a plan's step time is its median over rounds. Memory is measured once per plan, by the allocator-level
accounting of ``harness.py`` (a CPU ``max_memory_allocated``; on CUDA the real one), and compared per
pipeline stage (the largest rank of the stage). Printed and written to
``benchmarks/results/cost_model_accuracy.{json,png}``: per plan predicted vs measured, the mean absolute
percentage error (MAPE) of step time and memory, and the Spearman rank correlation of predicted and
measured step time.

    python benchmarks/cost_model_accuracy.py [--rounds 3] [--timed-steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import RESULTS, BenchModel, fit_from_runs, interleaved, mape, measure_run, mib, spearman, worker_pool

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.cli.calibrate import probe_plans
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import evaluate, search
from lightning_galvatron.search.calibration import Calibration
from lightning_galvatron.search.candidates import unmeasured
from lightning_galvatron.search.engine import search_memory_per_stage

WORLD = 4
PRECISION = "32-true"
OPTIMIZER = "adamw"


# ---------------------------------------------------------------------------------------------- plans
def fixed_plans(model: BenchModel) -> dict[str, ParallelPlan]:
    """Fourteen diverse plans, each executable by the runtime for this model on 4 devices."""
    L, B, W = model.n_layer, model.global_batch, WORLD
    half = L // 2

    def uniform(strategy: S, vocab: S | None = None, **kw: Any) -> ParallelPlan:
        return ParallelPlan.uniform(W, L, strategy, vocab=vocab or strategy, global_batch_size=B, **kw)

    def mixed(first: S, second: S, vocab: S) -> ParallelPlan:
        return ParallelPlan(W, (first,) * half + (second,) * (L - half), vocab=vocab, global_batch_size=B)

    return {
        "ddp": uniform(S()),
        "zero2": uniform(S(dp_type="zero2")),
        "zero3": uniform(S(dp_type="zero3")),
        "zero3-recompute": uniform(S(dp_type="zero3", recompute=True), S(dp_type="zero3")),
        "ddp-4-micro-batches": uniform(S(), micro_batches=4),
        "tp4": uniform(S(tp=4), S(tp=4)),
        "tp2-megatron-sp-zero2": uniform(S(tp=2, sp="megatron", dp_type="zero2"), S(dp_type="zero2")),
        "ulysses4": uniform(S(tp=4, sp="ulysses"), S()),
        "pp2-1f1b-m4": uniform(S(), pp=2, schedule="1f1b", micro_batches=4),
        "pp4-gpipe-m4": uniform(S(), pp=4, schedule="gpipe", micro_batches=4),
        "hetero-zero3-then-ddp-recompute": mixed(S(dp_type="zero3"), S(recompute=True), S(dp_type="zero3")),
        "hetero-tp2-zero2-then-ddp": mixed(S(tp=2, dp_type="zero2"), S(), S()),
        # Recomputed blocks first: their replays come after the later blocks' activations are freed.
        "hetero-ddp-recompute-then-ddp": mixed(S(recompute=True), S(), S()),
        "hetero-m2-block0-recompute": ParallelPlan(
            W, (S(recompute=True),) + (S(),) * (L - 1), vocab=S(), global_batch_size=B, micro_batches=2
        ),
    }


def budgets(model: BenchModel, profile: Profile) -> dict[str, int]:
    """An ample budget (1 GiB) and a tight one, halfway between pure ZeRO-3's and pure DDP's predicted peaks."""
    peaks = {
        dp: evaluate(
            profile,
            ParallelPlan.uniform(WORLD, model.n_layer, S(dp_type=dp), global_batch_size=model.global_batch),
            precision=PRECISION,
            optimizer=OPTIMIZER,
        ).peak_memory_bytes
        for dp in ("ddp", "zero3")
    }
    return {"ample": 2**30, "tight": int((peaks["ddp"] + peaks["zero3"]) / 2)}


def auto_plans(model: BenchModel, profile: Profile, calibration: Any) -> dict[str, ParallelPlan]:
    """What the search picks for each budget, calibrated (what a calibrated strategy runs) and not."""
    out = {}
    for name, budget in budgets(model, profile).items():
        kwargs = dict(global_batch_size=model.global_batch, precision=PRECISION, optimizer=OPTIMIZER, baselines=False)
        calibrated = search(profile, WORLD, budget, calibration=calibration, **kwargs).plan
        uncalibrated = search(profile, WORLD, budget, **kwargs).plan
        out[f"auto-{name}"] = calibrated
        if uncalibrated != calibrated:
            out[f"auto-{name}-uncalibrated-search"] = uncalibrated
    return out


# ---------------------------------------------------------------------------------------------- workers
def profile_on_ranks(model: BenchModel) -> tuple[dict, float]:
    """Profile the model on the pool's ranks as ``plan="auto"`` does (no cache: measured in this run)."""
    import torch.distributed as dist

    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler import profile

    module = harness.make_module(model)
    batch = next(iter(harness.make_loader(model, dist.get_world_size())))
    started = time.perf_counter()
    measured = profile(
        module, find_blocks(module), batch, precision=PRECISION, devices_per_node=dist.get_world_size(), cache=False
    )
    return measured.to_dict(), time.perf_counter() - started


def run_plan(plan: dict, model: BenchModel, warmup: int, timed: int, memory: bool, runtime_profile: bool) -> dict:
    return measure_run(
        lambda: GalvatronStrategy(plan=plan, save_plan=False),
        model,
        warmup=warmup,
        timed=timed,
        memory=memory,
        runtime_profile=runtime_profile,
    )


def select_on_ranks(model: BenchModel, budget: int, cache: str) -> dict:
    """Measured selection in its default path, on the pool's ranks: what it chose and the calibration it fitted."""

    def selection_info(strategy: GalvatronStrategy) -> dict:
        selection = strategy.selection
        prediction = strategy.prediction
        return {
            "calibration": None if selection.calibration is None else selection.calibration.to_dict(),
            "profile": None if prediction is None or prediction.profile is None else prediction.profile.to_dict(),
            "trials": [t.to_dict() for t in selection.trials],
            "observations": [o.to_dict() for o in selection.observations],  # what the calibration was fitted to
            "plan": selection.plan.to_dict(),
            "note": selection.note,
            "seconds": selection.seconds,
        }

    result = measure_run(
        lambda: GalvatronStrategy(plan="auto", memory_budget=budget, profile_cache=cache, save_plan=False),
        model,
        warmup=0,
        timed=1,
        memory=False,
        info=selection_info,
    )
    return result["info"]


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--output", default=str(RESULTS / "cost_model_accuracy.json"))
    args = parser.parse_args()
    model = BenchModel()
    started = time.perf_counter()
    probes: dict[str, ParallelPlan] = {}
    runs: dict[str, list[dict]] = {}

    def run(name: str, plan: ParallelPlan, memory: bool) -> None:
        result = pool.run(
            run_plan,
            plan.to_dict(),
            model,
            args.warmup_steps,
            args.timed_steps,
            memory and name not in probes,
            True,
            timeout=600,
        )[0]
        runs.setdefault(name, []).append(result)
        print(f"  {name:40s} {result['step_time_s'] * 1e3:8.1f} ms", flush=True)

    with worker_pool(WORLD) as pool:
        profile_dict, profile_s = pool.run(profile_on_ranks, model)[0]
        profile = Profile.from_dict(profile_dict)
        probes.update(probe_plans(profile, WORLD, model.global_batch))
        print(f"profiled in {profile_s:.1f} s; calibration probes:")
        for name, plan in probes.items():
            run(name, plan, memory=False)
        first = fit_from_runs(profile, [r for name in probes for r in runs[name]], PRECISION, OPTIMIZER)
        plans = {**fixed_plans(model), **auto_plans(model, profile, first)}
        everything = {**plans, **probes}
        current = None
        for r, name in interleaved(list(everything), args.rounds):
            if name in probes and r == 0:
                continue  # measured above
            if r != current:
                print(f"round {r}:")
                current = r
            run(name, everything[name], memory=r == 0)
        print("measured selection (plan='auto', default trials, fresh profile cache):", flush=True)
        with tempfile.TemporaryDirectory(prefix="galvatron-accuracy-") as cache:
            selection = pool.run(select_on_ranks, model, SELECTION_BUDGET, cache, timeout=900)[0]
    calibration = fit_from_runs(profile, [r for name in probes for r in runs[name]], PRECISION, OPTIMIZER)
    print(f"\ncalibration from the probes: {calibration.describe()}")
    selected = selection_calibration(selection)
    tried = [ParallelPlan.from_dict(t["plan"]) for t in selection["trials"] if t["step_s"] is not None]
    rows = []
    for name, plan in plans.items():
        others = fit_from_runs(
            profile, [r for other, rs in runs.items() if other != name for r in rs], PRECISION, OPTIMIZER
        )
        rows.append(row(name, plan, runs[name], profile, calibration, others, selected))
        rows[-1]["mechanisms_measured_by_selection"] = not (mechanisms(plan) & unmeasured(tried))
    report(rows, model, args, time.perf_counter() - started, profile_dict, calibration, probes, runs, selection)


def mechanisms(plan: ParallelPlan) -> frozenset[str]:
    """The search's names of the mechanisms ``plan`` uses (what a calibration needs to have seen to price it)."""
    return unmeasured([]) - unmeasured([plan])


#: The memory budget measured selection is given (the ample one of :func:`budgets`: every kind of plan fits).
SELECTION_BUDGET = 2**30


def selection_calibration(selection: dict) -> tuple[Profile, Calibration] | None:
    """The profile and calibration measured selection priced with, or None when it fitted none."""
    if selection["calibration"] is None or selection["profile"] is None:
        return None
    return Profile.from_dict(selection["profile"]), Calibration.from_dict(selection["calibration"])


def row(
    name: str,
    plan: ParallelPlan,
    runs: list[dict],
    profile: Profile,
    calibration: Any,
    others: Any,
    selected: tuple[Profile, Calibration] | None,
) -> dict:
    plain = evaluate(profile, plan, precision=PRECISION, optimizer=OPTIMIZER)
    calibrated = evaluate(profile, plan, precision=PRECISION, optimizer=OPTIMIZER, calibration=calibration)
    held_out = evaluate(profile, plan, precision=PRECISION, optimizer=OPTIMIZER, calibration=others)
    after_selection = None
    if selected is not None:
        after_selection = evaluate(
            selected[0], plan, precision=PRECISION, optimizer=OPTIMIZER, calibration=selected[1]
        ).step_time_s
    try:
        searched: list[float] | None = list(
            search_memory_per_stage(profile, plan, precision=PRECISION, optimizer=OPTIMIZER)
        )
    except ValueError as err:  # a plan outside the search space: the search never prices it
        searched, why = None, str(err)
    else:
        why = ""
    peaks = next(run["peak_bytes_per_rank"] for run in runs if run["memory_source"] != "none")
    n = plan.devices_per_stage
    return {
        "name": name,
        "plan": plan.to_dict(),
        "measured_step_s": statistics.median(run["step_time_s"] for run in runs),
        "measured_step_s_per_round": [run["step_time_s"] for run in runs],
        "predicted_step_s": plain.step_time_s,
        "calibrated_step_s": calibrated.step_time_s,
        "held_out_step_s": held_out.step_time_s,
        "after_selection_step_s": after_selection,
        "observations": [_without_plan(run["info"].get("observations", [])) for run in runs],
        "predicted_peak_bytes_per_stage": list(plain.peak_memory_bytes_per_stage),
        "search_peak_bytes_per_stage": searched,
        "search_peak_missing": why,
        "measured_peak_bytes_per_stage": [max(peaks[s * n : (s + 1) * n]) for s in range(plan.pp)],
        "measured_peak_bytes_per_rank": peaks,
        "memory_source": next(run["memory_source"] for run in runs if run["memory_source"] != "none"),
        "predicted_stages": [s.to_dict() for s in plain.stages],
    }


def _without_plan(observations: list[dict]) -> list[dict]:
    """Runtime-profiler observations for the JSON, without the plan each repeats (the row has it)."""
    return [{k: v for k, v in o.items() if k != "plan"} for o in observations]


def summarise(rows: list[dict]) -> dict[str, float]:
    measured = [r["measured_step_s"] for r in rows]
    out = {}
    for kind in LABELS:
        predicted = [r[f"{kind}_step_s"] for r in rows]
        if None in predicted:  # measured selection fitted no calibration
            out[f"{kind}_step_time_mape"] = out[f"{kind}_step_time_spearman"] = None
            continue
        out[f"{kind}_step_time_mape"] = mape(predicted, measured)
        out[f"{kind}_step_time_spearman"] = spearman(predicted, measured)
    covered = [r for r in rows if r.get("mechanisms_measured_by_selection")]
    if covered and out["after_selection_step_time_mape"] is not None:
        predicted = [r["after_selection_step_s"] for r in covered]
        out["after_selection_covered_step_time_mape"] = mape(predicted, [r["measured_step_s"] for r in covered])
        out["after_selection_covered_step_time_spearman"] = spearman(predicted, [r["measured_step_s"] for r in covered])
    out["after_selection_covered_plans"] = len(covered)
    out["memory_mape"] = mape(
        [p for r in rows for p in r["predicted_peak_bytes_per_stage"]],
        [m for r in rows for m in r["measured_peak_bytes_per_stage"]],
    )
    priced = [r for r in rows if r["search_peak_bytes_per_stage"] is not None]
    out["search_memory_mape"] = mape(
        [p for r in priced for p in r["search_peak_bytes_per_stage"]],
        [m for r in priced for m in r["measured_peak_bytes_per_stage"]],
    )
    out["search_memory_plans"] = len(priced)
    # What the search adds to evaluate()'s estimate: its strategy-independent working reserve, per stage.
    out["search_minus_evaluate_bytes_per_stage"] = statistics.fmean(
        s - e for r in priced for s, e in zip(r["search_peak_bytes_per_stage"], r["predicted_peak_bytes_per_stage"])
    )
    out["plans"] = len(rows)
    out |= measurement_noise(rows)
    return out


def measurement_noise(rows: list[dict]) -> dict[str, Any]:
    """How far the benchmark's own measurements agree with themselves: the yardstick for the MAPEs above.

    ``round_vs_others_mape``: each round of each plan against the median of that plan's other rounds (measured
    selection prices plans from one trial each, so it cannot be expected to come closer than one round does);
    ``same_plan_pairs``: plans benchmarked twice under two names (the search often picks one plan for two
    budgets), with the difference of their medians."""
    errors = [
        abs(run / statistics.median(r["measured_step_s_per_round"][:i] + r["measured_step_s_per_round"][i + 1 :]) - 1)
        for r in rows
        if len(r["measured_step_s_per_round"]) > 1
        for i, run in enumerate(r["measured_step_s_per_round"])
    ]
    pairs = [
        {"plans": [a["name"], b["name"]], "ratio": b["measured_step_s"] / a["measured_step_s"]}
        for i, a in enumerate(rows)
        for b in rows[i + 1 :]
        if a["plan"] == b["plan"]
    ]
    return {"round_vs_others_mape": statistics.fmean(errors) if errors else None, "same_plan_pairs": pairs}


def report(rows, model, args, seconds, profile_dict, calibration, probes, runs, selection) -> None:
    summary = summarise(rows)
    print(f"\nCost model accuracy on {WORLD} CPU processes, {model.describe()}, median of {args.rounds} rounds")
    print(
        f"{'plan':40s} {'measured':>8s} {'model':>13s} {'probes':>13s} {'others':>13s} {'selection':>13s}   "
        f"{'memory':>9s} {'evaluate':>15s} {'search':>15s}"
    )
    for r in rows:
        meas = r["measured_step_s"]
        cells = " ".join(
            f"{'-':>13s}" if r[k] is None else f"{r[k] * 1e3:6.0f}ms {r[k] / meas - 1:+5.0%}"
            for k in ("predicted_step_s", "calibrated_step_s", "held_out_step_s", "after_selection_step_s")
        )
        mm, mp = max(r["measured_peak_bytes_per_stage"]), max(r["predicted_peak_bytes_per_stage"])
        searched = r["search_peak_bytes_per_stage"]
        ms = f"{'-':>15s}" if searched is None else f"{mib(max(searched)):>9s} {max(searched) / mm - 1:+5.0%}"
        print(f"{r['name']:40s} {meas * 1e3:6.0f}ms {cells}   {mib(mm):>9s} {mib(mp):>9s} {mp / mm - 1:+5.0%} {ms}")
    for r in rows:
        if r["search_peak_missing"]:
            print(f"{r['name']}: not priced as the search prices plans: {r['search_peak_missing']}")
    trials = [t for t in selection["trials"] if t.get("step_s") is not None]
    print(
        f"measured selection: {len(selection['trials'])} plans tried ({len(trials)} measured) in "
        f"{selection['seconds']:.1f} s" + (f"; {selection['note']}" if selection["note"] else "")
    )
    if selection["calibration"] is None:
        print(
            "measured selection fitted no calibration (fewer than 3 plans measured): no 'after measured "
            "selection' prediction"
        )
    for kind, label in LABELS.items():
        if summary[f"{kind}_step_time_mape"] is None:
            continue
        print(
            f"step time, {label:44s} MAPE {summary[f'{kind}_step_time_mape']:6.1%}, Spearman "
            f"{summary[f'{kind}_step_time_spearman']:.2f}"
        )
    if "after_selection_covered_step_time_mape" in summary:
        print(
            f"  of which the {summary['after_selection_covered_plans']} plans using only mechanisms its trials "
            f"measured:{'':3s} MAPE {summary['after_selection_covered_step_time_mape']:6.1%}, Spearman "
            f"{summary['after_selection_covered_step_time_spearman']:.2f}"
        )
    if summary["round_vs_others_mape"] is not None:
        print(
            f"the measurement itself: one round against the median of the others{'':9s} MAPE "
            f"{summary['round_vs_others_mape']:6.1%}   (a prediction fitted from one trial per plan has this floor)"
        )
    for pair in summary["same_plan_pairs"]:
        print(f"  one plan benchmarked twice: {' and '.join(pair['plans'])}, medians {pair['ratio']:.2f}x apart")
    print(
        f"peak memory per rank (per stage), evaluate():{'':11s} MAPE {summary['memory_mape']:6.1%}   "
        f"({len(rows)} plans, {seconds:.0f} s)"
    )
    print(
        f"peak memory per rank (per stage), as the search prices it: MAPE {summary['search_memory_mape']:6.1%}   "
        f"({summary['search_memory_plans']} plans; its working reserve adds "
        f"{mib(summary['search_minus_evaluate_bytes_per_stage'])} per stage on average)"
    )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": harness.machine(),
                "model": model.describe(),
                "world_size": WORLD,
                "rounds": args.rounds,
                "summary": summary,
                "calibration_from_probes": calibration.to_dict(),
                "measured_selection": selection,
                "plans": rows,
                "probes": {
                    name: {
                        "plan": plan.to_dict(),
                        "step_s_per_round": [r["step_time_s"] for r in runs[name]],
                        "observations": [_without_plan(r["info"].get("observations", [])) for r in runs[name]],
                    }
                    for name, plan in probes.items()
                },
                "profile": profile_dict,
                "seconds": seconds,
            },
            indent=1,
        )
        + "\n"
    )
    plot(rows, summary, out.with_suffix(".png"), model)
    print(f"results written to {out} and {out.with_suffix('.png')}")


LABELS = {
    "predicted": "uncalibrated (profile only):",
    "calibrated": "calibrated from the 3 probe plans:",
    "held_out": "calibrated from every other plan (held out):",
    "after_selection": "after measured selection (its own trials):",
}


def plot(rows: list[dict], summary: dict, path: Path, model: BenchModel) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2))
    measured = [r["measured_step_s"] * 1e3 for r in rows]
    for (kind, label), marker in zip(LABELS.items(), "o^sD"):
        if summary[f"{kind}_step_time_mape"] is None:
            continue
        predicted = [r[f"{kind}_step_s"] * 1e3 for r in rows]
        left.scatter(
            measured,
            predicted,
            marker=marker,
            s=22,
            label=(
                f"{label[:-1]}: MAPE {summary[f'{kind}_step_time_mape']:.0%}, Spearman "
                f"{summary[f'{kind}_step_time_spearman']:.2f}"
            ),
        )
    for r, x in zip(rows, measured):
        left.annotate(r["name"], (x, r["held_out_step_s"] * 1e3), fontsize=5, xytext=(3, 3), textcoords="offset points")
    lo, hi = min(measured) * 0.4, max(measured) * 1.3
    left.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    left.set(
        xscale="log",
        yscale="log",
        xlabel="measured step time (ms)",
        ylabel="predicted step time (ms)",
        title="Step time",
    )
    left.legend(fontsize=8)
    mm = [m / 2**20 for r in rows for m in r["measured_peak_bytes_per_stage"]]
    mp = [p / 2**20 for r in rows for p in r["predicted_peak_bytes_per_stage"]]
    right.scatter(mm, mp, label=f"evaluate(), per stage: MAPE {summary['memory_mape']:.1%}")
    priced = [r for r in rows if r["search_peak_bytes_per_stage"] is not None]
    right.scatter(
        [m / 2**20 for r in priced for m in r["measured_peak_bytes_per_stage"]],
        [p / 2**20 for r in priced for p in r["search_peak_bytes_per_stage"]],
        marker="^",
        label=f"as the search prices it: MAPE {summary['search_memory_mape']:.1%}",
    )
    lo, hi = min(mm) * 0.8, max(mm) * 1.2
    right.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    right.set(xlabel="measured peak memory per rank (MiB)", ylabel="predicted (MiB)", title="Peak memory")
    right.legend(fontsize=8)
    fig.suptitle(f"Cost model vs measurement, 4 CPU processes: {model.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
