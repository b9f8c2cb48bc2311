"""Same plan, same model: GalvatronStrategy against PyTorch's own strategies, on model families nobody here wrote.

For Hugging Face GPT-2 (tied embedding and head), Llama (untied, grouped-query attention) and BERT (masked LM), built
at ``harness.BenchModel``'s sizes (``families.py``), on 2 and 4 CPU processes (gloo):

* ``ddp``: a uniform DDP plan (every block and the embedding/head ``tp1-ddp``, one micro-batch) against Lightning's
  ``DDPStrategy`` (PyTorch ``DistributedDataParallel``);
* ``zero2``: a uniform ZeRO-2 plan against ``ModelParallelStrategy`` with FSDP2 ``fully_shard(reshard_after_forward=
  False)`` on every block and on the root;
* ``zero3``: a uniform ZeRO-3 plan against the same with ``reshard_after_forward=True``.

Same model, data, global batch and optimizer on both sides; ``GalvatronStrategy`` gets the plan (no profiling or
search). The two runs of a pair follow each other (which goes first alternates by round) and the pairs rotate from
round to round, so the machine's slow phases fall on both alike. The figure is PyTorch's step time over Galvatron's
(above 1: Galvatron faster), taken per round; its median over the rounds is reported. Next to it, the same ratio of
the CPU time a step costs summed over the ranks (``harness``: ``cpu_s_per_step``), PyTorch's over Galvatron's: the
work each side does, which the load of other jobs on a shared machine moves far less than the step time.

    python benchmarks/same_plan.py [--rounds 4] [--worlds 2 4] [--families gpt2 llama bert] [--plans ddp zero2 zero3]
    python benchmarks/same_plan.py --quick      # one round, fewer steps
    python benchmarks/same_plan.py --report-from results/same_plan.json   # the saved run's table, again
    python benchmarks/same_plan.py --report-from a.json b.json            # runs of the same code, rounds pooled
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any

import harness
from families import FAMILIES, FamilyModel, make_family_module
from harness import RESULTS, measure_run, model_parallel_fsdp2
from pool import DistributedFailure, WorkerPool

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan

#: plan -> PyTorch's strategy running the same
PAIRS = {
    "ddp": "DDPStrategy",
    "zero2": "FSDP2 reshard_after_forward=False",
    "zero3": "FSDP2 reshard_after_forward=True",
}


def run(side: str, plan_kind: str, model: FamilyModel, warmup: int, timed: int) -> dict:
    """One training run in the workers: Galvatron's uniform ``plan_kind`` plan, or PyTorch's strategy for it."""
    import torch.distributed as dist

    if side == "galvatron":
        world = dist.get_world_size()
        plan = ParallelPlan.uniform(world, model.n_layer, S(dp_type=plan_kind), global_batch_size=model.global_batch)
        return measure_run(
            lambda: GalvatronStrategy(plan=plan, save_plan=False),
            model,
            warmup=warmup,
            timed=timed,
            memory=False,
            module_cls=make_family_module,
        )
    if plan_kind == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return measure_run(
            lambda: DDPStrategy(process_group_backend="gloo"),
            model,
            warmup=warmup,
            timed=timed,
            memory=False,
            module_cls=make_family_module,
        )
    reshard = plan_kind == "zero3"
    return measure_run(
        model_parallel_fsdp2,
        model,
        warmup=warmup,
        timed=timed,
        memory=False,
        module_cls=lambda m: make_family_module(m, fsdp2=True, reshard_after_forward=reshard),
    )


def round_order(cells: list[tuple[str, str]], round_: int) -> list[tuple[str, str, str]]:
    """``(family, plan, side)`` for one round: the pairs rotated by the round, each pair's two runs adjacent, the side
    that goes first alternating."""
    k = round_ % len(cells)
    sides = ("galvatron", "pytorch") if round_ % 2 == 0 else ("pytorch", "galvatron")
    return [(family, plan, side) for family, plan in cells[k:] + cells[:k] for side in sides]


def measure_world(world: int, families: list[str], args: Any) -> dict:
    pools = [WorkerPool(world)]  # a failed run kills its pool (ranks may be stuck in a collective): then a new one
    try:
        return _measure_world(pools, world, families, args)
    finally:
        pools[-1].shutdown()


def _measure_world(pools: list[WorkerPool], world: int, families: list[str], args: Any) -> dict:
    cells = [(family, plan) for family in families for plan in args.plans]
    runs: dict[str, dict[str, dict[str, list]]] = {
        family: {plan: {"galvatron": [], "pytorch": []} for plan in args.plans} for family in families
    }
    for r in range(args.rounds):
        for family, plan, side in round_order(cells, r):
            model = FamilyModel(family=family)
            if not pools[-1].alive:
                pools.append(WorkerPool(world))
            try:
                result = pools[-1].run(run, side, plan, model, args.warmup_steps, args.timed_steps, timeout=600)[0]
            except DistributedFailure as failure:
                result = {"error": str(failure).splitlines()[-1][:400], "round": r}
                print(f"  round {r} {family:6s} {plan:6s} {side:10s} FAILED: {result['error']}", flush=True)
            else:
                result["round"] = r
                print(f"  round {r} {family:6s} {plan:6s} {side:10s} {result['step_time_s'] * 1e3:7.1f} ms", flush=True)
            runs[family][plan][side].append(result)
    return {"runs": runs, "summary": summarise(runs)}


def summarise(runs: dict) -> dict:
    """Per family and plan: PyTorch's step over Galvatron's per round (both ran), and its median."""
    out: dict[str, dict] = {}
    for family, plans in runs.items():
        out[family] = {}
        for plan, sides in plans.items():
            ratios = [
                p["step_time_s"] / g["step_time_s"]
                for g, p in zip(sides["galvatron"], sides["pytorch"])
                if "error" not in g and "error" not in p
            ]
            cpu = [
                p["info"]["cpu_s_per_step"] / g["info"]["cpu_s_per_step"]
                for g, p in zip(sides["galvatron"], sides["pytorch"])
                if "error" not in g and "error" not in p
            ]
            steps = {
                side: statistics.median(r["step_time_s"] for r in rs if "error" not in r)
                for side, rs in sides.items()
                if any("error" not in r for r in rs)
            }
            out[family][plan] = {
                "ratio": statistics.median(ratios) if ratios else None,
                "per_round": ratios,
                "step_s": steps,
                "cpu_ratio": statistics.median(cpu) if cpu else None,
                "phase_ratios": _phase_ratios(sides),
            }
    return out


PHASES = ("forward", "backward", "optimizer")


def _phase_ratios(sides: dict) -> dict[str, float]:
    """Per phase of the step (the harness's ``PhaseClock``, averaged over the ranks): Galvatron's time over
    PyTorch's, median over the rounds (above 1: Galvatron slower in that phase) -- where a step ratio's gap lies."""
    ratios: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for g, p in zip(sides["galvatron"], sides["pytorch"]):
        g_phases, p_phases = (r.get("info", {}).get("phases_per_rank") for r in (g, p))
        if "error" in g or "error" in p or not g_phases or not p_phases:
            continue
        for phase in PHASES:
            ours, theirs = (statistics.mean(rank[phase] for rank in ranks) for ranks in (g_phases, p_phases))
            if theirs > 0:
                ratios[phase].append(ours / theirs)
    return {phase: statistics.median(values) for phase, values in ratios.items() if values}


def report(results: dict, families: list[str], args: Any) -> str:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print(
            f"Same plan, GalvatronStrategy vs PyTorch: PyTorch's step time / Galvatron's (above 1: Galvatron faster), "
            f"median of {args.rounds} interleaved round(s); {args.warmup_steps} warm-up and {args.timed_steps} timed "
            "steps per run; CPU: the same ratio of CPU seconds per step summed over the ranks; forw/back/opti: "
            "Galvatron's time in that phase over PyTorch's (above 1: Galvatron slower there)"
        )
        print(f"model: {FamilyModel(family='<family>').describe()}")
        for world, result in results.items():
            print(f"\n{world} CPU processes")
            columns = f"{'family':7s} {'plan':6s} {'PyTorch strategy':34s}"
            phases = " ".join(f"{phase[:4]:>5s}" for phase in PHASES)
            print(f"  {columns} {'Galvatron':>10s} {'PyTorch':>9s} {'ratio':>6s} {'CPU':>6s}  {phases}  per round")
            for family in families:
                for plan, row in result["summary"][family].items():
                    against = PAIRS[plan]
                    steps = row["step_s"]
                    gal = f"{steps['galvatron'] * 1e3:.0f} ms" if "galvatron" in steps else "failed"
                    tor = f"{steps['pytorch'] * 1e3:.0f} ms" if "pytorch" in steps else "failed"
                    ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
                    cpu = f"{row['cpu_ratio']:.2f}x" if row.get("cpu_ratio") is not None else "-"
                    rounds = ", ".join(f"{x:.2f}" for x in row["per_round"])
                    by_phase = row.get("phase_ratios", {})
                    phases = " ".join(f"{by_phase[p]:5.2f}" if p in by_phase else f"{'-':>5s}" for p in PHASES)
                    print(
                        f"  {family:7s} {plan:6s} {against:34s} {gal:>10s} {tor:>9s} {ratio:>6s} {cpu:>6s}  {phases}  "
                        f"{rounds}"
                    )
    return text.getvalue()


def pooled(saved: list[dict]) -> dict:
    """Runs of the same code pooled: each cell's rounds are the rounds of every run that measured it (runs with other
    step counts are refused: their steps are not alike)."""
    first = saved[0]
    for other in saved[1:]:
        if (other["warmup_steps"], other["timed_steps"]) != (first["warmup_steps"], first["timed_steps"]):
            raise SystemExit("--report-from: the runs differ in warm-up or timed steps; pool runs of one setting")
    worlds: dict[str, dict] = {}
    for run in saved:
        for world, result in run["worlds"].items():
            cells = worlds.setdefault(world, {"runs": {}})["runs"]
            for family, plans in result["runs"].items():
                for plan, sides in plans.items():
                    into = cells.setdefault(family, {}).setdefault(plan, {"galvatron": [], "pytorch": []})
                    for side, rounds in sides.items():
                        into[side].extend(rounds)
    counts = {
        len(sides["galvatron"]) for w in worlds.values() for plans in w["runs"].values() for sides in plans.values()
    }
    rounds = str(min(counts)) if len(counts) == 1 else f"{min(counts)}-{max(counts)} (pooled)"
    return {**first, "rounds": rounds, "worlds": worlds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 1 warm-up and 4 timed steps")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--plans", nargs="+", default=list(PAIRS), choices=PAIRS, help="default: all")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=6)
    parser.add_argument("--output", default=None, help="default: results/same_plan.json (same_plan_quick.json)")
    parser.add_argument(
        "--report-from", nargs="+", default=None, help="print the table of saved JSONs again, their rounds pooled"
    )
    args = parser.parse_args()
    if args.report_from:
        saved = pooled([json.loads(Path(path).read_text()) for path in args.report_from])
        for key in ("rounds", "warmup_steps", "timed_steps"):
            setattr(args, key, saved[key])
        worlds = {world: {**result, "summary": summarise(result["runs"])} for world, result in saved["worlds"].items()}
        print(report(worlds, [f for f in FAMILIES if f in next(iter(worlds.values()))["runs"]], args))
        return
    if args.quick:
        args.rounds, args.warmup_steps, args.timed_steps = 1, 1, 4
    output = Path(args.output or RESULTS / ("same_plan_quick.json" if args.quick else "same_plan.json"))
    output.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    for world in args.worlds:
        print(f"=== {world} processes", flush=True)
        results[str(world)] = measure_world(world, args.families, args)
    seconds = time.perf_counter() - started
    table = report(results, args.families, args)
    print("\n" + table + f"({seconds:.0f} s)")
    output.with_suffix(".txt").write_text(table)
    output.write_text(
        json.dumps(
            {
                "machine": harness.machine(),
                "model": FamilyModel(family="<family>").describe(),
                "rounds": args.rounds,
                "warmup_steps": args.warmup_steps,
                "timed_steps": args.timed_steps,
                "pairs": PAIRS,
                "worlds": results,
                "seconds": seconds,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"results written to {output} and {output.with_suffix('.txt')}")


if __name__ == "__main__":
    main()
