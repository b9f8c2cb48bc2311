"""The default path on Hugging Face families, fresh and cached, against Lightning's strategies (for plan_vs_baselines).

``python benchmarks/plan_vs_baselines.py --families gpt2 llama bert`` runs this: per family (``families.py``: GPT-2
with its tied head, Llama, BERT as a masked LM, at ``BenchModel``'s sizes) and world size, with an ample budget (1 GiB):

* ``auto``: the default path, ``GalvatronStrategy(memory_budget=...)`` with a fresh profile cache: profile, search
  and measured selection in ``setup``;
* ``auto-cached``: right after it, a second ``fit`` with the same cache -- the cached selection most users run;
* Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` with FSDP2 on every block and the root
  (``reshard_after_forward=True``, as Lightning's documentation does it).

Every round runs each family's four configurations (the two baselines and the fresh-then-cached pair, in an order
rotated by the round); ratios are the best baseline's step time over the default path's (above 1: the default path is
faster), per round, then their median -- steady, and with each side's setup amortised over 1,000 steps.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from families import FamilyModel
from plan_vs_baselines import AMORTISED_STEPS, Pools, run, versus
from pool import DistributedFailure

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.search.report import plan_summary

BASELINES = ("lightning-ddp", "lightning-model-parallel-fsdp2")
AMPLE = 2**30


def measure_families(pools: Pools, world: int, families: list[str], args: Any, scratch: Path) -> dict:
    """Every family's default path (fresh, cached) and baselines on ``world`` processes, ``args.rounds`` rounds."""
    runs: dict[str, dict[str, list]] = {f: {k: [] for k in (*BASELINES, "auto", "auto-cached")} for f in families}

    def measure(family: str, name: str, spec: dict) -> None:
        model = FamilyModel(family=family)
        try:
            result = pools.run(world, run, spec, model, args.warmup_steps, args.timed_steps, False, timeout=900)[0]
        except DistributedFailure as failure:
            result = {"error": str(failure).splitlines()[-1][:400]}
            print(f"  {family:6s} {name:32s} FAILED: {result['error']}", flush=True)
        else:
            print(
                f"  {family:6s} {name:32s} {result['step_time_s'] * 1e3:8.1f} ms  setup {result['setup_s']:5.1f} s",
                flush=True,
            )
        runs[family][name].append(result)

    print(f"\n=== {world} processes: Hugging Face {', '.join(families)}, ample budget")
    for r in range(args.rounds):
        print(f"round {r}:")
        for family in families[r % len(families) :] + families[: r % len(families)]:
            order = ["auto", *BASELINES]
            for name in order[r % 3 :] + order[: r % 3]:
                if name == "auto":
                    cache = scratch / f"cache-{world}-{family}-{r}"
                    spec = {"kind": "galvatron", "kwargs": {"memory_budget": AMPLE, "profile_cache": str(cache)}}
                    measure(family, "auto", spec)  # fresh: profiles, searches and tries plans
                    measure(family, "auto-cached", spec)  # the second fit with the same cache
                else:
                    measure(family, name, {"kind": name})
    return {"runs": runs, "ratios": {family: family_ratios(runs[family]) for family in families}}


def family_ratios(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """The best baseline (lowest median step), and the fresh and cached default paths against it and each baseline."""

    def ok(rs: list[dict]) -> list[dict]:
        return [r for r in rs if "error" not in r]

    steps = {name: statistics.median(r["step_time_s"] for r in ok(rs)) for name, rs in runs.items() if ok(rs)}
    setups = {name: statistics.median(r["setup_s"] for r in ok(rs)) for name, rs in runs.items() if ok(rs)}
    out: dict[str, Any] = {"step_s": steps, "setup_s": setups}
    fitting = [b for b in BASELINES if b in steps]
    if fitting:
        out["best_baseline"] = min(fitting, key=steps.__getitem__)
    for auto in ("auto", "auto-cached"):
        done = ok(runs[auto])
        out[auto] = {
            "plans": [plan_summary(ParallelPlan.from_dict(r["info"]["plan"])) for r in done],
            "versus": {b: versus(runs[auto], runs[b]) for b in BASELINES},
        }
    return out


def report_families(result: dict, world: int) -> None:
    print(
        f"\nDefault path on Hugging Face families, {world} CPU processes, ample budget: best baseline's step / the "
        f"default path's (above 1: the default path is faster), median of per-round ratios; amortised: setup spread "
        f"over {AMORTISED_STEPS} steps"
    )
    for family, row in result["ratios"].items():
        steps, setups = row["step_s"], row["setup_s"]
        best = row.get("best_baseline")
        print(f"\n{family}:")
        for name in BASELINES:
            if name in steps:
                print(f"  {name:32s} {steps[name] * 1e3:6.0f} ms/step  setup {setups[name]:5.1f} s")
        for auto, label in (("auto", "default path, fresh cache"), ("auto-cached", "default path, cached selection")):
            if auto not in steps:
                print(f"  {label:32s} failed")
                continue
            against = row[auto]["versus"].get(best) if best else None
            ratio = (
                f"  vs {best}: {against['throughput_ratio']:.2f}x ({against['amortised_ratio']:.2f}x amortised; per "
                f"round {', '.join(f'{x:.2f}' for x in against['per_round'])})"
                if against
                else ""
            )
            plans = "; ".join(dict.fromkeys(row[auto]["plans"]))
            print(f"  {label:32s} {steps[auto] * 1e3:6.0f} ms/step  setup {setups[auto]:5.1f} s{ratio}")
            print(f"  {'':32s} plan(s): {plans}")
