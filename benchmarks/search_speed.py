"""How long the plan search takes, from the imported Llama-2-7B / 8xA100 profile.

Cases (blocks, devices): (32, 8) -- Llama-2-7B on one node, the case the reference system needs
about 117 s for; (80, 64) and (128, 1024) -- the same block type repeated, on 8-device nodes.
Targets on a 2-core machine: under 1 s, 10 s and 60 s. Each case runs ``--repeat`` times; the
table shows the fastest and the median, for the search alone and with the uniform baselines.

    python benchmarks/search_speed.py [--repeat 3] [--output benchmarks/results/search_speed.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import search
from lightning_galvatron.units import format_bytes

HERE = Path(__file__).parent
PROFILE = HERE / "data" / "llama2-7b-a100-8gpu.json"
CASES = [  # blocks, devices, global batch, target seconds
    (32, 8, 16, 1.0),
    (80, 64, 128, 10.0),
    (128, 1024, 2048, 60.0),
]
BUDGET = "36GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--output", default=str(HERE / "results" / "search_speed.json"))
    args = parser.parse_args()
    base = Profile.load(PROFILE)
    rows = []
    for blocks, devices, batch, target in CASES:
        profile = base.with_num_blocks(blocks)
        alone, full = [], []
        for _ in range(args.repeat):
            started = time.perf_counter()
            result = search(profile, devices, BUDGET, global_batch_size=batch, baselines=False)
            alone.append(time.perf_counter() - started)
            started = time.perf_counter()
            search(profile, devices, BUDGET, global_batch_size=batch)
            full.append(time.perf_counter() - started)
        plan = result.plan
        rows.append(
            {
                "blocks": blocks,
                "devices": devices,
                "global_batch_size": batch,
                "budget": BUDGET,
                "target_s": target,
                "search_s_min": min(alone),
                "search_s_median": statistics.median(alone),
                "with_baselines_s_median": statistics.median(full),
                "shapes_considered": result.shapes_considered,
                "shapes_solved": result.shapes_solved,
                "throughput_samples_per_s": result.throughput_samples_per_s,
                "peak_memory_bytes_per_device": result.peak_memory_bytes_per_device,
                "plan": f"pp={plan.pp} {plan.schedule} m={plan.micro_batches} "
                + ", ".join(sorted({f"{sum(s == t for s in plan.layers)}x {t.short()}" for t in plan.layers})),
            }
        )
    header = (
        f"{'blocks':>6} {'devices':>7} {'batch':>5} {'search (min/median)':>20} {'+baselines':>10} "
        f"{'target':>7}  shapes  throughput  peak memory  plan"
    )
    print(
        f"Search speed, {platform.processor() or platform.machine()}, profile {PROFILE.name}, "
        f"budget {BUDGET} per device"
    )
    print(header)
    for r in rows:
        ok = "ok" if r["search_s_median"] < r["target_s"] else "SLOW"
        print(
            f"{r['blocks']:>6} {r['devices']:>7} {r['global_batch_size']:>5} "
            f"{r['search_s_min']:>9.3f}/{r['search_s_median']:.3f} s {r['with_baselines_s_median']:>8.2f} s "
            f"{r['target_s']:>5.0f} s {ok:>4} {r['shapes_solved']:>3}/{r['shapes_considered']:<4} "
            f"{r['throughput_samples_per_s']:>8.2f}/s  {format_bytes(r['peak_memory_bytes_per_device']):>10}  "
            f"{r['plan']}"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "cases": rows}, indent=2) + "\n")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
