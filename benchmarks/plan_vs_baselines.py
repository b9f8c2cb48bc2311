"""The automatic plan against the baselines, in an ample budget and in one where DDP does not fit.

On 4 CPU processes (gloo), same model (``harness.BenchModel``), data, global batch and optimizer for all:

* ``auto``: ``GalvatronStrategy(plan="auto", memory_budget=..., calibration=...)`` -- the strategy profiles
  (the profile measured at the start of this run, from its cache), searches with the cost model calibrated
  from the runtime profiler's measurements of three probe plans (``lightning_galvatron.calibrate.probe_plans``;
  none of them is a baseline), and trains the plan it found;
* ``auto-uncalibrated``: the same without the calibration (the profile alone), for reference;
* the search's uniform baselines, executed by the same runtime: pure DDP, pure ZeRO-3 (FSDP2), pure TP
  (degree 4, vocabulary too);
* Lightning's own ``ModelParallelStrategy`` with a hand-written ``configure_model`` (FSDP2 on every block and
  the model: ``harness.FSDP2GPT``);
* for information, Lightning's ``DDPStrategy`` (PyTorch DDP), outside the search's space.

Two budgets: ample (1 GiB per device) and tight (halfway between pure ZeRO-3's and pure DDP's predicted
peaks: DDP does not fit). A baseline *fits* a budget if its measured peak per rank does. Runs are
interleaved over ``--rounds`` rounds; the throughput ratio auto/baseline is taken per round (the two ran
minutes apart at most) and its median reported, with the median step times.

    python benchmarks/plan_vs_baselines.py [--rounds 3]
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
from harness import (
    FSDP2GPT,
    RESULTS,
    BenchModel,
    fit_from_runs,
    interleaved,
    make_module,
    measure_run,
    mib,
    model_parallel_fsdp2,
    worker_pool,
)

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.calibrate import probe_plans
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import evaluate

WORLD = 4
PRECISION = "32-true"
OPTIMIZER = "adamw"


def profile_into_cache(model: BenchModel, cache: str) -> dict:
    """Profile once, as ``plan="auto"`` does, into the cache the auto runs then read."""
    import torch.distributed as dist

    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler import profile

    module = make_module(model)
    batch = next(iter(harness.make_loader(model, dist.get_world_size())))
    return profile(module, find_blocks(module), batch, precision=PRECISION, devices_per_node=dist.get_world_size(), cache=cache).to_dict()


def run(spec: dict, model: BenchModel, warmup: int, timed: int, memory: bool) -> dict:
    """One training run of the configuration ``spec`` (a picklable description; strategies are built in the worker)."""
    kind = spec["kind"]
    module_cls = None
    if kind == "galvatron":
        def make() -> Any:
            return GalvatronStrategy(save_plan=False, **spec["kwargs"])
    elif kind == "model_parallel_fsdp2":
        make, module_cls = model_parallel_fsdp2, (lambda m: make_module(m, FSDP2GPT))
    elif kind == "lightning_ddp":
        def make() -> Any:
            from lightning.pytorch.strategies import DDPStrategy

            return DDPStrategy(process_group_backend="gloo")
    else:
        raise ValueError(kind)

    def info(strategy: Any) -> dict:
        plan = getattr(strategy, "plan", None)
        return {"plan": plan.to_dict() if plan is not None else None}

    return measure_run(make, model, warmup=warmup, timed=timed, memory=memory, module_cls=module_cls, info=info,
                       runtime_profile=spec.get("runtime_profile", False))


def budgets(model: BenchModel, profile: Profile) -> dict[str, int]:
    peaks = {
        dp: evaluate(profile, ParallelPlan.uniform(WORLD, model.n_layer, S(dp_type=dp), global_batch_size=model.global_batch),
                     precision=PRECISION, optimizer=OPTIMIZER).peak_memory_bytes
        for dp in ("ddp", "zero3")
    }
    return {"ample": 2**30, "tight": int((peaks["ddp"] + peaks["zero3"]) / 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--output", default=str(RESULTS / "plan_vs_baselines.json"))
    args = parser.parse_args()
    model = BenchModel()
    started = time.perf_counter()
    L, B = model.n_layer, model.global_batch

    def uniform(strategy: S) -> dict:
        plan = ParallelPlan.uniform(WORLD, L, strategy, global_batch_size=B)
        return {"kind": "galvatron", "kwargs": {"plan": plan.to_dict()}}

    baselines = {
        "ddp": uniform(S()),
        "zero3": uniform(S(dp_type="zero3")),
        "tp": uniform(S(tp=WORLD)),
        "lightning-model-parallel-fsdp2": {"kind": "model_parallel_fsdp2"},
        "lightning-ddp (reference)": {"kind": "lightning_ddp"},
    }
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch, worker_pool(WORLD) as pool:
        cache = str(Path(scratch) / "profiles")
        profile = Profile.from_dict(pool.run(profile_into_cache, model, cache)[0])
        probes = probe_plans(profile, WORLD, model.global_batch)
        print("calibration probes:")
        probe_runs = []
        for name, plan in probes.items():
            spec = {"kind": "galvatron", "kwargs": {"plan": plan.to_dict()}, "runtime_profile": True}
            result = pool.run(run, spec, model, args.warmup_steps, args.timed_steps, False, timeout=600)[0]
            probe_runs.append(result)
            print(f"  {name:34s} {result['step_time_s'] * 1e3:8.1f} ms", flush=True)
        calibration = fit_from_runs(profile, probe_runs, PRECISION, OPTIMIZER)
        calibration_file = Path(scratch) / "calibration.json"
        calibration.save(calibration_file)
        print(f"calibration: {calibration.describe()}")
        limits = budgets(model, profile)
        configs = dict(baselines)
        for budget_name, budget in limits.items():
            auto = {"memory_budget": budget, "profile_cache": cache}
            configs[f"auto@{budget_name}"] = {"kind": "galvatron", "kwargs": {**auto, "calibration": str(calibration_file)}}
            configs[f"auto-uncalibrated@{budget_name}"] = {"kind": "galvatron", "kwargs": auto}
        current = None
        for r, name in interleaved(list(configs), args.rounds):
            if r != current:
                print(f"round {r}:")
                current = r
            result = pool.run(run, configs[name], model, args.warmup_steps, args.timed_steps, r == 0, timeout=600)[0]
            runs.setdefault(name, []).append(result)
            print(f"  {name:34s} {result['step_time_s'] * 1e3:8.1f} ms", flush=True)
    report(runs, limits, model, args, calibration, time.perf_counter() - started)


def report(runs: dict[str, list[dict]], limits: dict[str, int], model: BenchModel, args: Any, calibration: Any, seconds: float) -> None:
    def median_step(name: str) -> float:
        return statistics.median(r["step_time_s"] for r in runs[name])

    def peak(name: str) -> int:
        return max(next(r for r in runs[name] if r["memory_source"] != "none")["peak_bytes_per_rank"])

    baselines = [n for n in runs if not n.startswith("auto")]
    settings = {}
    print(f"\nAuto plan vs baselines on {WORLD} CPU processes, {model.describe()}, {args.rounds} rounds")
    for budget_name, budget in limits.items():
        rows = []
        for auto in (f"auto@{budget_name}", f"auto-uncalibrated@{budget_name}"):
            plan = runs[auto][0]["info"]["plan"]
            ratios = {}
            for b in baselines:
                per_round = [rb["step_time_s"] / ra["step_time_s"] for ra, rb in zip(runs[auto], runs[b])]
                ratios[b] = {"throughput_ratio": statistics.median(per_round), "per_round": per_round,
                             "fits": peak(b) <= budget, "step_s": median_step(b), "peak_bytes": peak(b)}
            rows.append({"config": auto, "plan": plan, "step_s": median_step(auto), "peak_bytes": peak(auto),
                         "fits": peak(auto) <= budget, "versus": ratios})
        settings[budget_name] = {"budget_bytes": budget, "autos": rows}
        print(f"\n{budget_name} budget: {mib(budget)} per device")
        print(f"  {'configuration':34s} {'step':>8s} {'peak/rank':>10s} {'fits':>5s} {'auto/it':>8s} {'uncal./it':>9s}")
        auto_row, uncal_row = rows
        for name in [auto_row["config"], uncal_row["config"], *baselines]:
            fits = peak(name) <= budget
            line = f"  {name:34s} {median_step(name) * 1e3:6.0f}ms {mib(peak(name)):>10s} {'yes' if fits else 'NO':>5s}"
            if name in baselines:
                line += f" {auto_row['versus'][name]['throughput_ratio']:7.2f}x {uncal_row['versus'][name]['throughput_ratio']:8.2f}x"
            print(line)
        fitting = [b for b in baselines if auto_row["versus"][b]["fits"] and not b.endswith("(reference)")]
        best = min(fitting, key=median_step) if fitting else None
        if best:
            print(f"  auto vs the best fitting baseline ({best}): {auto_row['versus'][best]['throughput_ratio']:.2f}x")
        settings[budget_name]["best_fitting_baseline"] = best
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": harness.machine(), "model": model.describe(), "world_size": WORLD, "rounds": args.rounds,
        "settings": settings, "calibration": calibration.to_dict(), "seconds": seconds,
        "runs": {name: [{k: v for k, v in r.items() if k != "info"} | {"plan": r["info"].get("plan")} for r in rs] for name, rs in runs.items()},
    }, indent=2) + "\n")
    plot(settings, runs, out.with_suffix(".png"), model)
    print(f"\nresults written to {out} and {out.with_suffix('.png')}  ({seconds:.0f} s)")


def plot(settings: dict, runs: dict, path: Path, model: BenchModel) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings), figsize=(6.5 * len(settings), 4.8))
    for ax, (budget_name, setting) in zip(axes, settings.items()):
        auto = setting["autos"][0]
        names = [auto["config"], setting["autos"][1]["config"], *auto["versus"]]
        throughput = [model.global_batch / statistics.median(r["step_time_s"] for r in runs[n]) for n in names]
        fits = [auto["fits"], setting["autos"][1]["fits"], *(v["fits"] for v in auto["versus"].values())]
        colors = ["tab:green" if i == 0 else ("tab:blue" if f else "tab:gray") for i, f in enumerate(fits)]
        ax.barh(range(len(names)), throughput, color=colors)
        ax.set_yticks(range(len(names)), [n + ("" if f else " (does not fit)") for n, f in zip(names, fits)], fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel="throughput (samples/s, median of rounds)", title=f"{budget_name} budget: {setting['budget_bytes'] / 2**20:.0f} MiB per device")
    fig.suptitle(f"Auto plan vs baselines, 4 CPU processes: {model.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
