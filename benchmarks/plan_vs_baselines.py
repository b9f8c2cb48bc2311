"""The default ``strategy="galvatron"`` against every uniform plan and Lightning's own strategies, as a user runs it.

Same model (``harness.BenchModel``), data, global batch and optimizer for every configuration, on 2 and on 4 CPU
processes (gloo; 2 is one process per core, closer to one GPU per process):

* ``auto``: the **default path** -- ``GalvatronStrategy(memory_budget=...)`` with nothing else: no calibration
  file, a fresh (empty) profile cache for every run, so every run profiles, searches and runs its measured
  selection (trials) in ``setup``. Its setup time is reported separately and amortised over 1,000 steps;
* ``auto-cached``: right after each ``auto`` run, a second ``fit`` with the same cache: the cached selection, which
  is what most users run (every fit after their first);
* every uniform plan the search knows, executed by the same runtime: DDP (also with 2 and 4 micro-batches, and
  with recomputation), ZeRO-2, ZeRO-3, ZeRO-3 with recomputation, tensor parallelism over all devices, pipelines of
  DDP blocks (1F1B, GPipe, interleaved 1F1B);
* Lightning's ``DDPStrategy`` (PyTorch DDP) and ``ModelParallelStrategy`` with FSDP2 on every block
  (``harness.FSDP2GPT``), first-class baselines.

Settings (budgets per device, derived from the peaks the uniform plans *measured* in the first round):

* ``ample``: 1 GiB;
* ``no-ddp``: halfway between pure ZeRO-3's and pure DDP's measured peaks (DDP does not fit);
* ``zero3-recompute-only``: halfway between ZeRO-3 with recomputation's peak and the next smallest (only it fits);
* ``max_pp=1``: the ``no-ddp`` budget with pipelines switched off (``GalvatronStrategy(max_pp=1)``), where the best
  plan may mix strategies per block; it is compared with the fitting baselines without a pipeline (the user ruled
  pipelines out), and its gain over the best of them that is a uniform plan is the per-layer search's. What a mixed
  plan *can* gain is measured too: hand-built mixed plans (``mixed-m{1,2}-rc{k}``: DDP, the first ``k`` blocks
  recomputed, over 1 or 2 micro-batches; never counted as baselines) run beside the others, and the fastest that
  fits is reported against the best uniform plan.

A configuration *fits* a budget if its measured peak per rank (allocator-level, ``harness.py``) does. Runs are
interleaved over ``--rounds`` rounds (after the first, each default path right after the baseline that was its best
in the first, so the pair shares the machine's phases); throughput ratios ``auto / other`` are taken per round and
their median reported (steady state, and with each configuration's setup amortised over 1,000 steps).

    python benchmarks/plan_vs_baselines.py [--rounds 3] [--worlds 2 4]
    python benchmarks/plan_vs_baselines.py --quick     # one round, fewer steps
    python benchmarks/plan_vs_baselines.py --families gpt2 llama bert   # Hugging Face models (family_baselines.py)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from families import FAMILIES, FamilyModel, make_family_module
from harness import FSDP2GPT, RESULTS, BenchModel, interleaved, make_module, measure_run, mib, model_parallel_fsdp2
from pool import DistributedFailure, WorkerPool

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.search.report import plan_summary

AMORTISED_STEPS = 1000
#: Name prefix of the default path's second fit with the same cache (``auto-cached@<setting>``).
CACHED = "auto-cached@"


def cached_name(auto: str) -> str:
    return CACHED + auto.removeprefix("auto@")


LIGHTNING = ("lightning-ddp", "lightning-model-parallel-fsdp2")


# ---------------------------------------------------------------------------------------------- configurations
def uniform_plans(model: BenchModel, world: int) -> dict[str, ParallelPlan]:
    """Every kind of uniform plan (one strategy for every block) the search considers, for ``world`` devices."""
    L, B, W = model.n_layer, model.global_batch, world

    def uniform(strategy: S, vocab: S | None = None, **kw: Any) -> ParallelPlan:
        return ParallelPlan.uniform(W, L, strategy, vocab=vocab or strategy, global_batch_size=B, **kw)

    plans = {
        "ddp": uniform(S()),
        "ddp-m2": uniform(S(), micro_batches=2),  # micro-batches: a uniform way to shave activation memory
        "ddp-m4": uniform(S(), micro_batches=4),
        "ddp-recompute": uniform(S(recompute=True), S()),  # activations recomputed: the other uniform way
        "zero2": uniform(S(dp_type="zero2")),
        "zero3": uniform(S(dp_type="zero3")),
        "zero3-recompute": uniform(S(dp_type="zero3", recompute=True), S(dp_type="zero3")),
        f"tp{W}": uniform(S(tp=W), S(tp=W)),
        "pp2-1f1b-m4": uniform(S(), pp=2, schedule="1f1b", micro_batches=4),
        f"pp{W}-interleaved-m4": uniform(S(), pp=W, schedule="interleaved_1f1b", micro_batches=4, virtual_stages=2),
    }
    if W > 2:
        plans[f"pp{W}-gpipe-m4"] = uniform(S(), pp=W, schedule="gpipe", micro_batches=4)
    return plans


#: Name prefix of the hand-built mixed plans (:func:`mixed_plans`): measured to bound the per-layer search's gain,
#: never counted as a baseline (no user picks them without the search).
MIXED = "mixed-"


def mixed_plans(model: BenchModel, world: int) -> dict[str, ParallelPlan]:
    """Mixed plans of the kind the per-layer search trains when pure DDP does not fit and pipelines are off: DDP
    with the first ``k`` blocks recomputed and the rest not, over 1 or 2 micro-batches, for every ``k`` between
    none and all. Measured beside the uniform plans, the fastest that fits is what a mixed plan can gain on this
    machine (the ceiling the default path's ``max_pp=1`` figure is read against)."""
    L, B, W = model.n_layer, model.global_batch, world
    return {
        f"{MIXED}m{m}-rc{k}": ParallelPlan(
            world_size=W,
            layers=tuple(S(recompute=i < k) for i in range(L)),
            vocab=S(),
            micro_batches=m,
            global_batch_size=B,
        )
        for m in (1, 2)
        for k in range(1, L)
    }


def run(spec: dict, model: BenchModel, warmup: int, timed: int, memory: bool) -> dict:
    """One training run of ``spec`` (a picklable description; strategies are built in the worker)."""
    kind = spec["kind"]
    family = isinstance(model, FamilyModel)  # a Hugging Face model (family_baselines), else the example GPT
    module_cls = make_family_module if family else None
    if kind == "galvatron":

        def make() -> Any:
            return GalvatronStrategy(save_plan=False, **spec["kwargs"])
    elif kind == "lightning-model-parallel-fsdp2":
        make = model_parallel_fsdp2
        module_cls = (lambda m: make_family_module(m, fsdp2=True)) if family else (lambda m: make_module(m, FSDP2GPT))
    elif kind == "lightning-ddp":

        def make() -> Any:
            from lightning.pytorch.strategies import DDPStrategy

            return DDPStrategy(process_group_backend="gloo")
    else:
        raise ValueError(kind)

    def info(strategy: Any) -> dict:
        plan = getattr(strategy, "plan", None)
        selection = getattr(strategy, "selection", None)
        out: dict[str, Any] = {"plan": plan.to_dict() if plan is not None else None}
        if selection is not None:
            out["selection"] = {
                "seconds": selection.seconds,
                "chosen": selection.chosen.name if selection.chosen is not None else None,
                "trials": [
                    {
                        "name": t.name,
                        "plan": plan_summary(t.plan),
                        "predicted_s": t.predicted_step_s,
                        "calibrated_s": t.calibrated_step_s,
                        "measured_s": t.step_s,
                        "peak_bytes": t.peak_bytes,
                        "seconds": t.seconds,
                        "error": t.error,
                    }
                    for t in selection.trials
                ],
            }
        return out

    return measure_run(make, model, warmup=warmup, timed=timed, memory=memory, module_cls=module_cls, info=info)


# ---------------------------------------------------------------------------------------------- main
class Pools:
    """One worker pool per world size, made again when a run kills it."""

    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}

    def run(self, world: int, *args: Any, **kwargs: Any) -> Any:
        if world not in self.pools or not self.pools[world].alive:
            self.pools[world] = WorkerPool(world)
        return self.pools[world].run(*args, **kwargs)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 1 warm-up and 3 timed steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=8)
    parser.add_argument(
        "--families",
        nargs="+",
        default=["example"],
        choices=["example", *FAMILIES],
        help="example: the example GPT (BenchModel) in every setting (the default); gpt2, llama, bert: Hugging Face "
        "models at its size, the default path fresh and cached against Lightning's strategies (family_baselines.py)",
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup_steps, args.timed_steps = 1, 1, 3
    stem = "plan_vs_baselines" + ("_quick" if args.quick else "")
    if "example" in args.families:
        run_example(args, Path(args.output or RESULTS / f"{stem}.json"))
    hf = [f for f in args.families if f != "example"]
    if hf:
        output = Path(args.output or RESULTS / f"{stem}.json")
        run_families(hf, args, output.with_name(output.stem + "_families.json"))


def run_example(args: Any, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    model = BenchModel()
    started = time.perf_counter()
    pools = Pools()
    results: dict[str, Any] = {}
    tables: list[str] = []  # the printed tables, also written to the .txt next to the JSON
    scratch = Path(tempfile.mkdtemp(prefix="plan_vs_baselines_"))
    try:
        for world in args.worlds:
            results[str(world)] = measure_world(pools, world, model, args, scratch)
            table = io.StringIO()
            with contextlib.redirect_stdout(table):
                report_world(results[str(world)], world, model)
            print(table.getvalue(), end="")
            tables.append(table.getvalue())
            output.with_suffix(".txt").write_text("".join(tables).lstrip("\n"))
            write(output, results, model, args, time.perf_counter() - started)  # each world as soon as it is done
    finally:
        pools.shutdown()
    seconds = time.perf_counter() - started
    write(output, results, model, args, seconds)
    plot(results, output.with_suffix(".png"), model)
    print(f"\nresults written to {output} (.json, .txt, .png)  ({seconds:.0f} s)")


def run_families(families: list[str], args: Any, output: Path) -> None:
    from family_baselines import measure_families, report_families

    output.parent.mkdir(parents=True, exist_ok=True)
    model = FamilyModel(family="<family>")
    started = time.perf_counter()
    pools = Pools()
    results: dict[str, Any] = {}
    tables: list[str] = []
    scratch = Path(tempfile.mkdtemp(prefix="plan_vs_baselines_families_"))
    try:
        for world in args.worlds:
            results[str(world)] = measure_families(pools, world, families, args, scratch)
            table = io.StringIO()
            with contextlib.redirect_stdout(table):
                report_families(results[str(world)], world)
            print(table.getvalue(), end="")
            tables.append(table.getvalue())
            output.with_suffix(".txt").write_text("".join(tables).lstrip("\n"))
            write(output, results, model, args, time.perf_counter() - started)
    finally:
        pools.shutdown()
    seconds = time.perf_counter() - started
    write(output, results, model, args, seconds)
    print(f"\nresults written to {output} (.json, .txt)  ({seconds:.0f} s)")


def write(output: Path, results: dict, model: BenchModel, args: Any, seconds: float) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "machine": harness.machine(),
                "model": model.describe(),
                "rounds": args.rounds,
                "quick": args.quick,
                "warmup_steps": args.warmup_steps,
                "timed_steps": args.timed_steps,
                "amortised_over_steps": AMORTISED_STEPS,
                "worlds": results,
                "seconds": seconds,
            },
            indent=1,
        )
        + "\n"
    )


