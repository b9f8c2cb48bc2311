"""Model profiler: per block type, forward/backward time against batch size and activation bytes per degree.

:func:`profile_model` measures what :class:`~lightning_galvatron.profiles.ModelProfile` holds, on
the real (not yet parallelised) LightningModule, without changing it:

1. **Capture.** The training step runs once (no gradients) with forward hooks on the blocks; the
   first block of each distinct type (class and parameter shapes) records its inputs (hidden
   states and any extra arguments) and its output. Later blocks of a type are skipped (they
   return their input in the output's structure), so capturing costs one block per type.
2. **Embedding and head.** The step runs with every block skipped, at each profiled batch size
   (the example batch sliced or tiled): hooks on the first and last block split the forward into
   "everything before the blocks" and "everything after them, including the loss", and gradient
   hooks on the hidden states split the backward the same way. Saved-tensor hooks count the
   activations of each part (the logits included) and see which parameters each part uses (tied
   weights are used by both). Their bytes are the same at every vocabulary-parallel degree: the
   runtime gathers the logits for the user's loss.
3. **Blocks.** A deep copy of the first block of each type runs forward and backward on random
   hidden states of the captured shape at each batch size, plain and with recomputation
   (``torch.distributed._composable.checkpoint``), and forward time is fitted with
   :meth:`LinearFit.fit`. Activation bytes per sample are counted at two batch sizes (the slope:
   batch-independent tensors such as masks are not per-sample).
4. **Degrees.** With a live process group, the block is split for real on a group of ``g`` ranks
   by the runtime's own code -- Megatron TP with and without sequence parallelism
   (:func:`~lightning_galvatron.runtime.tensor_parallel.apply_tensor_parallel`) and Ulysses
   (:func:`~lightning_galvatron.runtime.ulysses.apply_ulysses`) -- and its saved bytes counted on
   each rank. Degrees beyond the process group are left to the ``a + c/g`` fit of
   :class:`~lightning_galvatron.profiles.DegreeTable`; without any group they are derived from the
   degree-1 count split by module: inputs of column-parallel layers stay whole under DTensor's
   sequence parallelism (they are gathered), norms stay whole without it.

Activation bytes are *counted*, not estimated: every tensor autograd saves passes through
``torch.autograd.graph.saved_tensors_hooks``; distinct storages are summed once (views and tensors
saved by several ops count once), parameters, buffers and the batch itself are excluded. On CUDA
the count is cross-checked against the allocator (logged, never fatal).

5. **Overheads** (:func:`measure_model` for :func:`~lightning_galvatron.profiler.profile`, with a live
   process group): forward and backward of one call of each block type under each kind of strategy, the
   optimizer step, steps of real pipeline schedules over copies of the first block, and copies of it without and
   with DDP's gradient reduction, as the strategies and schedules add to the compute and communication above
   (:class:`~lightning_galvatron.profiles.Overheads`).

One file per phase: :mod:`.capture` (1), :mod:`.vocabulary` (2), :mod:`.blocks` (3), :mod:`.degrees`
(4), :mod:`.overheads` (5), :mod:`.saved` (the counter) and :mod:`.setup` (block types, precision,
restoring the module).

Nothing of the user's module changes: the random state, training mode, gradients and parameter
storage (moved or cast for profiling) are restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.plan import divisors
from lightning_galvatron.profiler.model.blocks import _BlockProfiler
from lightning_galvatron.profiler.model.capture import _capture
from lightning_galvatron.profiler.model.overheads import measure_overheads
from lightning_galvatron.profiler.model.saved import SavedTensorCounter
from lightning_galvatron.profiler.model.setup import (
    Step,
    _block_types,
    _module_device,
    _no_op,
    _PrecisionConfig,
    _profiling,
    block_signature,
)
from lightning_galvatron.profiler.model.vocabulary import _profile_vocab
from lightning_galvatron.profiles import ModelProfile, OptimizerProbe, Overheads


def profile_model(
    module: nn.Module,
    structure: ModelStructure,
    example_batch: Any,
    *,
    step: Step | None = None,
    precision: str = "32-true",
    batch_sizes: Sequence[int] = (1, 4),
    degrees: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    name: str | None = None,
) -> ModelProfile:
    """Profile ``module``'s blocks and embedding/head; collective if a process group is live.

    Args:
        module: the LightningModule (or any module) as the user built it, weights materialised.
        structure: its blocks (:func:`~lightning_galvatron.model.discovery.find_blocks`).
        example_batch: one batch of the training DataLoader (any nesting of tensors; the first
            dimension of its tensors is the batch).
        step: ``step(module, batch) -> loss``; default ``module.training_step(batch, 0)`` with
            ``self.log``/``self.log_dict`` silenced (no Lightning loop runs).
        precision: Lightning precision flag: ``32-true``, ``bf16-mixed`` (autocast) or ``bf16-true``
            (weights cast for profiling, restored afterwards).
        batch_sizes: local batch sizes to time (at least two distinct ones for a fit; keep them
            apart enough that timing noise cannot invert them).
        degrees: tensor/sequence-parallel degrees to measure activations for; default: every
            divisor of the world size (just 1 without a process group).
        device: where to profile (default: the module's device); parameters moved for profiling
            are moved back.
        name: model label (default: the module's class name).
    """
    return measure_model(
        module,
        structure,
        example_batch,
        step=step,
        precision=precision,
        batch_sizes=batch_sizes,
        degrees=degrees,
        device=device,
        name=name,
    )[0]


def measure_model(
    module: nn.Module,
    structure: ModelStructure,
    example_batch: Any,
    *,
    step: Step | None = None,
    precision: str = "32-true",
    batch_sizes: Sequence[int] = (1, 4),
    degrees: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    name: str | None = None,
    overheads: bool = False,
    optimizer_probes: Sequence[OptimizerProbe] | None = None,
    pipelines: bool = True,
) -> tuple[ModelProfile, Overheads | None]:
    """:func:`profile_model`, and with ``overheads`` (needs a live process group) the per-call overheads
    of its blocks, of the optimizer (unless ``optimizer_probes`` of this cluster are given: they do not depend on
    the model), of pipeline schedules (unless ``pipelines`` is false) and of DDP's gradient reduction (phase 5)."""
    if any(p.is_meta for p in module.parameters()):
        raise ValueError("the model has parameters on the meta device: profile it after its weights are materialised")
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    precision_cfg = _PrecisionConfig.of(precision)
    device = torch.device(device) if device is not None else _module_device(module)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    degrees = sorted({1, *(degrees or divisors(world))})
    step = step or default_step
    blocks = structure.blocks
    types = _block_types(blocks)

    # Profiling draws random numbers (inputs, dropout): the training run must see the same stream as without it.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with _profiling(module, blocks, types, device, precision_cfg):
            captured = _capture(module, blocks, types, example_batch, step, precision_cfg, device)
            vocab = _profile_vocab(
                module, structure, types, captured, example_batch, step, precision_cfg, device, sizes, degrees
            )
        layer_types, profilers = [], []
        for t in types:
            profiler = _BlockProfiler(blocks[t.first], captured.inputs[t.first], precision_cfg, device, t.name)
            layer_types.append(profiler.profile(sizes, degrees, world))
            profilers.append(profiler)
        measured = None
        if overheads and dist.is_available() and dist.is_initialized():
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            vocab_tensors = sum(1 for p in module.parameters() if id(p) not in in_blocks)
            measured = measure_overheads(
                profilers,
                layer_types,
                degrees,
                vocab_tensors,
                device,
                [len(t.members) for t in types],
                optimizer_probes=optimizer_probes,
                pipelines=pipelines,
            )
    first = layer_types[0]
    block_index = {i: k for k, t in enumerate(types) for i in t.members}
    model = ModelProfile(
        name=name or type(module).__name__,
        layer_types=tuple(layer_types),
        blocks=tuple(block_index[i] for i in range(len(blocks))),
        vocab=vocab,
        hidden_size=first.hidden_size,
        seq_length=first.seq_length,
        activation_dtype_bytes=precision_cfg.compute_bytes,
        block_lists=len(structure.block_lists),
        precision=precision_cfg.flag,
    )
    return model, measured


def default_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """The default step: ``training_step(batch, 0)`` with logging silenced; returns the loss."""
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            f"{type(module).__name__} uses manual optimisation: its training_step runs backward and steps the "
            "optimizer itself, which profiling must not do; pass step=manual_optimization_step(<number of "
            "optimizers>) or step=lambda module, batch: <the loss>"
        )
    silenced = {name: _no_op for name in ("log", "log_dict") if hasattr(module, name)}
    with _replaced_methods(module, silenced):
        out = module.training_step(batch, 0)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"{type(module).__name__}.training_step returned {type(out).__name__}, not a loss tensor (or a dict with "
            "'loss'); pass step=lambda module, batch: <the loss> to the profiler"
        )
    return loss


