"""The dry run's memory against real runs, and the cost model against both.

    python benchmarks/dry_run_memory.py        # writes benchmarks/results/dry_run_memory.json

Part 1 -- is the dry run a measurement? The 14 plans of ``benchmarks/cost_model_accuracy.py`` (example GPT, 4 ranks,
fp32 AdamW) were trained for real by that script, which recorded each stage's peak memory
(``benchmarks/results/cost_model_accuracy.json``, allocator-level). Here the first rank of every stage is dry-run
(fake backend, fake tensors, ``MemTracker``) and its peak compared with the real one and with the cost model's
prediction from the profile recorded with it.

Part 2 -- the cost model at scale: Llama-2-7B's heterogeneous 64-GPU plan (``configs/llama2_7b_64gpu_plan.json``),
one rank per stage dry-run at sequence 2048 in ``bf16-mixed``, against ``evaluate`` with (a) the analytic profile
scaled from the A100 measurements (``benchmarks/data``, another implementation of Llama), as ``lightning-galvatron
estimate`` prices it, and (b) the activations of this very model (Hugging Face's ``LlamaForCausalLM``) counted by the
model profiler on fake tensors (``profile_model`` under ``FakeTensorMode``: what autograd saves, per degree), with the
same hardware part -- so that what remains is the cost model's own structure.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

torch.set_num_threads(1)  # the ranks are forked from this process

from lightning_galvatron.dryrun import ModelSource, dry_run
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiles import Profile

RESULTS = REPO / "benchmarks" / "results"


def against_real_runs() -> list[dict]:
    recorded = json.loads((RESULTS / "cost_model_accuracy.json").read_text())
    profile = Profile.from_dict(recorded["profile"])
    model = ModelSource.from_class(
        "examples.gpt.GPTModule",
        {"vocab_size": 32, "seq_length": 64, "n_layer": 8, "n_head": 8, "n_embd": 128, "learning_rate": 1e-3},
    )
    rows = []
    for entry in recorded["plans"]:
        plan = ParallelPlan.from_dict(entry["plan"])
        ranks = [plan.stage_ranks(stage)[0] for stage in range(plan.pp)]
        report = dry_run(
            model, plan, ranks=ranks, seq_length=64, precision="32-true", profile=profile, phases=("train",), workers=2
        )
        for stage, result in enumerate(report.ranks):
            real = entry["measured_peak_bytes_per_stage"][stage]
            rows.append(
                {
                    "plan": entry["name"],
                    "stage": stage,
                    "real_bytes": real,
                    "dry_run_bytes": result.memory["total"],
                    "predicted_bytes": entry["predicted_peak_bytes_per_stage"][stage],
                    "dry_run_over_real": result.memory["total"] / real,
                }
            )
    return rows


LLAMA = REPO / "tests" / "data" / "llama2-7b-config.json"
A100 = REPO / "benchmarks" / "data" / "llama2-7b-a100-8gpu.json"


def llama_profile_on_fake_tensors(seq_length: int) -> Profile:
    """Llama-2-7B's blocks and head counted by the model profiler on fake tensors (two blocks built: one type)."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_galvatron.dryrun.models import token_batch
    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler.model import profile_model
    from lightning_galvatron.profiles import load_profile

    config = json.loads(LLAMA.read_text())
    with torch.device("meta"):
        module = ModelSource.from_hf_config({**config, "num_hidden_layers": 2}).build()
    with FakeTensorMode(allow_non_fake_inputs=True):
        module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu"))
        model = profile_model(
            module,
            find_blocks(module),
            token_batch(2, seq_length),
            precision="bf16-mixed",
            batch_sizes=(1, 2),
            degrees=(1, 2, 4, 8),
        )
    model = dataclasses.replace(model, blocks=(0,) * config["num_hidden_layers"])
    return Profile(model, load_profile(A100).hardware, source="activations counted on fake tensors")


def llama_at_64() -> list[dict]:
    from lightning_galvatron.search.estimate import evaluate

    plan = ParallelPlan.load(REPO / "configs" / "llama2_7b_64gpu_plan.json")
    report = dry_run(
        ModelSource.from_hf_config(LLAMA),
        plan,
        ranks=[0, 16, 32, 48],
        seq_length=2048,
        hardware=A100,
        phases=("train",),
        workers=2,
    )
    same_model = evaluate(llama_profile_on_fake_tensors(2048), plan, precision="bf16-mixed", optimizer="adamw")
    rows = []
    for r in report.ranks:
        stage = same_model.stages[r.stage]
        rows.append(
            {
                "rank": r.rank,
                "stage": r.stage,
                "measured": r.memory,
                "predicted": report.predicted_memory(r.rank),
                "measured_over_predicted": report.memory_ratio(r.rank),
                "predicted_same_model_bytes": stage.peak_memory_bytes,
                "predicted_same_model": stage.to_dict(),
                "measured_over_predicted_same_model": r.memory["total"] / stage.peak_memory_bytes,
            }
        )
    return rows


def main() -> None:
    started = time.perf_counter()
    real = against_real_runs()
    deviations = [abs(r["dry_run_over_real"] - 1) for r in real]
    llama = llama_at_64()
    out = {
        "against_real_runs": real,
        "dry_run_vs_real": {
            "median_abs_deviation": statistics.median(deviations),
            "max_abs_deviation": max(deviations),
        },
        "llama2_7b_64": llama,
        "seconds": time.perf_counter() - started,
    }
    (RESULTS / "dry_run_memory.json").write_text(json.dumps(out, indent=2))
    for r in real:
        print(
            f"{r['plan']:36s} stage {r['stage']}  real {r['real_bytes'] / 2**20:6.2f} MiB  dry run "
            f"{r['dry_run_bytes'] / 2**20:6.2f} MiB ({r['dry_run_over_real']:.3f})  model "
            f"{r['predicted_bytes'] / 2**20:6.2f} MiB"
        )
    print(
        f"dry run vs real: median |deviation| {out['dry_run_vs_real']['median_abs_deviation']:.1%}, "
        f"max {out['dry_run_vs_real']['max_abs_deviation']:.1%}"
    )
    for r in llama:
        m, p = r["measured"], r["predicted"]
        print(
            f"Llama-2-7B 64 GPUs rank {r['rank']:2d}: dry run {m['total'] / 2**30:5.2f} GiB (states "
            f"{(m['parameters'] + m['gradients'] + m['optimizer_states']) / 2**30:.2f}, activations "
            f"{m['activations'] / 2**30:.2f}, "
            f"temporaries {m['temporaries'] / 2**30:.2f}); model {p['total'] / 2**30:5.2f} GiB (states "
            f"{p['model_states'] / 2**30:.2f}, activations {p['activations'] / 2**30:.2f}, embedding/head "
            f"{p['embedding_head'] / 2**30:.2f}, working {p['working'] / 2**30:.2f}); ratio "
            f"{r['measured_over_predicted']:.2f}; "
            f"with this model's activations {r['predicted_same_model_bytes'] / 2**30:5.2f} GiB, ratio "
            f"{r['measured_over_predicted_same_model']:.2f}"
        )


if __name__ == "__main__":
    main()