def measure_world(pools: Pools, world: int, model: BenchModel, args: Any, scratch: Path) -> dict:
    """Every configuration on ``world`` processes, ``args.rounds`` rounds; budgets from the first round's peaks."""
    baselines = {
        name: {"kind": "galvatron", "kwargs": {"plan": plan.to_dict()}}
        for name, plan in {**uniform_plans(model, world), **mixed_plans(model, world)}.items()
    }
    baselines.update({name: {"kind": name} for name in LIGHTNING})
    runs: dict[str, list[dict]] = {}
    counter = iter(range(10**6))

    def measure(name: str, spec: dict, memory: bool) -> None:
        try:
            result = pools.run(world, run, spec, model, args.warmup_steps, args.timed_steps, memory, timeout=900)[0]
        except DistributedFailure as failure:
            result = {"error": str(failure).splitlines()[-1][:400]}
            print(f"  {name:34s} FAILED: {result['error']}", flush=True)
        else:
            setup = f"setup {result['setup_s']:5.1f} s"
            print(f"  {name:34s} {result['step_time_s'] * 1e3:8.1f} ms  {setup}", flush=True)
        runs.setdefault(name, []).append(result)

    print(f"\n=== {world} processes: {model.describe()}")
    print("round 0 (baselines, with memory):")
    for name, spec in baselines.items():
        measure(name, spec, True)
    peaks = {name: _peak(rs) for name, rs in runs.items() if _peak(rs) is not None}
    settings = budgets({name: peak for name, peak in peaks.items() if not name.startswith(MIXED)})
    for name, setting in settings.items():
        print(f"  budget {name}: {mib(setting['budget_bytes']) if setting['budget_bytes'] else '-'} ({setting['why']})")

    def auto_spec(setting: dict, cache: Path) -> dict:
        kwargs = {"memory_budget": setting["budget_bytes"], "profile_cache": str(cache), **setting.get("strategy", {})}
        return {"kind": "galvatron", "kwargs": kwargs}

    def measure_auto(name: str, memory: bool) -> None:
        """The default path twice: with a fresh cache (the run profiles, searches and tries plans), then a second fit
        with the same cache (its cached selection: what most users run)."""
        cache = scratch / f"cache-{world}-{next(counter)}"
        measure(name, auto_spec(autos[name], cache), memory)
        measure(cached_name(name), auto_spec(autos[name], cache), False)

    autos = {f"auto@{name}": s for name, s in settings.items() if s["budget_bytes"]}
    print("round 0 (default path, fresh cache then cached):")
    for name in autos:
        measure_auto(name, True)
    # In the later rounds each default path runs right after the baseline that was its best in round 0: the pair
    # the headline ratio compares shares the machine's slow and fast phases (they last longer than one run here).
    first = ratios(runs, settings)
    partners = {f"auto@{s}": row["best_baseline"] for s, row in first.items() if "best_baseline" in row}
    for r in range(1, args.rounds):
        print(f"round {r}:")
        for name in paired_order(list(baselines), list(autos), partners, r):
            if name in autos:
                measure_auto(name, False)
            else:
                measure(name, baselines[name], False)
    return {"runs": runs, "settings": settings, "peaks": peaks, "ratios": ratios(runs, settings)}


