"""Runtime overhead: uniform plans through GalvatronStrategy against Lightning's own strategies running the same.

* ZeRO-3: a uniform ZeRO-3 plan against ``ModelParallelStrategy`` with FSDP2;
* DDP: a uniform DDP plan against ``DDPStrategy`` (PyTorch ``DistributedDataParallel``).

Both shard every block and the rest of the model with FSDP2 (``fully_shard``, parameters resharded after
forward) over all the CPU processes (4 by default; gloo); same model (``harness.BenchModel``), data, global batch and
optimizer. ``GalvatronStrategy`` gets the plan (no profiling or search); Lightning's strategy gets the
hand-written ``configure_model`` of ``harness.FSDP2GPT``. The two alternate for ``--rounds`` rounds; the
step-time ratio is taken per round and its median reported, with the ratio of peak memory per rank
(allocator-level accounting, see ``harness.py``; measured in the first round). What Galvatron adds per
step: its plan-aware batch handling, relocation hooks (none here: every block has the same layout),
the summed-gradient convention (``set_force_sum_reduction_for_comms``) and its clipping plugin. Under DDP,
Galvatron's own gradient buckets (``runtime.gradient_sync``) against DDP's reducer.

    python benchmarks/runtime_overhead.py [--rounds 7] [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import harness
import torch
from harness import (
    FSDP2GPT,
    RESULTS,
    BenchModel,
    interleaved,
    make_module,
    measure_run,
    mib,
    model_parallel_fsdp2,
    worker_pool,
)

from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan

DEFAULT_WORLD = 4


#: (Galvatron's configuration, Lightning's) pairs compared round by round
PAIRS = {"zero3": ("galvatron-zero3", "lightning-model-parallel-fsdp2"), "ddp": ("galvatron-ddp", "lightning-ddp")}


def run(kind: str, model: BenchModel, warmup: int, timed: int, memory: bool) -> dict:
    if kind.startswith("galvatron-"):
        dp_type = kind.removeprefix("galvatron-")
        world = torch.distributed.get_world_size()
        plan = ParallelPlan.uniform(world, model.n_layer, S(dp_type=dp_type), global_batch_size=model.global_batch)
        return measure_run(
            lambda: GalvatronStrategy(plan=plan, save_plan=False), model, warmup=warmup, timed=timed, memory=memory
        )
    if kind == "lightning-ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return measure_run(
            lambda: DDPStrategy(process_group_backend="gloo"), model, warmup=warmup, timed=timed, memory=memory
        )
    return measure_run(
        model_parallel_fsdp2,
        model,
        warmup=warmup,
        timed=timed,
        memory=memory,
        module_cls=lambda m: make_module(m, FSDP2GPT),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=DEFAULT_WORLD, help="CPU processes (default 4)")
    parser.add_argument("--output", default=None, help="default: results/runtime_overhead[_<world size>].json")
    args = parser.parse_args()
    world = args.world_size
    suffix = "" if world == DEFAULT_WORLD else f"_{world}"
    args.output = args.output or str(RESULTS / f"runtime_overhead{suffix}.json")
    model = BenchModel()
    started = time.perf_counter()
    kinds = [k for pair in PAIRS.values() for k in pair]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    with worker_pool(world) as pool:
        for r, kind in interleaved(kinds, args.rounds):
            result = pool.run(run, kind, model, args.warmup_steps, args.timed_steps, r == 0, timeout=600)[0]
            runs[kind].append(result)
            print(f"round {r} {kind:32s} {result['step_time_s'] * 1e3:7.1f} ms", flush=True)
    peaks = {k: max(runs[k][0]["peak_bytes_per_rank"]) for k in kinds}
    summary = {}
    for name, (ours, theirs) in PAIRS.items():
        per_round = [g["step_time_s"] / m["step_time_s"] for g, m in zip(runs[ours], runs[theirs])]
        summary[name] = {
            "step_time_ratio": statistics.median(per_round),
            "step_time_ratio_per_round": per_round,
            "step_time_s": {k: statistics.median(r["step_time_s"] for r in runs[k]) for k in (ours, theirs)},
            "peak_bytes_per_rank": {k: peaks[k] for k in (ours, theirs)},
            "memory_ratio": peaks[ours] / peaks[theirs],
            "memory_source": runs[ours][0]["memory_source"],
        }
    seconds = time.perf_counter() - started
    print(f"\nRuntime overhead on {world} CPU processes, {model.describe()}, {args.rounds} rounds")
    for name, (ours, theirs) in PAIRS.items():
        row = summary[name]
        for k in (ours, theirs):
            print(f"  {k:32s} step {row['step_time_s'][k] * 1e3:7.1f} ms (median)   peak {mib(peaks[k])} per rank")
        print(
            f"  {name}: step time ratio {ours} / {theirs}: {row['step_time_ratio']:.3f} (per round: "
            f"{', '.join(f'{x:.2f}' for x in row['step_time_ratio_per_round'])});  memory ratio "
            f"{row['memory_ratio']:.3f}\n"
        )
    print(f"({seconds:.0f} s)")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": harness.machine(),
                "model": model.describe(),
                "world_size": world,
                "rounds": args.rounds,
                "summary": summary,
                "runs": runs,
                "seconds": seconds,
            },
            indent=2,
        )
        + "\n"
    )
    plot(summary, runs, out.with_suffix(".png"), model)
    print(f"results written to {out} and {out.with_suffix('.png')}")


def plot(summary: dict, runs: dict, path: Path, model: BenchModel) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(PAIRS), figsize=(5.5 * len(PAIRS) * 2, 4.2))
    for (name, pair), left, right in zip(PAIRS.items(), axes[0::2], axes[1::2]):
        row = summary[name]
        for k in pair:
            left.plot([r["step_time_s"] * 1e3 for r in runs[k]], marker="o", label=k)
        left.set(
            xlabel="round",
            ylabel="median step time (ms)",
            title=f"{name}: step time ratio {row['step_time_ratio']:.3f}",
        )
        left.legend(fontsize=8)
        right.bar(list(pair), [row["peak_bytes_per_rank"][k] / 2**20 for k in pair], color=["tab:green", "tab:blue"])
        right.set(ylabel="peak memory per rank (MiB)", title=f"{name}: memory ratio {row['memory_ratio']:.3f}")
        right.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"GalvatronStrategy vs Lightning's strategies on the same uniform plan: {model.describe()}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
