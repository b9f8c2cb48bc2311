"""Small training runs shared by the parity tests: one function per side of a comparison.

``run_distributed`` runs inside every worker of a :class:`~tests.helpers.pool.WorkerPool`;
``run_single`` is the single-process reference, trained on the same global batches in the same
order (Lightning gives distributed runs a ``DistributedSampler(shuffle=True, seed=0)``; the
reference uses that sampler with one replica).
"""

from __future__ import annotations

import functools
import re
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from examples.gpt import ArithmeticText, GPTModule
from lightning_galvatron import GalvatronStrategy
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError
from tests.helpers.plan_check import assert_plan_applied

SEQ = 8
TINY_GPT = dict(vocab_size=16, seq_length=SEQ, n_layer=4, n_head=4, n_embd=32, learning_rate=1e-2)
# Measured selection in tests of other features: a short budget (the search's plan and, time permitting, one
# other), so that plan="auto" stays quick; tests/test_measured_selection.py gives trials more room.
QUICK_TRIALS = {"budget_s": 4, "timed_steps": 1, "max_candidates": 2}


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)  # per optimizer step, mean over data shards
    state: dict[str, torch.Tensor] | None = None  # full model state (rank 0 / single process)
    initial: dict[str, torch.Tensor] | None = None  # full model state before training (the movement's origin)
    grads: dict[str, torch.Tensor] | None = None  # full gradients of the first step, before clipping
    param_dtypes: set[torch.dtype] = field(default_factory=set)  # as trained, before gathering
    val_loss: float | None = None
    test_loss: float | None = None  # with evaluate=True: trainer.test after training
    predictions: dict[tuple, torch.Tensor] | torch.Tensor | None = (
        None  # with evaluate=True: keyed by input tokens where
    )
    # predict_step returns (inputs, predictions), else predict_step's outputs joined
    plan: Any = None  # the plan the strategy ran (distributed runs)