def paired_order(baselines: list[str], autos: list[str], partners: dict[str, str], round_: int) -> list[str]:
    """One round's order: the baselines rotated by the round (as ``harness.interleaved``), each default path right
    after its partner baseline (at the end of the round where it has none)."""
    order = [name for _, name in interleaved(baselines, round_ + 1) if _ == round_]
    for auto in autos:
        partner = partners.get(auto)
        order.insert(order.index(partner) + 1 if partner in order else len(order), auto)
    return order


def _peak(results: list[dict]) -> int | None:
    for r in results:
        if (
            "error" not in r
            and r.get("memory_source") != "none"
            and all(p is not None for p in r["peak_bytes_per_rank"])
        ):
            return max(r["peak_bytes_per_rank"])
    return None


def budgets(peaks: dict[str, int]) -> dict[str, dict]:
    """The settings' budgets from the measured peaks of the uniform plans."""
    out: dict[str, dict] = {"ample": {"budget_bytes": 2**30, "why": "ample"}}
    if "ddp" in peaks and "zero3" in peaks and peaks["zero3"] < peaks["ddp"]:
        tight = int((peaks["ddp"] + peaks["zero3"]) / 2)
        out["no-ddp"] = {"budget_bytes": tight, "why": "halfway between pure ZeRO-3's and pure DDP's measured peaks"}
        out["max_pp=1"] = {"budget_bytes": tight, "why": "no-ddp budget, no pipelines", "strategy": {"max_pp": 1}}
    else:
        out["no-ddp"] = {"budget_bytes": None, "why": "pure ZeRO-3 did not measure below pure DDP"}
    rc = peaks.get("zero3-recompute")
    others = [p for name, p in peaks.items() if name != "zero3-recompute"]
    if rc is not None and others and rc < min(others):
        out["zero3-recompute-only"] = {
            "budget_bytes": int((rc + min(others)) / 2),
            "why": "halfway between ZeRO-3 with recomputation's peak and the next smallest measured peak",
        }
    else:
        out["zero3-recompute-only"] = {
            "budget_bytes": None,
            "why": "ZeRO-3 with recomputation is not the smallest measured peak",
        }
    return out


