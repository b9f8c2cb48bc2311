"""Small training runs shared by the parity tests: one function per side of a comparison.

``run_distributed`` runs inside every worker of a :class:`~tests.helpers.pool.WorkerPool`;
``run_single`` is the single-process reference, trained on the same global batches in the same
order (Lightning gives distributed runs a ``DistributedSampler(shuffle=True, seed=0)``; the
reference uses that sampler with one replica).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from examples.gpt import ArithmeticText, GPTModule
from lightning_galvatron import GalvatronStrategy

SEQ = 8
TINY_GPT = dict(vocab_size=16, seq_length=SEQ, n_layer=4, n_head=4, n_embd=32, learning_rate=1e-2)


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)  # per optimizer step, mean over data shards
    state: dict[str, torch.Tensor] | None = None  # full model state (rank 0 / single process)
    grads: dict[str, torch.Tensor] | None = None  # full gradients of the first step, before clipping
    param_dtypes: set[torch.dtype] = field(default_factory=set)  # as trained, before gathering
    val_loss: float | None = None


class _LossRecorder(L.Callback):
    """Losses of every step, and the full gradients of the first (Adam hides gradient scale errors)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"].detach().float()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
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
    **trainer_kwargs: Any,
) -> RunResult:
    module = model() if model is not None else tiny_gpt(**(model_kwargs or {}))
    data = dataset(num_samples)
    loader = DataLoader(data, batch_size=global_batch, sampler=DistributedSampler(data, 1, 0, shuffle=True, seed=0))
    trainer, recorder = _trainer("auto", 1, precision, **trainer_kwargs)
    trainer.fit(module, loader)
    result = RunResult(
        losses=recorder.losses, state={k: v.clone() for k, v in module.state_dict().items()}, grads=recorder.grads
    )
    if validate:
        result.val_loss = _validation_loss(trainer, module, global_batch)
    return result


def run_distributed(
    plan: Any = None,
    strategy: Any = None,
    global_batch: int = 8,
    num_samples: int = 64,
    precision: str = "32-true",
    model_kwargs: dict | None = None,
    validate: bool = False,
    ckpt_path: str | None = None,
    save_path: str | None = None,
    strategy_kwargs: dict | None = None,
    model: Callable[[], L.LightningModule] | None = None,
    **trainer_kwargs: Any,
) -> RunResult:
    """Train on all ranks of the pool; the DataLoader has DDP's per-device batch size."""
    world = dist.get_world_size()
    module = model() if model is not None else tiny_gpt(**(model_kwargs or {}))
    loader = DataLoader(dataset(num_samples), batch_size=global_batch // world, shuffle=True)
    if strategy is None:
        strategy = GalvatronStrategy(plan=plan if plan is not None else "auto", **(strategy_kwargs or {}))
    trainer, recorder = _trainer(strategy, world, precision, **trainer_kwargs)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if save_path is not None:
        trainer.save_checkpoint(save_path)
    result = RunResult(losses=_mean_over_ranks(recorder.losses), grads=_merge_over_ranks(recorder.grads))
    result.param_dtypes = {p.dtype for p in trainer.lightning_module.parameters()}
    result.state = gather_full_state(trainer.lightning_module)
    if validate:
        result.val_loss = _validation_loss(trainer, module, global_batch // world)
    return result


def _validation_loss(trainer: L.Trainer, module: GPTModule, batch_size: int) -> float:
    metrics = trainer.validate(module, DataLoader(ArithmeticText(16, SEQ, seed=1), batch_size=batch_size), verbose=False)
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


def assert_close_runs(
    actual: RunResult,
    expected: RunResult,
    loss_tol: float,
    param_tol: float,
    grad_rtol: float,
    param_mean_tol: float | None = None,
) -> None:
    """Same losses and parameters; same first-step gradients relative to their size.

    The gradient check matters because Adam's update is invariant to the scale of the gradient:
    a run that sums where it should average would still match in parameters after a few steps.
    A gradient's error is measured against its RMS, floored at 1% of the RMS over all gradients
    (some gradients are zero up to rounding, e.g. a key bias under softmax).
    ``param_mean_tol`` bounds the mean error per tensor where single elements may legitimately
    differ more (bf16: Adam turns a near-zero gradient of flipped sign into a full-size step).
    """
    assert len(actual.losses) == len(expected.losses), (actual.losses, expected.losses)
    torch.testing.assert_close(torch.tensor(actual.losses), torch.tensor(expected.losses), atol=loss_tol, rtol=0)
    assert actual.state is not None and expected.state is not None
    assert actual.state.keys() == expected.state.keys()
    for name, value in expected.state.items():
        torch.testing.assert_close(actual.state[name], value.float(), atol=param_tol, rtol=0, msg=lambda m: f"{name}: {m}")
        if param_mean_tol is not None:
            mean_error = float((actual.state[name] - value.float()).abs().mean())
            assert mean_error <= param_mean_tol, f"{name}: mean error {mean_error:.3g} > {param_mean_tol}"
    assert actual.grads is not None and expected.grads is not None
    # A pipeline's last stage names a tied weight after the head; one process names it once.
    assert expected.grads.keys() <= actual.grads.keys(), expected.grads.keys() - actual.grads.keys()
    all_grads = torch.cat([g.flatten() for g in expected.grads.values()])
    floor = 0.01 * float(all_grads.norm()) / all_grads.numel() ** 0.5
    for name, value in expected.grads.items():
        scale = max(float(value.norm()) / value.numel() ** 0.5, floor)
        error = float((actual.grads[name] - value).abs().max())
        assert error <= grad_rtol * scale, f"gradient of {name}: max error {error:.3g} > {grad_rtol} x RMS {scale:.3g}"
