"""GPU acceptance check: one CUDA device, under 8 minutes; then every plan kind where 2 or more GPUs are visible.

    python benchmarks/gpu_check.py            # writes benchmarks/results/gpu_check.json; exit status 0 = passed

What it checks, on the example GPT (``examples/gpt.py``) at ~370 M parameters (24 blocks, hidden 1024,
vocabulary 32,000, sequence 512) unless ``--tiny``:

1. **profile**: the model profiler (:func:`lightning_galvatron.profiler.model.profile_model`) on CUDA, once per
   precision (``bf16-mixed``, ``bf16-true``): forward times and activation bytes per sample must be positive
   and finite.
2. **memory**: single-device plans -- recomputation off/on x micro-batches 1/4 x ``bf16-mixed``/``bf16-true``
   -- trained with ``GalvatronStrategy`` for a few steps; the cost model's predicted peak
   (:func:`lightning_galvatron.search.evaluate` with the profile of step 1) against
   ``torch.cuda.max_memory_allocated`` over a measured step (``benchmarks/harness.py``'s probe). A case passes
   within ``--memory-tolerance`` (default 15%).
3. **example**: the README's first command on the GPU --
   ``python examples/gpt.py fit --config configs/gpt_tiny_cpu_auto.yaml`` with ``--trainer.accelerator gpu
   --trainer.devices 1`` (automatic plan: profiled, searched, applied) -- and its logged ``train_loss`` must fall.
4. **multi-GPU** (where 2 or more GPUs are visible; skipped with a message otherwise): every plan kind over NCCL
   against one GPU in bf16, with measured step time and ``max_memory_allocated`` next to the strategy's prediction,
   written to ``benchmarks/results/gpu_check_multi.json`` (``benchmarks/gpu_check_multi.py``).

Everything but the measurements themselves is device-independent and tested on CPU
(``tests/test_gpu_check.py`` runs the profile and memory sections with ``--device cpu --tiny``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
PRECISIONS = ("bf16-mixed", "bf16-true")


# ---------------------------------------------------------------------------------------------- what is checked
@dataclass(frozen=True)
class ModelConfig:
    """The example GPT's size and the batches it trains on (random tokens)."""

    n_layer: int = 24
    n_head: int = 16
    n_embd: int = 1024
    vocab_size: int = 32000
    seq_length: int = 512
    global_batch: int = 8

    @classmethod
    def tiny(cls) -> ModelConfig:
        return cls(n_layer=2, n_head=4, n_embd=32, vocab_size=64, seq_length=16, global_batch=8)

    def module_kwargs(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "seq_length": self.seq_length,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "learning_rate": 1e-4,
        }


@dataclass(frozen=True)
class MemoryCase:
    precision: str
    recompute: bool
    micro_batches: int

    @property
    def name(self) -> str:
        return f"{self.precision} {'recompute' if self.recompute else 'no-recompute'} m{self.micro_batches}"


def memory_cases() -> list[MemoryCase]:
    """Every combination of precision, recomputation and micro-batches the check measures (8)."""
    return [MemoryCase(p, rc, m) for p in PRECISIONS for rc in (False, True) for m in (1, 4)]


def single_device_plan(case: MemoryCase, config: ModelConfig) -> Any:
    """The plan of one case: every block alike, on one device."""
    from lightning_galvatron.plan import LayerStrategy, ParallelPlan

    return ParallelPlan.uniform(
        1,
        config.n_layer,
        LayerStrategy(recompute=case.recompute),
        vocab=LayerStrategy(),
        micro_batches=case.micro_batches,
        global_batch_size=config.global_batch,
    )


def one_device_hardware(name: str, memory_bytes: int | None) -> Any:
    """A hardware profile for one device: nothing to communicate (the entry is required by the format, and
    never used: every group of a one-device plan has one member)."""
    from lightning_galvatron.profiles import CollectiveFit, HardwareProfile

    return HardwareProfile(
        name, 1, 1.0, (CollectiveFit("all_reduce", 2, 2, 0.0, 1e12),), device_memory_bytes=memory_bytes
    )


def compare_memory(name: str, predicted: float, measured: int | None, tolerance: float) -> dict[str, Any]:
    """One memory case: ratio of measured to predicted, and whether it is within ``tolerance``."""
    ratio = measured / predicted if measured and predicted else None
    return {
        "case": name,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "ratio": ratio,
        "passed": ratio is not None and abs(ratio - 1.0) <= tolerance,
    }