def ratios(runs: dict[str, list[dict]], settings: dict[str, dict]) -> dict[str, Any]:
    """Per setting: the default path against every configuration that fits, per round (steady and amortised)."""
    out: dict[str, Any] = {}
    peaks = {name: _peak(rs) for name, rs in runs.items()}

    def ok(rs: list[dict]) -> list[dict]:
        return [r for r in rs if "error" not in r]

    for name, setting in settings.items():
        auto = f"auto@{name}"
        budget = setting["budget_bytes"]
        if not budget or not ok(runs.get(auto, [])):
            out[name] = {"skipped": setting["why"] if not budget else "the default path failed", "budget_bytes": budget}
            continue
        row: dict[str, Any] = {"budget_bytes": budget, "versus": {}}
        autos = runs[auto]
        for other, rs in runs.items():
            if other.startswith(("auto@", CACHED)):
                continue
            pairs = [(a, b) for a, b in zip(autos, rs) if "error" not in a and "error" not in b]
            if not pairs:
                continue
            steady = [b["step_time_s"] / a["step_time_s"] for a, b in pairs]
            amortised = [_amortised(b) / _amortised(a) for a, b in pairs]
            row["versus"][other] = {
                "fits": peaks.get(other) is not None and peaks[other] <= budget,
                "peak_bytes": peaks.get(other),
                "step_s": statistics.median(b["step_time_s"] for _, b in pairs),
                "setup_s": statistics.median(b["setup_s"] for _, b in pairs),
                "throughput_ratio": statistics.median(steady),
                "amortised_ratio": statistics.median(amortised),
                "per_round": steady,
            }
        ok_autos = ok(autos)
        row["auto"] = {
            "step_s": statistics.median(a["step_time_s"] for a in ok_autos),
            "setup_s": statistics.median(a["setup_s"] for a in ok_autos),
            "peak_bytes": peaks.get(auto),
            "fits": peaks.get(auto) is not None and peaks[auto] <= budget,
            "plans": [plan_summary(ParallelPlan.from_dict(a["info"]["plan"])) for a in ok_autos],
            "mixed": [len({*ParallelPlan.from_dict(a["info"]["plan"]).layers}) > 1 for a in ok_autos],
            "selection": ok_autos[0]["info"].get("selection"),
        }
        fitting = {k: v for k, v in row["versus"].items() if v["fits"]}
        if setting.get("strategy", {}).get("max_pp") == 1:  # the user ruled pipelines out: so do the baselines
            fitting = {k: v for k, v in fitting.items() if not k.startswith("pp")}
        mixed = {k: v for k, v in fitting.items() if k.startswith(MIXED)}
        fitting = {k: v for k, v in fitting.items() if k not in mixed}
        if fitting:
            best = min(fitting, key=lambda k: fitting[k]["step_s"])
            row["best_baseline"] = best
            # Where the default path trains the best baseline's own plan, the ratio can only differ from 1 by noise.
            own = {plan_summary(ParallelPlan.from_dict(r["info"]["plan"])) for r in ok(runs[best]) if r["info"]["plan"]}
            row["rounds_with_best_baselines_plan"] = sum(p in own for p in row["auto"]["plans"])
            uniform = {k: v for k, v in fitting.items() if k not in LIGHTNING}
            if uniform:
                row["best_uniform"] = min(uniform, key=lambda k: uniform[k]["step_s"])
        cached = ok(runs.get(cached_name(auto), []))
        if cached:  # the second fit with the same cache: its cached selection
            row["cached"] = {
                "step_s": statistics.median(a["step_time_s"] for a in cached),
                "setup_s": statistics.median(a["setup_s"] for a in cached),
                "plans": [plan_summary(ParallelPlan.from_dict(a["info"]["plan"])) for a in cached],
            }
            if "best_baseline" in row:
                row["cached"]["versus_best"] = versus(runs[cached_name(auto)], runs[row["best_baseline"]])
        # The mixed plans have no pipeline: they bound the per-layer search's gain where pipelines are off.
        if mixed and setting.get("strategy", {}).get("max_pp") == 1:
            row["best_mixed"] = min(mixed, key=lambda k: mixed[k]["step_s"])
            if "best_uniform" in row:  # per round, as every ratio: the best uniform plan's step over the mixed one's
                best_uniform = runs[row["best_uniform"]]
                pairs = [
                    (u, x)
                    for u, x in zip(best_uniform, runs[row["best_mixed"]])
                    if "error" not in u and "error" not in x
                ]
                row["mixed_over_uniform"] = statistics.median(u["step_time_s"] / x["step_time_s"] for u, x in pairs)
        out[name] = row
    return out


