"""``Fabric(strategy="galvatron")``: Fabric loops train as under Fabric's ``DDPStrategy``.

On 4 ranks of the pool, all cases of one model in one pool call:

- the example's hand-written loop (``examples/fabric_gpt.py``: ``fabric.setup``, ``setup_optimizers``,
  ``setup_dataloaders``, accumulation under ``no_backward_sync``, ``clip_gradients``, ``fabric.save``/``load``) on a
  Hugging Face GPT-2 and on LitGPT's GPT, under a plan with tensor-parallel blocks between data-parallel ones (and
  vocabulary parallelism: two ranks per data shard), a ZeRO plan (ZeRO-3 with recomputation, ZeRO-2; its optimizer
  made before ``fabric.setup``) and ``plan="auto"`` (GPT-2's under a budget DDP does not fit); a checkpoint saved
  mid-run under the tensor-parallel plan resumes under the ZeRO plan. Per-step losses, gradient norms (Adam hides
  gradient scale errors; the norm before clipping does not) and final parameters are compared.
- LitGPT's own ``litgpt.pretrain.main`` under a tensor-parallel plan and ``plan="auto"``, and resumed (``resume=``)
  from the tensor-parallel run's checkpoint into a ZeRO-3 plan, against the same under ``DDPStrategy``: per-step losses
  (the mean over ranks of what it logs) and the parameters of its final checkpoints. Its loop and every function it
  calls run unchanged; around it, ``sys.argv`` is the ``litgpt pretrain`` command line of the run (each save, rank 0
  re-parses it with jsonargparse into ``hyperparameters.yaml``; pytest's own would not parse), and two settings
  differ from LitGPT's defaults: ``torch.compile`` is disabled (the loop still calls it; Inductor's C++ code
  generation takes about a minute per graph and rank on 2 cores, five runs of four ranks; the strategy's compiled
  blocks are tested in ``tests/test_compile.py``), and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (LitGPT puts the
  DataLoader object itself in the state it saves and calls ``fabric.load`` without ``weights_only``, which
  torch >= 2.6 refuses to unpickle: resuming fails the same way under ``DDPStrategy``).
- what ``fabric.setup`` refuses (before training, saying what to change), an input that differs between the ranks of
  a data shard (at the first forward), a full checkpoint file resumed under another plan, ``fabric.load_raw`` of a
  plain state dict; and what is refused before any process is launched.
- a launched job (``tests/helpers/fabric_job.py``) whose rank is stopped is ended by the watchdog, naming it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.loggers import Logger
from lightning.fabric.strategies import DDPStrategy
from torch.utils.data import DataLoader, IterableDataset

from examples.fabric_gpt import train
from lightning_galvatron import GalvatronFabricStrategy
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError
from lightning_galvatron.strategy.checkpoint import load_model_state
from tests.helpers.training import SEQ, assert_parameters_moved_alike, dataset, gather_full_state
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(600)

PER_DEVICE, ACCUMULATE, STEPS, SAVE_AT, WORLD = 2, 2, 4, 2, 4
NORM_RTOL = 1e-4  # of the gradient norm before clipping: a scale error (a missing 1 / data shards) is a factor 2
EXAMPLE_INPUT = torch.zeros(PER_DEVICE, SEQ, dtype=torch.long)

TP, ZERO3 = LayerStrategy(tp=2), LayerStrategy(dp_type="zero3")
PLANS = {
    # Tensor-parallel blocks between data-parallel ones: activations relocate between layouts.
    # Vocabulary parallelism: two ranks share each data shard (and its samples).
    "tp": ParallelPlan(world_size=WORLD, vocab=TP, layers=(TP, LayerStrategy(), TP, ZERO3)),
    "zero": ParallelPlan(
        world_size=WORLD,
        vocab=ZERO3,
        layers=(LayerStrategy(dp_type="zero3", recompute=True), ZERO3, ZERO3, LayerStrategy(dp_type="zero2")),
    ),
    "zero3": ParallelPlan.uniform(WORLD, 4, ZERO3),
}


def hf_gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(1234)
    config = transformers.GPT2Config(
        vocab_size=16, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return transformers.GPT2LMHeadModel(config)


def litgpt_gpt() -> torch.nn.Module:
    from tests.helpers.model_families import _litgpt

    torch.manual_seed(1234)
    return _litgpt()[1]


def _strategy(case: str, cache_dir: str, budget: int | None = None) -> Any:
    if case == "ddp":
        return DDPStrategy()
    if case == "auto":
        return GalvatronFabricStrategy(example_input=EXAMPLE_INPUT, profile_cache=cache_dir, memory_budget=budget)
    return GalvatronFabricStrategy(plan=PLANS[case.removeprefix("resume_")])


def _budget_between_zero3_and_ddp(build: Any, cache_dir: str) -> int:
    """A memory budget that pure DDP exceeds and pure ZeRO-3 fits, by the profile the strategy then finds cached."""
    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler import profile
    from lightning_galvatron.profiler.model import forward_step
    from lightning_galvatron.search import evaluate

    module = build()
    measured = profile(module, find_blocks(module), EXAMPLE_INPUT, step=forward_step(), cache=cache_dir)
    peaks = [
        evaluate(
            measured,
            ParallelPlan.uniform(WORLD, 4, LayerStrategy(dp_type=kind)),
            global_batch_size=PER_DEVICE * WORLD,
            precision="32-true",
            optimizer="adamw",
        ).peak_memory_bytes
        for kind in ("ddp", "zero3")
    ]
    return int(sum(peaks) / 2)


def _train(build: Any, case: str, cache_dir: str, checkpoint: str, budget: int | None) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(case, cache_dir, budget))
    fabric.launch()
    if case == "zero":  # the optimizer made before the plan replaced the parameters, set up with the model
        module = build()
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-6))
    else:
        model = fabric.setup(build())
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    data = dataset(STEPS * ACCUMULATE * PER_DEVICE * WORLD)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=PER_DEVICE, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if case.startswith("resume_"):
        fabric.load(checkpoint, state)  # saved by the "tp" case after step SAVE_AT
    save = checkpoint if case == "tp" else None
    history = train(fabric, model, optimizer, loader, STEPS, ACCUMULATE, state=state, checkpoint=save, save_at=SAVE_AT)
    plan = getattr(fabric.strategy, "plan", None)
    return {"history": history, "state": gather_full_state(model.module), "plan": plan}


def _loop_cases(build: Any, directory: str, tight_auto: bool) -> dict[str, Any]:
    """Every case on this rank; a failure ends the run (its ranks may have stopped in different places)."""
    out: dict[str, Any] = {"initial": {k: v.detach().float().clone() for k, v in build().state_dict().items()}}
    cache = f"{directory}/cache"
    budget = _budget_between_zero3_and_ddp(build, cache) if tight_auto else None
    for case in ("ddp", "tp", "resume_zero", "zero", "auto"):
        try:
            out[case] = _train(build, case, cache, f"{directory}/tp.ckpt", budget)
        except PlanError as error:
            out[case] = f"PlanError: {error}"
        except Exception:  # noqa: BLE001 - reported by the test
            out[case] = f"failed: {traceback.format_exc()}"
            break
        dist.barrier()
    return out


@functools.cache
def _loop_results(pools: Any, build: Any, directory: str, tight_auto: bool) -> dict[str, Any]:
    return pools(WORLD).run(_loop_cases, build, directory, tight_auto)[0]


def _with_profile_cache(tmp_path_factory: Any, linked_profile_cache: Any, name: str) -> Path:
    """The session's directory ``name``, whose ``cache`` shares the session's cluster measurements."""
    directory = tmp_path_factory.getbasetemp() / name
    if not (directory / "cache").exists():
        directory.mkdir(exist_ok=True)
        linked_profile_cache(directory / "cache")
    return directory


def _assert_same_training(results: dict[str, Any], case: str) -> None:
    ours, ddp = results.get(case, "not run: a case before it failed"), results["ddp"]
    assert isinstance(ours, dict), ours
    losses, norms = zip(*ours["history"])
    expected_losses, expected_norms = zip(*ddp["history"][STEPS - len(losses) :])  # a resumed run: the steps after
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), atol=FP32_TOL["loss_tol"], rtol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=NORM_RTOL, atol=0)
    assert_parameters_moved_alike(
        ours["state"], ddp["state"], results["initial"], FP32_TOL["param_rtol"], FP32_TOL["param_mean_rtol"]
    )


@pytest.mark.parametrize("case", ["tp", "zero", "resume_zero", "auto"])
def test_hf_gpt2_fabric_loop_matches_ddp(pools, tmp_path_factory, linked_profile_cache, case):
    directory = _with_profile_cache(tmp_path_factory, linked_profile_cache, "fabric_hf_gpt2")
    results = _loop_results(pools, hf_gpt2, str(directory), True)
    _assert_same_training(results, case)
    if case == "auto":  # the budget leaves DDP out: the searched plan shards or splits something
        assert results["auto"]["plan"] != ParallelPlan.uniform(WORLD, 4, LayerStrategy()), results["auto"]["plan"]


@pytest.mark.parametrize("case", ["tp", "zero", "resume_zero", "auto"])
def test_litgpt_fabric_loop_matches_ddp(pools, tmp_path_factory, linked_profile_cache, case):
    directory = _with_profile_cache(tmp_path_factory, linked_profile_cache, "fabric_litgpt")  # also pretrain's
    results = _loop_results(pools, litgpt_gpt, str(directory), False)
    _assert_same_training(results, case)


# ---------------------------------------------------------------------------------------------- litgpt.pretrain
class _LossLog(Logger):
    """What ``fabric.log_dict`` gets, on every rank (LitGPT logs its rank's running loss once per optimizer step)."""

    name, version = "losses", 0

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[tuple[int, float]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if "loss" in metrics:
            self.losses.append((int(metrics["step"]), float(metrics["loss"])))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _pretrain(case: str, out_dir: Path, resume: Path | bool, cache_dir: str) -> list[tuple[int, float]]:
    import litgpt.pretrain
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import DataModule

    from tests.helpers.model_families import _litgpt

    class Tokens(DataModule):
        """``micro_batch_size`` rows of ``max_seq_length + 1`` tokens, as LitGPT's pretraining data."""

        def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
            self.batch_size, self.rows = batch_size, max_seq_length

        def train_dataloader(self) -> DataLoader:
            data = dataset(64)
            return DataLoader(torch.cat([data.inputs, data.targets[:, -1:]], 1), self.batch_size, shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(torch.cat([dataset(16).inputs, dataset(16).targets[:, -1:]], 1), self.batch_size)

    log = _LossLog()
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=_strategy(case, cache_dir), loggers=[log])
    fabric.launch()
    sys.argv = ["litgpt", "pretrain", "tiny-llama", f"--devices={WORLD}", "--seed=42", f"--out_dir={out_dir}"]
    if resume:
        sys.argv.append(f"--resume={resume}")
    litgpt.pretrain.main(
        fabric,
        devices=WORLD,
        seed=42,
        initial_checkpoint_dir=None,
        resume=resume,
        config=_litgpt()[1].config,
        data=Tokens(),
        out_dir=out_dir,
        tokenizer_dir=None,
        tokenizer=None,
        train=TrainArgs(
            save_interval=SAVE_AT,
            global_batch_size=PER_DEVICE * WORLD * ACCUMULATE,
            micro_batch_size=PER_DEVICE,
            lr_warmup_steps=1,
            max_tokens=STEPS * ACCUMULATE * PER_DEVICE * SEQ * WORLD,
            max_norm=1.0,
            min_lr=1e-3,
        ),
        eval=EvalArgs(interval=1000, max_iters=1, final_validation=False),
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-2}},
    )
    return log.losses


