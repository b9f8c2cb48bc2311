"""Our searched plan against the reference system's own plan, priced by the same cost model.

Llama-2-7B on 8xA100 (imported Hetu-Galvatron profile), 36 GB per device, global batch 16: the
reference system chose ``galvatron_config_llama2-7b_1nodes_8gpus_per_node_36GB_bf16.json``. The
budget is run both as 36e9 bytes (``36GB``) and as 36 GiB (what the reference system means by it).

    python benchmarks/search_vs_reference.py [--output benchmarks/results/search_vs_reference.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search import evaluate, search
from lightning_galvatron.units import format_bytes

HERE = Path(__file__).parent
PROFILE = HERE / "data" / "llama2-7b-a100-8gpu.json"
REFERENCE = (
    HERE.parent
    / "tests"
    / "data"
    / "galvatron-profiles"
    / "galvatron_config_llama2-7b_1nodes_8gpus_per_node_36GB_bf16.json"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(HERE / "results" / "search_vs_reference.json"))
    args = parser.parse_args()
    profile = Profile.load(PROFILE)
    reference = ParallelPlan.from_galvatron(json.loads(REFERENCE.read_text()), world_size=8)
    rows = []
    for budget in ("36GB", "36GiB"):
        theirs = evaluate(profile, reference, memory_budget_bytes=budget)
        ours = search(profile, 8, budget, global_batch_size=reference.global_batch_size)
        rows.append(
            {
                "budget": budget,
                "ours_samples_per_s": ours.throughput_samples_per_s,
                "ours_peak_memory_bytes": ours.peak_memory_bytes_per_device,
                "reference_samples_per_s": theirs.throughput_samples_per_s,
                "reference_peak_memory_bytes": theirs.peak_memory_bytes,
                "reference_fits": theirs.fits,
                "speedup": ours.throughput_samples_per_s / theirs.throughput_samples_per_s,
                "ours_plan": ours.plan.to_dict(),
                "search_s": ours.search_time_s,
            }
        )
        print(
            f"{budget:>6}: ours {ours.throughput_samples_per_s:.2f} samples/s "
            f"({format_bytes(ours.peak_memory_bytes_per_device)}), "
            f"reference plan {theirs.throughput_samples_per_s:.2f} samples/s "
            f"({format_bytes(theirs.peak_memory_bytes)}, "
            f"{'fits' if theirs.fits else 'does not fit'}), x{rows[-1]['speedup']:.3f}, search "
            f"{ours.search_time_s:.2f} s"
        )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