class _LossRecorder(L.Callback):
    """Losses of every step, and the full gradients of the first (Adam hides gradient scale errors)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach().float()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.grads is None:
            self.grads = {
                name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().clone()
                for name, p in pl_module.named_parameters()
                if p.grad is not None
            }


def tiny_gpt(**overrides: Any) -> GPTModule:
    torch.manual_seed(1234)
    return GPTModule(**{**TINY_GPT, **overrides})


def dataset(num_samples: int) -> ArithmeticText:
    return ArithmeticText(num_samples, SEQ, seed=0)


def _trainer(strategy: Any, devices: int, precision: str, **trainer_kwargs: Any) -> tuple[L.Trainer, _LossRecorder]:
    recorder = _LossRecorder()
    trainer_kwargs.setdefault("max_steps", 3)
    trainer = L.Trainer(
        default_root_dir=tempfile.gettempdir(),  # where the strategy saves its plan (no logger here)
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    return trainer, recorder


def run_single(
    model: Callable[[], L.LightningModule] | None = None,
    global_batch: int = 8,
    num_samples: int = 64,
    precision: str = "32-true",
    model_kwargs: dict | None = None,
    validate: bool = False,
    evaluate: bool = False,
    **trainer_kwargs: Any,
) -> RunResult:
    """The single-process reference. With ``evaluate``, ``fit`` validates after the last step, then ``test`` and
    ``predict`` run on held-out samples (the module logs ``val_loss``/``test_loss``; ``predict_step`` returns
    ``(inputs, predictions)``)."""
    module = model() if model is not None else tiny_gpt(**(model_kwargs or {}))
    initial = _float_copy(module.state_dict())
    data = dataset(num_samples)
    loader = DataLoader(data, batch_size=global_batch, sampler=DistributedSampler(data, 1, 0, shuffle=True, seed=0))
    if evaluate:
        trainer_kwargs.setdefault("val_check_interval", trainer_kwargs.get("max_steps", 3))
    trainer, recorder = _trainer("auto", 1, precision, **trainer_kwargs)
    trainer.fit(module, loader, val_dataloaders=_evaluation_data(global_batch, global_batch) if evaluate else None)
    result = RunResult(
        losses=recorder.losses, state=_float_copy(module.state_dict()), grads=recorder.grads, initial=initial
    )
    if validate:
        result.val_loss = _validation_loss(trainer, module, global_batch)
    if evaluate:
        _evaluate(trainer, module, global_batch, global_batch, result)
    return result


def run_distributed(
    plan: Any = None,
    strategy: Any = None,
    global_batch: int = 8,
    num_samples: int = 64,
    precision: str = "32-true",
    model_kwargs: dict | None = None,
    validate: bool = False,
    evaluate: bool = False,
    ckpt_path: str | None = None,
    save_path: str | None = None,
    strategy_kwargs: dict | None = None,
    model: Callable[[], L.LightningModule] | None = None,
    check_plan: bool = True,
    **trainer_kwargs: Any,
) -> RunResult:
    """Train on all ranks of the pool; the DataLoader has DDP's per-device batch size.

    With ``evaluate``, ``fit`` validates after the last step, then ``test`` and ``predict`` run on held-out
    samples (see :func:`run_single`).

    With ``check_plan`` (and the Galvatron strategy) every rank's parameters, blocks and groups are checked
    against the plan after ``fit`` (:func:`~tests.helpers.plan_check.assert_plan_applied`).
    """
    world = dist.get_world_size()
    factory = model if model is not None else functools.partial(tiny_gpt, **(model_kwargs or {}))
    module = factory()
    initial = _float_copy(module.state_dict()) if dist.get_rank() == 0 else None
    loader = DataLoader(dataset(num_samples), batch_size=global_batch // world, shuffle=True)
    if strategy is None:
        strategy = GalvatronStrategy(plan=plan if plan is not None else "auto", **(strategy_kwargs or {}))
    if evaluate:
        trainer_kwargs.setdefault("val_check_interval", trainer_kwargs.get("max_steps", 3))
    trainer, recorder = _trainer(strategy, world, precision, **trainer_kwargs)
    validation = _evaluation_data(global_batch, global_batch // world) if evaluate else None
    trainer.fit(module, loader, val_dataloaders=validation, ckpt_path=ckpt_path)
    if check_plan and isinstance(trainer.strategy, GalvatronStrategy):
        assert_plan_applied(trainer.strategy, factory)
    if save_path is not None:
        trainer.save_checkpoint(save_path)
    result = RunResult(
        losses=_mean_over_ranks(recorder.losses), grads=_merge_over_ranks(recorder.grads), initial=initial
    )
    result.param_dtypes = {p.dtype for p in trainer.lightning_module.parameters()}
    result.state = gather_full_state(trainer.lightning_module)
    if validate:
        result.val_loss = _validation_loss(trainer, module, global_batch // world)
    if evaluate:
        _evaluate(trainer, module, global_batch, global_batch // world, result)
        if isinstance(result.predictions, dict):
            result.predictions = _merge_over_ranks(result.predictions)
    result.plan = getattr(trainer.strategy, "plan", None)
    return result


def _evaluation_data(global_batch: int, batch_size: int) -> DataLoader:
    """Held-out samples: two global batches (every data shard gets whole batches, so means over batches agree)."""
    return DataLoader(ArithmeticText(2 * global_batch, SEQ, seed=1), batch_size=batch_size)


def _evaluate(
    trainer: L.Trainer, module: L.LightningModule, global_batch: int, batch_size: int, result: RunResult
) -> None:
    """Validation loss of the fit, then ``trainer.test`` and ``trainer.predict``: predictions keyed by their input
    where ``predict_step`` returns ``(inputs, predictions)`` (comparable over data shards), else joined over the
    ranks in the order of the samples."""
    result.val_loss = float(trainer.callback_metrics["val_loss"])
    result.test_loss = float(
        trainer.test(module, _evaluation_data(global_batch, batch_size), verbose=False)[0]["test_loss"]
    )
    outputs = trainer.predict(module, _evaluation_data(global_batch, batch_size))
    if outputs and isinstance(outputs[0], tuple):
        result.predictions = {
            tuple(x.tolist()): p.detach().float().cpu() for inputs, logits in outputs for x, p in zip(inputs, logits)
        }
    else:
        result.predictions = _in_sample_order(trainer, torch.cat([p.detach().float().cpu() for p in outputs]))


def _in_sample_order(trainer: L.Trainer, predictions: torch.Tensor) -> torch.Tensor:
    """Every rank's predictions in the order of the samples: DDP's predict sampler (which every strategy's predict
    follows) gives rank ``r`` of ``W`` the samples ``r, r + W, ...``."""
    if trainer.world_size == 1:
        return predictions
    gathered: list[torch.Tensor | None] = [None] * trainer.world_size
    dist.all_gather_object(gathered, predictions)
    return torch.stack(gathered, 1).flatten(0, 1)


def _validation_loss(trainer: L.Trainer, module: GPTModule, batch_size: int) -> float:
    metrics = trainer.validate(
        module, DataLoader(ArithmeticText(16, SEQ, seed=1), batch_size=batch_size), verbose=False
    )
    return float(metrics[0]["val_loss"])


def _mean_over_ranks(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def _merge_over_ranks(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """Union of per-rank dicts of full tensors (pipeline stages hold different names), on rank 0."""
    gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensors or {})
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def gather_full_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Full (unsharded) fp32 state dict of the whole model on rank 0, ``None`` elsewhere."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return _merge_over_ranks({k: v.detach().float().cpu().clone() for k, v in state.items()})


def _float_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def assert_close_runs(
    actual: RunResult,
    expected: RunResult,
    loss_tol: float,
    param_rtol: float,
    grad_rtol: float,
    param_mean_rtol: float | None = None,
) -> None:
    """Same losses and parameters; same first-step gradients relative to their size.

    Parameter errors are measured against how far training moved each tensor in ``expected``
    (``|final - initial|``), so the bound holds on any CPU whatever its rounding, and a wrong
    update (a missing reduction, a wrong scale, a block that did not train) is far outside it:
    the largest element error within ``param_rtol`` of the tensor's largest movement, the mean
    error within ``param_mean_rtol`` of its mean movement (``param_rtol / 10`` unless given; bf16
    runs bound only the mean tightly: Adam turns a near-zero gradient of flipped sign into a
    full-size step). Tensors that barely move are measured against 1% of the model's movement.
    Tensors whose reference gradient is zero up to rounding (a key bias under softmax) are left to
    the gradient check: Adam turns their rounding noise into steps of random sign, which is no
    reference to compare with.

    The gradient check matters because Adam's update is invariant to the scale of the gradient:
    a run that sums where it should average would still match in parameters after a few steps.
    A gradient's error is measured against its RMS, floored at 1% of the RMS over all gradients
    (some gradients are zero up to rounding, e.g. a key bias under softmax).
    """
    assert len(actual.losses) == len(expected.losses), (actual.losses, expected.losses)
    torch.testing.assert_close(torch.tensor(actual.losses), torch.tensor(expected.losses), atol=loss_tol, rtol=0)
    assert actual.state is not None and expected.state is not None
    assert actual.state.keys() == expected.state.keys()
    assert actual.grads is not None and expected.grads is not None
    noise = rounding_noise_gradients(expected.grads)
    assert_parameters_moved_alike(
        actual.state, expected.state, expected.initial, param_rtol, param_mean_rtol, skip=noise
    )
    # A pipeline's last stage names a tied weight after the head; one process names it once.
    assert expected.grads.keys() <= actual.grads.keys(), expected.grads.keys() - actual.grads.keys()
    all_grads = torch.cat([g.flatten() for g in expected.grads.values()])
    floor = 0.01 * float(all_grads.norm()) / all_grads.numel() ** 0.5
    for name, value in expected.grads.items():
        scale = max(float(value.norm()) / value.numel() ** 0.5, floor)
        error = float((actual.grads[name] - value).abs().max())
        assert error <= grad_rtol * scale, f"gradient of {name}: max error {error:.3g} > {grad_rtol} x RMS {scale:.3g}"


def rounding_noise_gradients(grads: dict[str, torch.Tensor], relative: float = 1e-6) -> set[str]:
    """Names of gradients whose RMS is below ``relative`` times the RMS over all gradients: zero in exact
    arithmetic (rounding noise is ~1e-8 of the rest; real gradients here are > 1e-3 of it)."""
    all_grads = torch.cat([g.flatten() for g in grads.values()])
    overall = float(all_grads.norm()) / all_grads.numel() ** 0.5
    return {name for name, g in grads.items() if float(g.norm()) / g.numel() ** 0.5 < relative * overall}


def assert_parameters_moved_alike(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor] | None,
    rtol: float,
    mean_rtol: float | None = None,
    skip: set[str] = frozenset(),
) -> None:
    """Every tensor of ``actual`` within ``rtol`` of how far training moved it from ``initial`` to ``expected``
    (see :func:`assert_close_runs`); ``skip`` names tensors not to check."""
    assert initial is not None, "the reference run did not record its initial state"
    mean_rtol = rtol / 10 if mean_rtol is None else mean_rtol
    movement = {name: (expected[name].float() - initial[name].float()).abs() for name in expected}
    moved = [m for m in movement.values() if m.numel()]
    floor_max = 0.01 * max(float(m.max()) for m in moved)
    floor_mean = 0.01 * float(torch.cat([m.flatten() for m in moved]).mean())
    for name, value in expected.items():
        if not movement[name].numel() or name in skip:
            continue
        error = (actual[name].float() - value.float()).abs()
        max_scale = max(float(movement[name].max()), floor_max)
        mean_scale = max(float(movement[name].mean()), floor_mean)
        assert float(error.max()) <= rtol * max_scale, (
            f"{name}: max error {float(error.max()):.3g} > {rtol} x largest movement {max_scale:.3g}"
        )
        assert float(error.mean()) <= mean_rtol * mean_scale, (
            f"{name}: mean error {float(error.mean()):.3g} > {mean_rtol} x mean movement {mean_scale:.3g}"
        )


def assert_same_evaluation(actual: RunResult, expected: RunResult, loss_tol: float, prediction_tol: float) -> None:
    """Same validation and test losses, and the same predictions for every held-out sample."""
    assert actual.val_loss == pytest_approx(expected.val_loss, loss_tol), (
        "val_loss",
        actual.val_loss,
        expected.val_loss,
    )
    assert actual.test_loss == pytest_approx(expected.test_loss, loss_tol), (
        "test_loss",
        actual.test_loss,
        expected.test_loss,
    )
    assert actual.predictions is not None and expected.predictions is not None
    if isinstance(expected.predictions, torch.Tensor):
        torch.testing.assert_close(actual.predictions, expected.predictions, atol=prediction_tol, rtol=0)
        return
    assert actual.predictions.keys() == expected.predictions.keys()
    for key, value in expected.predictions.items():
        torch.testing.assert_close(actual.predictions[key], value, atol=prediction_tol, rtol=0)


def refused_as_expected(outcome: RunResult | str, refusal: str | None) -> bool:
    """For a matrix case (what :func:`run_cases` returns for it): ``True`` if it was refused in setup with a message
    matching ``refusal``; ``False`` if it ran (and no refusal was expected). Fails otherwise."""
    if refusal is not None:
        assert isinstance(outcome, str) and outcome.startswith("PlanError:"), outcome
        assert re.search(refusal, outcome), outcome
        return True
    assert not isinstance(outcome, str), outcome
    return False


def pytest_approx(value: float | None, tol: float) -> Any:
    return pytest.approx(value, abs=tol, rel=0)


def run_cases(
    cases: dict[str, dict[str, Any]],
    model: Callable[[], L.LightningModule],
    global_batch: int,
    cache_dir: str,
    **common: Any,
) -> dict[str, RunResult | str]:
    """Several distributed runs of one model in one pool call, each ``run_distributed(**common, **case)``.

    A case ``{"auto": "ample"}`` trains with ``plan="auto"``, the default memory budget and quick trials,
    ``{"auto": "tight"}`` with a budget between pure ZeRO-3's and pure DDP's (see
    :func:`budget_between_zero3_and_ddp`) and the search's plan untried; profiles are cached in ``cache_dir``. A case
    the strategy refuses gives its error message instead of a result; one that fails gives its traceback, and the
    cases after it are not run (its ranks may have stopped in different places,
    so what follows would only wait for the others): the caller should then start a fresh pool.
    """
    out: dict[str, RunResult | str] = {}
    for name, case in cases.items():
        if name in out:
            continue
        case = dict(case)
        auto = case.pop("auto", None)
        try:
            if auto is not None:
                budget = budget_between_zero3_and_ddp(model, global_batch, cache_dir) if auto == "tight" else None
                # Trials once per model (ample): under the tight budget the search's own choice is what is checked.
                trials = QUICK_TRIALS if auto == "ample" else False
                case["strategy"] = GalvatronStrategy(
                    memory_budget=budget, profile_cache=cache_dir, save_plan=False, trials=trials
                )
            out[name] = run_distributed(model=model, global_batch=global_batch, **common, **case)
        except PlanError as error:
            out[name] = f"PlanError: {error}"
        except Exception:  # noqa: BLE001 - reported by the test of this case
            out[name] = f"failed: {traceback.format_exc()}"
            # Ranks may have stopped in different places: what follows would only wait for the others.
            out |= {later: f"not run: {name} failed before it" for later in cases if later not in out}
    return out


def budget_between_zero3_and_ddp(model: Callable[[], L.LightningModule], batch: int, cache_dir: str) -> int:
    """A memory budget that pure DDP exceeds and pure ZeRO-3 fits, from the profile the strategy will use (the
    same cache), as predicted for AdamW in fp32."""
    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler import profile
    from lightning_galvatron.search import evaluate

    world = dist.get_world_size()
    module = model()
    measured = profile(
        module,
        find_blocks(module),
        dataset(batch)[0 : batch // world],
        precision="32-true",
        devices_per_node=world,
        cache=cache_dir,
    )
    peaks = [
        evaluate(
            measured,
            ParallelPlan.uniform(world, measured.model.num_blocks, LayerStrategy(dp_type=name)),
            global_batch_size=batch,
            precision="32-true",
            optimizer="adamw",
        ).peak_memory_bytes
        for name in ("ddp", "zero3")
    ]
    return int(sum(peaks) / 2)
