"""The multi-GPU section of the GPU acceptance check (``benchmarks/gpu_check.py``): every plan kind against one GPU.

    python benchmarks/gpu_check.py          # runs this section after the single-device ones where >= 2 GPUs are visible
    python benchmarks/gpu_check_multi.py    # this section alone; writes benchmarks/results/gpu_check_multi.json

On the example GPT (``examples/gpt.py``, the single-device section's size unless ``--tiny``), in ``bf16-mixed`` over
NCCL, each plan kind trains a few steps with ``GalvatronStrategy`` on N GPUs (every visible one, an even number up
to 8), one ``torchrun`` launch per plan (one process per GPU, a fresh process group and CUDA context each), from the
same seed and batches as one GPU training with a single-device plan. The kinds (:func:`plan_kinds`): the automatic
plan (searched, no trials), DDP, ZeRO-2, ZeRO-3, tensor parallelism with Megatron-SP, a vocabulary-parallel embedding
and head, 1F1B and GPipe pipelines over two stages. Per plan:

* **parity** (:func:`parity`): every step's loss (the mean over the ranks' data shards) within ``LOSS_RTOL`` of one
  GPU's, and every trained parameter's distance from one GPU's small against how far training moved it
  (``PARAM_RTOL`` for the worst, ``PARAM_MEAN_RTOL`` for the mean: bf16's rounding, the tolerances of the bf16 parity
  tests);
* **time and memory**: the median step time and each rank's ``torch.cuda.max_memory_allocated`` over a measured
  step (``benchmarks/harness.py``'s probe), next to the strategy's prediction (``GalvatronStrategy.prediction``:
  the given plans are priced with the profile the automatic plan's launch leaves in the launches' shared profile
  cache); recorded, not judged.

``--device cpu --devices 2`` runs the same launches on the CPU with gloo, to test the script (nothing a GPU would
measure); ``tests/test_gpu_check.py`` runs :func:`train_plan` on the tests' worker pool instead of launching.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import RESULTS, ModelConfig, random_tokens

PRECISION = "bf16-mixed"
LOSS_RTOL = 1e-2
PARAM_RTOL = 3.0  # the worst parameter's distance from one GPU's, relative to how far training moved it
PARAM_MEAN_RTOL = 0.25  # the mean over parameters of the same ratio
MAX_DEVICES = 8
MULTI_OUTPUT = RESULTS / "gpu_check_multi.json"


def plan_kinds(devices: int, n_layer: int, global_batch: int) -> dict[str, Any]:
    """Every plan kind on ``devices`` (even, >= 2) devices; ``"auto"`` is the automatic plan."""
    from lightning_galvatron.plan import LayerStrategy as S
    from lightning_galvatron.plan import ParallelPlan

    def uniform(layer: Any, vocab: Any = None) -> ParallelPlan:
        return ParallelPlan.uniform(devices, n_layer, layer, vocab=vocab or S(), global_batch_size=global_batch)

    def pipeline(schedule: str) -> ParallelPlan:
        return ParallelPlan(
            world_size=devices,
            layers=(S(),) * n_layer,
            vocab=S(),
            pp=2,
            schedule=schedule,
            micro_batches=4,
            global_batch_size=global_batch,
        )

    return {
        "auto": "auto",
        "ddp": uniform(S()),
        "zero2": uniform(S(dp_type="zero2")),
        "zero3": uniform(S(dp_type="zero3")),
        "tp2 megatron-sp": uniform(S(tp=2, sp="megatron")),
        "vocab tp2": uniform(S(), vocab=S(tp=2)),
        "1f1b": pipeline("1f1b"),
        "gpipe": pipeline("gpipe"),
    }


def single_plan(config: ModelConfig, global_batch: int) -> Any:
    """The reference: every block on one device."""
    from lightning_galvatron.plan import LayerStrategy, ParallelPlan

    return ParallelPlan.uniform(1, config.n_layer, LayerStrategy(), global_batch_size=global_batch)


def launch_command(devices: int, case_file: Path) -> list[str]:
    """``torchrun`` on one node: ``devices`` processes, each running :func:`train_plan` on the case of ``case_file``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={devices}",
        str(Path(__file__).resolve()),
        "--worker",
        str(case_file),
    ]


