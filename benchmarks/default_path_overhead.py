"""Does the default path cost anything on the plan it picks? The same plan, reached three ways, side by side.

``plan_vs_baselines.py`` compares the default path with every baseline over 3 rounds of 5 steps; where the default
path picks exactly a baseline's plan, their ratio should be 1 and what is left is noise or a real cost of the
default path (the trials' leftovers in the process, its callbacks). This measures that one difference with more
rounds and steps, on the plan the default path picks for the benchmark GPT with an ample budget:

* ``explicit plan``: ``GalvatronStrategy(plan=<that plan>)``, no profile, no search, no trials;
* ``default path, fresh cache``: ``GalvatronStrategy(memory_budget=...)`` with an empty profile cache: it profiles,
  searches and runs its trials in the same processes before training;
* ``default path, cached``: the same with the cache of an earlier run: profile and choice read back, no trials.

Interleaved over ``--rounds`` rounds (the order rotated); each run's step time is the slowest rank's median over
``--timed-steps`` steps; printed and written to ``benchmarks/results/default_path_overhead.json``: per way the
median over rounds, and each default-path way's step time over the explicit plan's (the ratio per round, then its
median: above 1 is slower).

    python benchmarks/default_path_overhead.py [--world-size 2] [--rounds 6] [--timed-steps 10]
    python benchmarks/default_path_overhead.py --budget-mib 51.9 --max-pp 1 --output default_path_overhead_m2.json
        # plan_vs_baselines' no-DDP budget at 2 processes with pipelines off: DDP over 2 micro-batches
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import RESULTS, BenchModel, interleaved
from plan_vs_baselines import Pools, run

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.search.report import plan_summary

BUDGET = 2**30  # ample: every uniform plan fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--budget-mib", type=float, default=BUDGET / 2**20, help="the memory budget (default ample)")
    parser.add_argument("--max-pp", type=int, default=None, help="passed to the strategy (default: its own)")
    parser.add_argument("--output", default="default_path_overhead.json", help="file name in benchmarks/results")
    args = parser.parse_args()
    model, world = BenchModel(), args.world_size
    budget = int(args.budget_mib * 2**20)
    limits = {"max_pp": args.max_pp} if args.max_pp is not None else {}
    scratch = Path(tempfile.mkdtemp(prefix="default_path_overhead_"))
    fresh_caches = (scratch / f"fresh-{i}" for i in itertools.count())
    cached = scratch / "cached"

    def default_path(cache: Path) -> dict:
        return {"kind": "galvatron", "kwargs": {"memory_budget": budget, "profile_cache": str(cache), **limits}}

    started = time.perf_counter()
    pools = Pools()
    try:
        first = pools.run(world, run, default_path(cached), model, args.warmup_steps, 3, False, timeout=900)[0]
        plan = first["info"]["plan"]
        print(f"the default path's plan on {world} processes: {plan_summary(ParallelPlan.from_dict(plan))}")
        specs = {
            "explicit plan": lambda: {"kind": "galvatron", "kwargs": {"plan": plan}},
            "default path, fresh cache": lambda: default_path(next(fresh_caches)),
            "default path, cached": lambda: default_path(cached),
        }
        steps: dict[str, list[float]] = {name: [] for name in specs}
        plans: dict[str, list[str]] = {name: [] for name in specs}
        for r, name in interleaved(list(specs), args.rounds):
            out = pools.run(world, run, specs[name](), model, args.warmup_steps, args.timed_steps, False, timeout=900)
            steps[name].append(out[0]["step_time_s"])
            plans[name].append(plan_summary(ParallelPlan.from_dict(out[0]["info"]["plan"])))
            print(f"round {r}: {name:26s} {out[0]['step_time_s'] * 1e3:7.1f} ms  ({plans[name][-1]})", flush=True)
    finally:
        pools.shutdown()
    base = steps["explicit plan"]
    summary: dict[str, Any] = {}
    for name, times in steps.items():
        per_round = [t / b for t, b in zip(times, base)]
        summary[name] = {
            "step_s": statistics.median(times),
            "step_s_per_round": times,
            "over_explicit_plan": statistics.median(per_round),
            "over_explicit_plan_per_round": per_round,
            "plans": plans[name],
        }
        print(
            f"{name:26s} {statistics.median(times) * 1e3:7.1f} ms   x{statistics.median(per_round):.3f} the explicit "
            f"plan's step time (per round {min(per_round):.2f}-{max(per_round):.2f})"
        )
    output = RESULTS / args.output
    output.write_text(
        json.dumps(
            {
                "machine": harness.machine(),
                "model": model.describe(),
                "world_size": world,
                "rounds": args.rounds,
                "timed_steps": args.timed_steps,
                "memory_budget_bytes": budget,
                "max_pp": args.max_pp,
                "plan": plan,
                "ways": summary,
                "seconds": time.perf_counter() - started,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"results written to {output}")


if __name__ == "__main__":
    main()