def loss_fell(losses: Sequence[float], factor: float = 0.8) -> bool:
    """The mean of the last quarter of the logged losses is below ``factor`` x the mean of the first quarter."""
    if len(losses) < 4 or not all(math.isfinite(x) for x in losses):
        return False
    q = len(losses) // 4
    first, last = sum(losses[:q]) / q, sum(losses[-q:]) / q
    return last < factor * first


def read_losses(metrics_csv: Path, key: str = "train_loss") -> list[float]:
    """``train_loss`` values, in step order, from a Lightning ``CSVLogger``'s ``metrics.csv``."""
    with open(metrics_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(key)]
    rows.sort(key=lambda r: int(r["step"]))
    return [float(r[key]) for r in rows]


def example_command(save_dir: Path, accelerator: str = "gpu") -> list[str]:
    """The README's main example, on one device of ``accelerator``."""
    return [
        sys.executable,
        str(REPO / "examples" / "gpt.py"),
        "fit",
        "--config",
        str(REPO / "configs" / "gpt_tiny_cpu_auto.yaml"),
        "--trainer.accelerator",
        accelerator,
        "--trainer.devices",
        "1",
        "--trainer.strategy.init_args.process_group_backend",
        "nccl" if accelerator == "gpu" else "gloo",
        "--trainer.logger.init_args.save_dir",
        str(save_dir),
    ]


# ---------------------------------------------------------------------------------------------- measurements
def random_tokens(config: ModelConfig, steps: int) -> Any:
    """A DataLoader of random token sequences (inputs and next-token targets), one device's batch per step."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, config.vocab_size, (config.global_batch * steps, config.seq_length + 1), generator=generator
    )
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=config.global_batch)


def profile_section(config: ModelConfig, device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Profile the model on ``device`` at each precision; returns (report, profiles by precision)."""
    import torch

    from examples.gpt import GPTModule
    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler.model import profile_model

    report: dict[str, Any] = {}
    profiles = {}
    for precision in PRECISIONS:
        torch.manual_seed(0)
        module = GPTModule(**config.module_kwargs())
        inputs, targets = next(iter(random_tokens(config, 1)))
        started = time.perf_counter()
        model = profile_model(
            module, find_blocks(module), (inputs, targets), precision=precision, batch_sizes=(1, 2), device=device
        )
        layer = model.layer_types[0]
        values = [
            layer.forward_time.per_sample_s,
            layer.forward_time.intercept_s,
            *dict(layer.activation_bytes_per_sample.values).values(),
        ]
        report[precision] = {
            "seconds": time.perf_counter() - started,
            "parameters_per_block": layer.parameters,
            "forward_s_per_sample": layer.forward_time.per_sample_s,
            "activation_bytes_per_sample": layer.activation_bytes_per_sample.to_dict(),
            "passed": all(math.isfinite(v) and v >= 0 for v in values) and layer.activation_bytes_per_sample.at(1) > 0,
        }
        profiles[precision] = model
        del module
    return report, profiles


def memory_section(
    config: ModelConfig, device: str, profiles: dict[str, Any], tolerance: float, cases: Sequence[MemoryCase]
) -> list[dict[str, Any]]:
    """Train every case for a few steps and compare its measured peak with the cost model's."""
    import gc

    import torch
    import torch.distributed as dist

    from benchmarks.harness import StepProbe, probe_trainer
    from examples.gpt import GPTModule
    from lightning_galvatron import GalvatronStrategy
    from lightning_galvatron.profiles import Profile
    from lightning_galvatron.search.estimate import evaluate

    accelerator = "gpu" if device == "cuda" else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    initialised = dist.is_initialized()  # the Trainers below share one process group; it is ours to remove
    memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    hardware = one_device_hardware(name, memory)
    rows = []
    for case in cases:
        plan = single_device_plan(case, config)
        predicted = evaluate(
            Profile(profiles[case.precision], hardware), plan, precision=case.precision, optimizer="adamw"
        )
        probe = StepProbe(warmup=1, timed=1, memory=True)
        torch.manual_seed(0)
        module = GPTModule(**config.module_kwargs())
        trainer = probe_trainer(
            GalvatronStrategy(plan=plan, save_plan=False), 1, probe, accelerator, precision=case.precision
        )
        started = time.perf_counter()
        trainer.fit(module, random_tokens(config, probe.total_steps))
        row = compare_memory(case.name, predicted.peak_memory_bytes, probe.peak_bytes, tolerance)
        row["seconds"] = time.perf_counter() - started
        row["predicted_stage"] = predicted.stages[0].to_dict()
        rows.append(row)
        del trainer, module
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if not initialised and dist.is_initialized():
        dist.destroy_process_group()
    return rows