def _pretrain_cases(root: str, cache_dir: str) -> dict[str, Any]:
    checkpoint = f"step-{SAVE_AT:08d}/lit_model.pth"
    cases = {
        "ddp": ("ddp", False),
        "tp": ("tp", False),
        "auto": ("auto", False),
        "ddp_resumed": ("ddp", Path(root, "ddp", checkpoint)),
        "zero3_resumed_from_tp": ("zero3", Path(root, "tp", checkpoint)),
    }
    environment, compile_disabled, command_line = dict(os.environ), torch._dynamo.config.disable, list(sys.argv)
    torch._dynamo.config.disable = True
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    out: dict[str, Any] = {}
    try:
        for name, (strategy, resume) in cases.items():
            try:
                out[name] = _pretrain(strategy, Path(root, name), resume, cache_dir)
            except Exception:  # noqa: BLE001 - reported by the test
                out[name] = f"failed: {traceback.format_exc()}"
                break
            dist.barrier()
    finally:  # the pool's workers run other tests next (fabric.seed_everything sets PL_GLOBAL_SEED)
        torch._dynamo.config.disable = compile_disabled
        os.environ.clear()
        os.environ.update(environment)
        sys.argv = command_line
    return out


def _mean_losses(per_rank: list[Any]) -> list[float]:
    assert all(isinstance(losses, list) for losses in per_rank), per_rank[0]
    return [statistics.mean(losses[i][1] for losses in per_rank) for i in range(len(per_rank[0]))]