# ---------------------------------------------------------------------------------------------- in each process
def train_plan(
    plan: Any,
    config: dict[str, Any],
    steps: int,
    accelerator: str,
    work_dir: str,
    reference: bool = False,
    measure_memory: bool = True,
) -> dict[str, Any] | None:
    """Train ``plan`` (a plan dict, or ``"auto"``) on every process of this launch; rank 0's record (else ``None``).

    The reference (``reference=True``) saves its initial and trained parameters in ``work_dir``; the others measure
    their distance from them. Every launch shares ``work_dir``'s profile cache. ``measure_memory=False``: no peak
    (on the CPU it is measured by torch's profiler, slowly)."""
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from benchmarks.harness import StepProbe, probe_trainer
    from examples.gpt import GPTModule
    from lightning_galvatron import GalvatronStrategy
    from lightning_galvatron.plan import ParallelPlan

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *_: Any) -> None:
            self.losses.append(float(outputs["loss"]))

    model_config = ModelConfig(**config)
    probe, recorder = StepProbe(warmup=1, timed=steps, memory=measure_memory), Losses()
    # The launch's processes: torchrun's (from its environment), or a pool's whose process group is already up (an
    # earlier Trainer in the same worker may have cleared WORLD_SIZE from the environment).
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    strategy = GalvatronStrategy(
        plan=plan if plan == "auto" else ParallelPlan.from_dict(plan),
        trials=False,
        profile_cache=str(Path(work_dir) / "profiles"),
        save_plan=False,
        process_group_backend="nccl" if accelerator == "gpu" else "gloo",
    )
    trainer = probe_trainer(strategy, world, probe, accelerator, recorder, precision=PRECISION, root_dir=work_dir)
    torch.manual_seed(0)
    module = GPTModule(**model_config.module_kwargs(), bias=False)  # a key bias's gradient is rounding noise
    initial = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()} if reference else None
    tokens = random_tokens(model_config, probe.total_steps)  # one device's batches: DDP's share of each per rank
    loader = torch.utils.data.DataLoader(tokens.dataset, batch_size=model_config.global_batch // world)
    started = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - started
    state = get_model_state_dict(trainer.lightning_module, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().float().cpu() for k, v in state.items()}  # a pipeline stage holds its own blocks only
    mean_losses = torch.tensor(recorder.losses, dtype=torch.float64)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(mean_losses)
        mean_losses /= world
    if reference:
        torch.save({"initial": initial, "trained": state}, Path(work_dir) / "reference.pt")
        moved = {}
    else:
        saved = torch.load(Path(work_dir) / "reference.pt", mmap=True)
        moved = {k: _distance(v, saved["trained"][k], saved["initial"][k]) for k, v in state.items()}
    rank = trainer.global_rank
    prediction = trainer.strategy.prediction
    mine = {"moved": moved, "peak_bytes": probe.peak_bytes, "predicted_peak_bytes": None}
    if prediction is not None and prediction.estimate is not None:
        mine["predicted_peak_bytes"] = prediction.stage_peak_memory_bytes(rank)
    ranks = [mine]
    if dist.is_initialized() and world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if rank != 0:
        return None
    estimate = prediction.estimate if prediction is not None else None
    return {
        "plan": trainer.strategy.plan.to_dict(),
        "devices": world,
        "seconds": seconds,
        "losses": mean_losses.tolist(),
        "moved": {k: v for r in ranks for k, v in r["moved"].items()},
        "step_time_s": statistics.median(probe.step_times()),
        "predicted_step_time_s": estimate.step_time_s if estimate is not None else None,
        "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
        "predicted_peak_bytes_per_rank": [r["predicted_peak_bytes"] for r in ranks],
        "prediction_missing": prediction.missing if prediction is not None else "no prediction",
    }


def _distance(trained: Any, expected: Any, initial: Any) -> float:
    """How far ``trained`` is from one device's ``expected``, relative to how far training moved that one."""
    moved = float((expected - initial).norm())
    return float((trained - expected).norm()) / moved if moved else float((trained - expected).norm())


def parity(record: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """One plan's verdict against the one-device run: losses step by step, parameters relative to their moves."""
    pairs = list(zip(record["losses"], reference["losses"]))
    loss_error = max((abs(a - b) / abs(b) for a, b in pairs), default=float("inf"))
    ratios = record["moved"]
    worst = max(ratios, key=ratios.get) if ratios else None
    mean = statistics.fmean(ratios.values()) if ratios else float("inf")
    return {
        "loss_rel_error": loss_error,
        "worst_parameter": worst,
        "worst_parameter_ratio": ratios[worst] if worst else None,
        "mean_parameter_ratio": mean,
        "passed": (
            len(pairs) == len(reference["losses"]) > 0
            and loss_error <= LOSS_RTOL
            and worst is not None
            and ratios[worst] <= PARAM_RTOL
            and mean <= PARAM_MEAN_RTOL
        ),
    }


# ---------------------------------------------------------------------------------------------- the launches
def skip_reason(device: str, devices: int | None) -> str | None:
    """Why the section cannot run here (``None``: it can)."""
    import torch

    visible = torch.cuda.device_count() if device == "cuda" else (devices or 2)
    if visible < 2:
        return f"multi-GPU section skipped: {visible} CUDA device(s) visible, it needs 2 or more"
    return None


def multi_section(config: ModelConfig, device: str, devices: int | None, steps: int = 3) -> dict[str, Any]:
    """Launch the reference and every plan kind; the records and verdicts (``{"skipped": why}`` without 2 GPUs)."""
    import torch

    reason = skip_reason(device, devices)
    if reason is not None:
        return {"skipped": reason}
    n = devices or min(torch.cuda.device_count(), MAX_DEVICES)
    n -= n % 2
    global_batch = 4 * n
    config = ModelConfig(**{**asdict(config), "global_batch": global_batch})
    accelerator = "gpu" if device == "cuda" else "cpu"
    out: dict[str, Any] = {"devices": n, "precision": PRECISION, "global_batch": global_batch, "plans": {}}
    with tempfile.TemporaryDirectory() as work_dir:
        out["reference"] = _launch(1, single_plan(config, global_batch).to_dict(), config, steps, accelerator, work_dir)
        for name, plan in plan_kinds(n, config.n_layer, global_batch).items():
            plan = plan if plan == "auto" else plan.to_dict()
            record = _launch(n, plan, config, steps, accelerator, work_dir, reference=False)
            if "error" not in record and "error" not in out["reference"]:
                record["parity"] = parity(record, out["reference"])
            out["plans"][name] = record
    out["passed"] = all(r.get("parity", {}).get("passed", False) for r in out["plans"].values())
    return out


def _launch(
    devices: int, plan: Any, config: ModelConfig, steps: int, accelerator: str, work_dir: str, reference: bool = True
) -> dict[str, Any]:
    case = Path(work_dir) / "case.json"
    result = Path(work_dir) / "result.json"
    result.unlink(missing_ok=True)
    case.write_text(
        json.dumps(
            {
                "plan": plan,
                "config": asdict(config),
                "steps": steps,
                "accelerator": accelerator,
                "work_dir": work_dir,
                "reference": reference,
                "result": str(result),
            }
        )
    )
    done = subprocess.run(launch_command(devices, case), cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not result.is_file():
        return {"error": f"exit {done.returncode}", "output_tail": (done.stdout + done.stderr)[-3000:]}
    return json.loads(result.read_text())


def _worker(case_file: str) -> int:
    case = json.loads(Path(case_file).read_text())
    record = train_plan(
        case["plan"], case["config"], case["steps"], case["accelerator"], case["work_dir"], case["reference"]
    )
    if record is not None:
        Path(case["result"]).write_text(json.dumps(record))
    return 0


def print_summary(out: dict[str, Any]) -> None:
    if "skipped" in out:
        print(out["skipped"])
        return
    for name, r in out["plans"].items():
        if "error" in r:
            print(f"{name:16s} FAILED ({r['error']}): {r['output_tail'][-400:]}")
            continue
        p = r["parity"]
        predicted = r["predicted_step_time_s"]
        print(
            f"{name:16s} loss error {p['loss_rel_error']:.1e}  worst parameter {p['worst_parameter_ratio']:.2f}  "
            f"step {r['step_time_s'] * 1e3:7.1f} ms (predicted {f'{predicted * 1e3:.1f} ms' if predicted else '-'})  "
            f"{'ok' if p['passed'] else 'FAILED'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu only to test the script itself")
    parser.add_argument("--devices", type=int, help="processes per launch (default: the visible GPUs, up to 8)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (for testing the script)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan")
    parser.add_argument("-o", "--output", default=str(MULTI_OUTPUT))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a launched process: the case file to run
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    out = multi_section(ModelConfig.tiny() if args.tiny else ModelConfig(), args.device, args.devices, args.steps)
    print_summary(out)
    if "skipped" in out:
        return 0
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