class _StandInOptimizer:
    """What ``self.optimizers()`` gives a profiled manual-optimization step: its steps change nothing (a closure
    still runs: it holds the forward pass)."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to zero: profiling computes no gradients for the optimizer."""

    def step(self, closure: Any = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None


def manual_optimization_step(optimizers: int = 1) -> Step:
    """The step of a module with manual optimization (``automatic_optimization = False``): its ``training_step``,
    logging silenced, with ``self.optimizers()`` giving ``optimizers`` stand-ins that do not step and
    ``self.manual_backward`` recording the loss instead of running backward. Returns the sum of the recorded losses
    (what the step's backward passes differentiate)."""

    def step(module: nn.Module, batch: Any) -> torch.Tensor:
        stand_ins = [_StandInOptimizer() for _ in range(optimizers)]
        losses: list[torch.Tensor] = []
        replacements: dict[str, Any] = {name: _no_op for name in ("log", "log_dict") if hasattr(module, name)}
        replacements["optimizers"] = lambda use_pl_optimizer=True: stand_ins[0] if optimizers == 1 else stand_ins
        replacements["manual_backward"] = lambda loss, *args, **kwargs: losses.append(loss)
        with _replaced_methods(module, replacements):
            module.training_step(batch, 0)
        if not losses:
            raise ValueError(
                f"{type(module).__name__}.training_step (manual optimization) called self.manual_backward with no "
                "loss; pass step=lambda module, batch: <the loss> to the profiler"
            )
        return torch.stack([loss.float() for loss in losses]).sum()

    return step


def forward_step(loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> Step:
    """The step of a plain module that a hand-written loop (Lightning Fabric) trains: ``module(batch)`` -- or
    ``module(*batch)`` for a tuple, ``module(**batch)`` for a dict -- then ``loss_fn(output, batch)``. Without
    ``loss_fn``: the output's ``loss`` if it has one, else the log-sum-exp of its logits (or of the output tensor),
    which keeps what a cross-entropy over the logits keeps for backward."""

    def step(module: nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            output = module(**batch)
        elif isinstance(batch, (tuple, list)):
            output = module(*batch)
        else:
            output = module(batch)
        if loss_fn is not None:
            return loss_fn(output, batch)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss
        logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", output)
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        if not isinstance(logits, torch.Tensor):
            raise ValueError(
                f"{type(module).__name__} returned {type(output).__name__}, which holds no loss or logits tensor; "
                "pass loss_fn=lambda output, batch: <the loss> to say what the loop trains"
            )
        return logits.float().logsumexp(-1).mean()

    return step


@contextlib.contextmanager
def _replaced_methods(module: nn.Module, replacements: Mapping[str, Any]) -> Iterator[None]:
    """``module``'s methods replaced on the instance while the step runs; its own attributes restored after."""
    own = {name: vars(module)[name] for name in replacements if name in vars(module)}
    try:
        for name, replacement in replacements.items():
            setattr(module, name, replacement)
        yield
    finally:
        for name in replacements:
            if name in own:
                setattr(module, name, own[name])
            else:
                delattr(module, name)


__all__ = [
    "SavedTensorCounter",
    "block_signature",
    "default_step",
    "forward_step",
    "manual_optimization_step",
    "measure_model",
    "profile_model",
]