def _final_model(directory: Path) -> dict[str, torch.Tensor]:
    """The model of a LitGPT checkpoint: ``DDPStrategy`` writes a file, this strategy a sharded directory."""
    if directory.is_dir():
        return load_model_state(directory)
    return torch.load(directory, weights_only=False)["model"]


@pytest.mark.parametrize("case", ["tp", "auto", "zero3_resumed_from_tp"])
def test_litgpt_pretrain_main_matches_ddp(pools, tmp_path_factory, linked_profile_cache, case):
    root = tmp_path_factory.getbasetemp() / "litgpt_pretrain"
    cache = _with_profile_cache(tmp_path_factory, linked_profile_cache, "fabric_litgpt") / "cache"
    per_case = _pretrain_results(pools, str(root), str(cache))
    reference = "ddp_resumed" if "resumed" in case else "ddp"
    losses, expected = _mean_losses(per_case[case]), _mean_losses(per_case[reference])
    assert len(losses) == (STEPS - SAVE_AT if "resumed" in case else STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=FP32_TOL["loss_tol"], rtol=0)
    initial = _final_model(root / "ddp" / f"step-{SAVE_AT:08d}" / "lit_model.pth")  # the movement since step 2
    actual, ddp = (_final_model(root / name / "final" / "lit_model.pth") for name in (case, reference))
    assert_parameters_moved_alike(actual, ddp, initial, FP32_TOL["param_rtol"], FP32_TOL["param_mean_rtol"])
    hyperparameters = (root / case / "final" / "hyperparameters.yaml").read_text()  # rank 0's files beside the save
    assert "model_name: tiny-llama" in hyperparameters and (root / case / "final" / "model_config.yaml").is_file()


