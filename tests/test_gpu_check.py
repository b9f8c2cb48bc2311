"""``benchmarks/gpu_check.py`` without a GPU: its logic, and its profile and memory sections on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_check  # noqa: E402


def test_cases_plans_and_verdicts() -> None:
    cases = gpu_check.memory_cases()
    assert len(set(cases)) == 8
    assert {c.precision for c in cases} == {"bf16-mixed", "bf16-true"}
    assert {(c.recompute, c.micro_batches) for c in cases} == {(False, 1), (False, 4), (True, 1), (True, 4)}
    config = gpu_check.ModelConfig()
    plan = gpu_check.single_device_plan(gpu_check.MemoryCase("bf16-true", True, 4), config)
    assert plan.world_size == 1 and plan.micro_batches == 4 and all(s.recompute for s in plan.layers)
    assert not plan.vocab.recompute and plan.num_layers == config.n_layer
    assert gpu_check.compare_memory("a", 100.0, 110, 0.15)["passed"]
    assert not gpu_check.compare_memory("a", 100.0, 120, 0.15)["passed"]
    assert not gpu_check.compare_memory("a", 100.0, None, 0.15)["passed"]
    assert gpu_check.loss_fell([3.0, 2.9, 2.5, 2.0, 1.5, 1.2, 1.0, 0.9])
    assert not gpu_check.loss_fell([3.0, 3.0, 3.1, 3.0, 2.9, 3.0, 3.0, 3.1])
    assert not gpu_check.loss_fell([3.0, float("nan"), 1.0, 0.5])


def test_example_command_and_its_losses(tmp_path: Path) -> None:
    command = gpu_check.example_command(tmp_path)
    assert "configs/gpt_tiny_cpu_auto.yaml" in " ".join(command)  # the README's first command
    assert command[command.index("--trainer.accelerator") + 1] == "gpu"
    assert command[command.index("--trainer.devices") + 1] == "1"
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train_loss,val_loss\n0,19,2.5,\n0,9,3.0,\n0,29,,2.4\n0,39,1.5,\n")
    assert gpu_check.read_losses(metrics) == [3.0, 2.5, 1.5]


def test_profile_and_memory_sections_run_on_cpu(tmp_path: Path) -> None:
    """The script itself, on the CPU with a tiny model (in its own process: its Trainers create a process group,
    which must not outlive them in the test process that forks the other tests' workers)."""
    output = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--device",
            "cpu",
            "--tiny",
            "--cases",
            "2",
            "--skip-example",
            "-o",
            str(output),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out = json.loads(output.read_text())
    assert done.returncode == (0 if out["passed"] else 1), done.stderr[-2000:]
    assert set(out["profile"]) == {"bf16-mixed", "bf16-true"} and all(p["passed"] for p in out["profile"].values())
    assert [r["case"] for r in out["memory"]] == ["bf16-mixed no-recompute m1", "bf16-mixed no-recompute m4"]
    for row in out["memory"]:
        assert row["measured_bytes"] > 0 and row["predicted_bytes"] > 0 and 0.5 < row["ratio"] < 2.0


# ---------------------------------------------------------------------------------------------- the multi-GPU section
def test_multi_gpu_plans_launch_and_verdicts() -> None:
    from benchmarks import gpu_check_multi as multi

    kinds = multi.plan_kinds(2, 2, 8)
    assert set(kinds) == {"auto", "ddp", "zero2", "zero3", "tp2 megatron-sp", "vocab tp2", "1f1b", "gpipe"}
    plans = {name: plan for name, plan in kinds.items() if plan != "auto"}
    assert all(p.world_size == 2 and p.global_batch_size == 8 and p.num_layers == 2 for p in plans.values())
    assert {plans["zero2"].layers[0].dp_type, plans["zero3"].layers[0].dp_type} == {"zero2", "zero3"}
    assert plans["tp2 megatron-sp"].layers[0].sp == "megatron" and plans["vocab tp2"].vocab.tp == 2
    assert (plans["1f1b"].pp, plans["1f1b"].schedule, plans["gpipe"].schedule) == (2, "1f1b", "gpipe")
    command = multi.launch_command(4, Path("case.json"))
    assert command[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=4" in command
    assert command[-2:] == ["--worker", "case.json"]
    reference = {"losses": [2.0, 1.5]}
    assert multi.parity({"losses": [2.001, 1.502], "moved": {"a": 0.2, "b": 0.1}}, reference)["passed"]
    assert not multi.parity({"losses": [2.0, 1.6], "moved": {"a": 0.2}}, reference)["passed"]  # a loss 7% off
    assert not multi.parity({"losses": [2.0, 1.5], "moved": {"a": 5.0}}, reference)["passed"]  # a parameter astray
    assert not multi.parity({"losses": [2.0], "moved": {"a": 0.1}}, reference)["passed"]  # a step missing


def test_multi_gpu_section_skips_without_two_gpus(capsys) -> None:
    from benchmarks import gpu_check_multi as multi

    assert multi.main([]) == 0  # --device cuda on a machine without GPUs
    assert "multi-GPU section skipped: 0 CUDA device(s) visible, it needs 2 or more" in capsys.readouterr().out


def test_a_multi_gpu_case_trains_like_one_device_on_the_cpu(pools, tmp_path: Path) -> None:
    """What each launched process runs (``train_plan``), on the tests' gloo workers: ZeRO-3 over 2 processes
    against one, the same verdict the GPU run gives."""
    from dataclasses import asdict

    import examples.gpt  # noqa: F401 - torch and Lightning imported here, before the workers fork, not in each
    from benchmarks import gpu_check_multi as multi

    config = gpu_check.ModelConfig.tiny()
    work = str(tmp_path)
    single = multi.single_plan(config, config.global_batch).to_dict()
    reference = pools(1).run(multi.train_plan, single, asdict(config), 1, "cpu", work, True, False)[0]
    zero3 = multi.plan_kinds(2, config.n_layer, config.global_batch)["zero3"].to_dict()
    record = pools(2).run(multi.train_plan, zero3, asdict(config), 1, "cpu", work, False, False)[0]
    verdict = multi.parity(record, reference)
    assert verdict["passed"], verdict
    assert record["devices"] == 2 and record["peak_bytes_per_rank"] == [None, None]  # not measured here
    assert record["predicted_step_time_s"] is None and "profile" in record["prediction_missing"]