def _amortised(run: dict) -> float:
    return run["step_time_s"] + run["setup_s"] / AMORTISED_STEPS


def versus(autos: list[dict], others: list[dict]) -> dict | None:
    """The default path's throughput over another configuration's, per round where both ran (steady and with the
    setup amortised over ``AMORTISED_STEPS`` steps), and the medians."""
    pairs = [(a, b) for a, b in zip(autos, others) if "error" not in a and "error" not in b]
    if not pairs:
        return None
    steady = [b["step_time_s"] / a["step_time_s"] for a, b in pairs]
    return {
        "throughput_ratio": statistics.median(steady),
        "amortised_ratio": statistics.median(_amortised(b) / _amortised(a) for a, b in pairs),
        "per_round": steady,
    }


def report_world(result: dict, world: int, model: BenchModel) -> None:
    print(f"\nDefault path vs baselines on {world} CPU processes, {model.describe()}")
    for name, row in result["ratios"].items():
        if "skipped" in row:
            print(f"\n{name}: skipped ({row['skipped']})")
            continue
        auto = row["auto"]
        print(f"\n{name} budget: {mib(row['budget_bytes'])} per device")
        print(
            f"  default path: {auto['step_s'] * 1e3:.0f} ms/step, setup {auto['setup_s']:.1f} s, peak "
            f"{mib(auto['peak_bytes']) if auto['peak_bytes'] else '-'} ({'fits' if auto['fits'] else 'DOES NOT FIT'}); "
            f"plan(s): {'; '.join(dict.fromkeys(auto['plans']))}"
        )
        print(
            f"  {'configuration':34s} {'step':>8s} {'setup':>7s} {'peak/rank':>10s} {'fits':>5s} {'auto/it':>8s} "
            f"{'amortised':>9s}"
        )
        for other, v in sorted(row["versus"].items(), key=lambda kv: kv[1]["step_s"]):
            peak = mib(v["peak_bytes"]) if v["peak_bytes"] else "-"
            print(
                f"  {other:34s} {v['step_s'] * 1e3:6.0f}ms {v['setup_s']:6.1f}s {peak:>10s} "
                f"{'yes' if v['fits'] else 'NO':>5s} "
                f"{v['throughput_ratio']:7.2f}x {v['amortised_ratio']:8.2f}x"
            )
        for label in ("best_baseline", "best_uniform", "best_mixed"):
            if label in row:
                v = row["versus"][row[label]]
                print(
                    f"  default path vs the {label.replace('_', ' ')} {'plan ' if label == 'best_mixed' else ''}"
                    f"that fits ({row[label]}): {v['throughput_ratio']:.2f}x "
                    f"steady, {v['amortised_ratio']:.2f}x with setup amortised over {AMORTISED_STEPS} steps"
                )
        cached = row.get("cached")
        if cached:
            against = cached.get("versus_best")
            print(
                f"  cached selection (a second fit, same cache): {cached['step_s'] * 1e3:.0f} ms/step, setup "
                f"{cached['setup_s']:.1f} s, plan(s): {'; '.join(dict.fromkeys(cached['plans']))}"
                + (
                    f"; vs the best baseline: {against['throughput_ratio']:.2f}x steady, "
                    f"{against['amortised_ratio']:.2f}x amortised (per round: "
                    f"{', '.join(f'{x:.2f}' for x in against['per_round'])})"
                    if against
                    else ""
                )
            )
        if row.get("rounds_with_best_baselines_plan"):
            print(
                f"  the default path trained {row['best_baseline']}'s own plan in "
                f"{row['rounds_with_best_baselines_plan']} of {len(auto['plans'])} rounds"
            )
        if "mixed_over_uniform" in row:
            print(
                f"  the best mixed plan that fits ({row['best_mixed']}) vs the best uniform ({row['best_uniform']}): "
                f"{row['mixed_over_uniform']:.2f}x (what the per-layer search can gain here)"
            )


def plot(results: dict, path: Path, model: BenchModel) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (w, name, row) for w, res in results.items() for name, row in res["ratios"].items() if "skipped" not in row
    ]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 5.0), squeeze=False)
    for ax, (world, name, row) in zip(axes[0], panels):
        names = ["default path", *sorted(row["versus"], key=lambda k: row["versus"][k]["step_s"])]
        steps = [row["auto"]["step_s"], *(row["versus"][k]["step_s"] for k in names[1:])]
        fits = [row["auto"]["fits"], *(row["versus"][k]["fits"] for k in names[1:])]
        colors = ["tab:green" if i == 0 else ("tab:blue" if f else "tab:gray") for i, f in enumerate(fits)]
        ax.barh(range(len(names)), [model.global_batch / s for s in steps], color=colors)
        ax.set_yticks(range(len(names)), [n + ("" if f else " (no fit)") for n, f in zip(names, fits)], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{world} processes, {name}: {row['budget_bytes'] / 2**20:.0f} MiB", fontsize=8)
        ax.set_xlabel("samples/s (median of rounds)", fontsize=8)
    fig.suptitle(f"Default strategy='galvatron' vs uniform plans and Lightning: {model.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