@functools.cache
def _pretrain_results(pools: Any, root: str, cache_dir: str) -> dict[str, list[Any]]:
    per_rank = pools(WORLD).run(_pretrain_cases, root, cache_dir)
    return {name: [rank.get(name) for rank in per_rank] for name in per_rank[0]}


# ---------------------------------------------------------------------------------------------- setup and files
def _setup_checks(directory: str) -> dict[str, Any]:
    """What ``fabric.setup`` refuses before anything trains (each error, the same on every rank); a full checkpoint
    file (``save_distributed_checkpoint=False``) resumed under another plan; ``fabric.load_raw`` of a state dict."""
    out: dict[str, Any] = {}
    attempts = {
        "no blocks": (GalvatronFabricStrategy(plan=PLANS["zero3"]), functools.partial(torch.nn.Linear, 4, 4), False),
        "auto without example": (GalvatronFabricStrategy(), hf_gpt2, False),
        "optimizer made before": (GalvatronFabricStrategy(plan=PLANS["zero3"]), hf_gpt2, True),
    }
    for name, (strategy, build, optimizer_first) in attempts.items():
        fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
        fabric.launch()
        module = build()
        optimizer = torch.optim.AdamW(module.parameters())
        try:
            fabric.setup(module)
            if optimizer_first:
                fabric.setup_optimizers(optimizer)
        except Exception as error:  # noqa: BLE001 - compared by the test
            out[name] = f"{type(error).__name__}: {error}"

    def trained(plan: str, **kwargs: Any) -> tuple[L.Fabric, Any, Any]:
        strategy = GalvatronFabricStrategy(plan=PLANS[plan], **kwargs)
        fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
        fabric.launch()
        model = fabric.setup(hf_gpt2())
        return fabric, model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

    fabric, model, _ = trained("tp")
    loader = fabric.setup_dataloaders(DataLoader(_ShardedByRank(), batch_size=PER_DEVICE))
    try:
        model(next(iter(loader))[0])
    except PlanError as error:
        out["rank-sharded input"] = str(error)

    fabric, model, optimizer = trained("zero", save_distributed_checkpoint=False)
    loader = fabric.setup_dataloaders(DataLoader(dataset(PER_DEVICE * WORLD), batch_size=PER_DEVICE))
    train(fabric, model, optimizer, loader, steps=1, accumulate=1)
    fabric.save(f"{directory}/full.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    out["saved"] = gather_full_state(model.module)
    if dist.get_rank() == 0:
        torch.save(out["saved"], f"{directory}/raw.pt")  # a plain state dict, as torch.save(model.state_dict())
    fabric, model, optimizer = trained("tp")
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{directory}/full.ckpt", state)
    out["resumed"] = gather_full_state(model.module)
    out["resumed steps"] = (state["step"], sorted({float(s["step"]) for s in optimizer.state.values()}))
    fabric, model, _ = trained("zero3")
    fabric.load_raw(f"{directory}/raw.pt", model)
    out["raw"] = gather_full_state(model.module)
    return out


class _ShardedByRank(IterableDataset):
    """Samples sharded by ``torch.distributed.get_rank()``: each rank its own, also the ranks of one data shard."""

    def __iter__(self) -> Any:
        data = dataset(4 * WORLD)
        return (data[i] for i in range(dist.get_rank(), len(data), dist.get_world_size()))


def test_fabric_setup_refusals_full_checkpoints_and_raw_weights(pools, tmp_path_factory):
    directory = tmp_path_factory.mktemp("fabric_files")
    out = pools(WORLD).run(_setup_checks, str(directory))[0]
    assert "could not find the Transformer blocks of Linear" in out["no blocks"], out
    assert "GalvatronFabricStrategy(example_input=...)" in out["auto without example"], out
    assert "create it after fabric.setup(model)" in out["optimizer made before"], out
    refused = out.get("rank-sharded input", "not refused")
    assert re.search(r"ranks \d, \d read one data shard of this plan .* different input batches", refused), refused
    assert "fabric.strategy.distributed_sampler_kwargs gives num_replicas" in refused
    assert (directory / "full.ckpt").is_file()
    assert out["resumed steps"] == (1, [1.0])  # the loop's state and every Adam state, under another plan
    for name in ("resumed", "raw"):
        assert out[name].keys() == out["saved"].keys()
        for key, value in out["saved"].items():
            torch.testing.assert_close(out[name][key], value, rtol=0, atol=0, msg=f"{name}: {key}")


def test_registered_in_fabric_and_checked_before_launch():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="galvatron")
    assert isinstance(fabric.strategy, GalvatronFabricStrategy)
    pipeline = ParallelPlan(world_size=WORLD, pp=2, micro_batches=2, layers=(LayerStrategy(),) * 4)
    with pytest.raises(PlanError, match="Fabric cannot run this plan's pp=2 and micro_batches=2") as refused:
        L.Fabric(accelerator="cpu", devices=WORLD, strategy=GalvatronFabricStrategy(plan=pipeline))
    assert 'Trainer(strategy="galvatron")' in str(refused.value)
    with pytest.raises(ValueError, match="does not support precision='16-true'"):
        L.Fabric(accelerator="cpu", devices=2, precision="16-true", strategy=GalvatronFabricStrategy(plan=PLANS["tp"]))
    with pytest.raises(ValueError, match="the plan is for world_size=4 but 2 devices are running"):
        L.Fabric(accelerator="cpu", devices=2, strategy=GalvatronFabricStrategy(plan=PLANS["tp"]))
    with pytest.raises(ValueError, match="search_batch_size: under Fabric your loop fixes the batch"):
        GalvatronFabricStrategy(search_options={"search_batch_size": True})
    with pytest.raises(ValueError, match=r"watchdog \['step_timeout_s'\]: under Fabric the watchdog has one timeout"):
        GalvatronFabricStrategy(watchdog={"step_timeout_s": 5})