def example_section(accelerator: str = "gpu", timeout_s: float = 240) -> dict[str, Any]:
    """Run the README example on one device and check that its loss falls."""
    with tempfile.TemporaryDirectory() as save_dir:
        started = time.perf_counter()
        done = subprocess.run(
            example_command(Path(save_dir), accelerator),
            check=False,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        metrics = sorted(Path(save_dir).rglob("metrics.csv"))
        losses = read_losses(metrics[-1]) if metrics else []
    return {
        "command": " ".join(example_command(Path("<logs>"), accelerator)[1:]),
        "returncode": done.returncode,
        "seconds": time.perf_counter() - started,
        "train_loss": losses,
        "passed": done.returncode == 0 and loss_fell(losses),
        "output_tail": (done.stdout + done.stderr)[-3000:],
    }


# ---------------------------------------------------------------------------------------------- the script
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu only to test the script itself")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (for testing the script)")
    parser.add_argument("--memory-tolerance", type=float, default=0.15)
    parser.add_argument("--cases", type=int, help="measure only the first N memory cases")
    parser.add_argument("--skip-example", action="store_true", help="leave out the README example")
    parser.add_argument("-o", "--output", default=str(RESULTS / "gpu_check.json"))
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device; run it on a machine with one (or --device cpu to test the script)",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    config = ModelConfig.tiny() if args.tiny else ModelConfig()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": asdict(config),
        "memory_tolerance": args.memory_tolerance,
    }
    out["profile"], profiles = profile_section(config, args.device)
    cases = memory_cases()[: args.cases] if args.cases else memory_cases()
    out["memory"] = memory_section(config, args.device, profiles, args.memory_tolerance, cases)
    if not args.skip_example:
        out["example"] = example_section("gpu" if args.device == "cuda" else "cpu")
    multi = _multi_gpu(config, args.device)
    out["multi_gpu"] = multi.get("skipped") or f"{'passed' if multi['passed'] else 'FAILED'}: gpu_check_multi.json"
    out["seconds"] = time.perf_counter() - started
    out["passed"] = (
        all(p["passed"] for p in out["profile"].values())
        and all(r["passed"] for r in out["memory"])
        and out.get("example", {"passed": True})["passed"]
        and multi.get("passed", True)
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    for r in out["memory"]:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        print(
            f"{r['case']:32s} predicted {r['predicted_bytes'] / 2**20:9.1f} MiB  measured "
            f"{(r['measured_bytes'] or 0) / 2**20:9.1f} MiB  ratio {ratio}  {'ok' if r['passed'] else 'FAILED'}"
        )
    if "example" in out:
        losses = out["example"]["train_loss"]
        print(
            f"example: exit {out['example']['returncode']}, train_loss {losses[:1]} -> {losses[-1:]}, "
            f"{'ok' if out['example']['passed'] else 'FAILED'}"
        )
    print(multi["skipped"] if "skipped" in multi else f"multi-GPU: {'ok' if multi['passed'] else 'FAILED'}")
    print(f"{'passed' if out['passed'] else 'FAILED'} in {out['seconds']:.0f} s; results in {args.output}")
    return 0 if out["passed"] else 1


def _multi_gpu(config: ModelConfig, device: str) -> dict[str, Any]:
    """The multi-GPU section where 2 or more GPUs are visible (``{"skipped": why}`` otherwise), its results written."""
    from benchmarks import gpu_check_multi  # builds on this module's model and batches

    if device != "cuda":
        return {"skipped": "multi-GPU section skipped: --device cpu (gpu_check_multi.py --device cpu tests it)"}
    multi = gpu_check_multi.multi_section(config, device, None)
    if "skipped" not in multi:
        gpu_check_multi.MULTI_OUTPUT.write_text(json.dumps(multi, indent=2))
        gpu_check_multi.print_summary(multi)
    return multi


if __name__ == "__main__":
    sys.exit(main())