@pytest.mark.timeout(240)
def test_a_stopped_rank_ends_the_fabric_job_with_its_name(tmp_path):
    """A launched Fabric job (Fabric's launcher starts rank 1) whose rank 1 is stopped after two optimizer steps:
    the watchdog ends it with its exit code, naming the rank and where it was last seen."""
    from lightning_galvatron.runtime.watchdog import EXIT_CODE
    from tests.test_failures import REPO, _finish, _user_lines, _wait_for_pids

    timeout_s = 8
    job = subprocess.Popen(
        [
            sys.executable,
            "tests/helpers/fabric_job.py",
            str(tmp_path),
            "--watchdog",
            f'{{"setup_timeout_s": {timeout_s}}}',
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids: dict[int, int] = {}
    try:
        pids = _wait_for_pids(job, tmp_path, 2)
        time.sleep(2 * timeout_s / 5)  # two heartbeats: rank 1's record says it is in the loop
        os.kill(pids[1], signal.SIGSTOP)
    except BaseException:
        with contextlib.suppress(subprocess.TimeoutExpired):
            _finish(job, pids, timeout_s=0.1)  # ends the job (and the ranks it knows of) before the test fails
        raise
    code, output, took, running = _finish(job, pids, timeout_s=60)
    text = _user_lines(output)
    assert code == EXIT_CODE and running == [], text[-3000:]
    assert took < timeout_s + 15, took
    assert f"Galvatron watchdog: no progress for {timeout_s} s (watchdog setup_timeout_s)." in text, text[-3000:]
    assert (
        "rank 1: missing -- no heartbeat (stopped, or hung without releasing Python); last seen in the loop, " in text
    )
    assert text.count("Galvatron watchdog:") == 1 and "Traceback" not in text, text[-3000:]
