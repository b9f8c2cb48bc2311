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

Nothing of the user's module changes: the random state, training mode, gradients and parameter
storage (moved or cast for profiling) are restored afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_galvatron.model.call_state import without_kv_caches
from lightning_galvatron.model.discovery import ModelStructure, model_class
from lightning_galvatron.model.tensor_parallel_plans import (
    BlockTensorParallelPlan,
    _attention_heads,
    tensor_parallel_plan,
)
from lightning_galvatron.plan import divisors
from lightning_galvatron.profiles import DegreeTable, LayerTypeProfile, LinearFit, ModelProfile, VocabProfile
from lightning_galvatron.runtime.mesh import local_tensor
from lightning_galvatron.search.cost import resolve_precision

log = logging.getLogger(__name__)

Step = Callable[[nn.Module, Any], torch.Tensor]

#: Timed repetitions per point at least / at most; the median is kept.
MIN_REPEATS, MAX_REPEATS = 3, 20
#: Aim for this much timed work per point (seconds): tiny blocks get more repetitions.
TARGET_POINT_S = 0.05


# ---------------------------------------------------------------------------------------------- API
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
            vocab = _profile_vocab(module, structure, types, captured, example_batch, step, precision_cfg, device, sizes, degrees)
        layer_types = []
        for t in types:
            profiler = _BlockProfiler(blocks[t.first], captured.inputs[t.first], precision_cfg, device, t.name)
            layer_types.append(profiler.profile(sizes, degrees, world))
    first = layer_types[0]
    block_index = {i: k for k, t in enumerate(types) for i in t.members}
    return ModelProfile(
        name=name or type(module).__name__,
        layer_types=tuple(layer_types),
        blocks=tuple(block_index[i] for i in range(len(blocks))),
        vocab=vocab,
        hidden_size=first.hidden_size,
        seq_length=first.seq_length,
        activation_dtype_bytes=precision_cfg.compute_bytes,
        block_lists=len(structure.block_lists),
    )


def default_step(module: nn.Module, batch: Any) -> torch.Tensor:
    """The default step: ``training_step(batch, 0)`` with logging silenced; returns the loss."""
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            f"{type(module).__name__} uses manual optimisation: its training_step runs backward and steps the "
            "optimizer itself, which profiling must not do; pass step=lambda module, batch: <the loss>"
        )
    silenced = [name for name in ("log", "log_dict") if hasattr(module, name)]
    own = {name: vars(module)[name] for name in silenced if name in vars(module)}
    try:
        for name in silenced:
            setattr(module, name, _no_op)
        out = module.training_step(batch, 0)
    finally:
        for name in silenced:
            if name in own:
                setattr(module, name, own[name])
            else:
                delattr(module, name)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"{type(module).__name__}.training_step returned {type(out).__name__}, not a loss tensor (or a dict with "
            "'loss'); pass step=lambda module, batch: <the loss> to the profiler"
        )
    return loss


def block_signature(block: nn.Module) -> tuple:
    """What makes two blocks the same type for profiling: class and parameter names, shapes, dtypes."""
    cls = model_class(block)
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters())
    return (f"{cls.__module__}.{cls.__qualname__}", params)


# ---------------------------------------------------------------------------------------------- setup
@dataclass(frozen=True)
class _PrecisionConfig:
    flag: str
    autocast_dtype: torch.dtype | None  # bf16-mixed: compute under autocast
    cast_dtype: torch.dtype | None  # bf16-true and bf16-mixed: the weights the blocks compute with are bf16
    compute_bytes: int

    @classmethod
    def of(cls, precision: str) -> _PrecisionConfig:
        flag = resolve_precision(precision).name
        if flag == "32-true":
            return cls(flag, None, None, 4)
        if flag == "bf16-mixed":
            # As the runtime trains it: FSDP2 gathers bf16 weights (MixedPrecisionPolicy) and autocast runs on top.
            return cls(flag, torch.bfloat16, torch.bfloat16, 2)
        if flag == "bf16-true":
            return cls(flag, None, torch.bfloat16, 2)
        raise ValueError(f"the profiler supports precision 32-true, bf16-mixed and bf16-true, got {precision!r}")

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def place(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        dtype = self.cast_dtype if self.cast_dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=device, dtype=dtype)


@dataclass
class _BlockType:
    name: str
    first: int
    members: list[int] = field(default_factory=list)


def _block_types(blocks: Sequence[nn.Module]) -> list[_BlockType]:
    by_signature: dict[tuple, _BlockType] = {}
    for i, block in enumerate(blocks):
        signature = block_signature(block)
        if signature not in by_signature:
            by_signature[signature] = _BlockType(model_class(block).__name__, i)
        by_signature[signature].members.append(i)
    types = list(by_signature.values())
    names = [t.name for t in types]
    for k, t in enumerate(types):  # same class with other shapes: number them
        if names.count(t.name) > 1:
            t.name = f"{t.name}#{names[:k].count(t.name)}"
    return types


@contextlib.contextmanager
def _profiling(
    module: nn.Module, blocks: Sequence[nn.Module], types: Sequence[_BlockType], device: torch.device, prec: _PrecisionConfig
) -> Iterator[None]:
    """Run the module for profiling and leave no trace: modes, gradients and parameter storage restored.

    The parameters that run (everything outside the blocks, and the first block of each type) are
    placed on ``device`` in the profiled dtype by swapping their ``.data``; the originals come back.
    """
    running = set(range(len(blocks))) - {i for t in types for i in t.members if i != t.first}
    skipped = {id(p) for i, b in enumerate(blocks) if i not in running for p in (*b.parameters(), *b.buffers())}
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers()) if id(t) not in skipped}
    originals = {key: t.data for key, t in tensors.items()}
    grads = {p: p.grad for p in module.parameters()}
    modes = {m: m.training for m in module.modules()}
    try:
        for key, t in tensors.items():
            t.data = prec.place(originals[key], device)
        module.train()
        yield
    finally:
        for key, t in tensors.items():
            t.data = originals[key]
        for p, g in grads.items():
            p.grad = g
        for m, mode in modes.items():
            m.training = mode


# ---------------------------------------------------------------------------------------------- capture
@dataclass
class _BlockCall:
    """One block call: its inputs and (as a template for skipping) its output."""

    args: tuple
    kwargs: dict
    output: Any = None

    @property
    def hidden(self) -> torch.Tensor:
        return _hidden_states(self.args, self.kwargs)


@dataclass
class _Captured:
    inputs: dict[int, _BlockCall]  # per first block of a type


def _hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    """The residual stream: the first tensor argument, else ``hidden_states=`` (as the runtime's relocation does)."""
    hidden = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("hidden_states"))
    if not isinstance(hidden, torch.Tensor):
        raise ValueError("a block was called without a hidden-states tensor (first tensor argument or hidden_states=)")
    return hidden


def _with_hidden(template: Any, hidden: torch.Tensor) -> Any:
    """``template`` (a block's output) with its first tensor replaced by ``hidden``."""
    leaves, spec = tree_flatten(template)
    index = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    leaves[index] = hidden
    return tree_unflatten(leaves, spec)


def _skippable(call: _BlockCall) -> bool:
    """A block can be stood in for by the identity if it keeps the shape of the hidden states."""
    leaves, _ = tree_flatten(call.output)
    out = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    return out is not None and out.shape == call.hidden.shape and out.dtype == call.hidden.dtype


def _capture(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    types: Sequence[_BlockType],
    batch: Any,
    step: Step,
    prec: _PrecisionConfig,
    device: torch.device,
) -> _Captured:
    """Run the step once without gradients; record the inputs and output of the first block of each type."""
    firsts = {t.first for t in types}
    calls: dict[int, _BlockCall] = {}
    handles = []
    for i in firsts:

        def pre(mod: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            calls.setdefault(i, _BlockCall(*without_kv_caches(_detach(args), _detach(kwargs))))  # re-run later

        def post(mod: nn.Module, args: tuple, kwargs: dict, output: Any, i: int = i) -> None:
            if calls[i].output is None:
                calls[i].output = _detach(output)

        handles.append(blocks[i].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(blocks[i].register_forward_hook(post, with_kwargs=True))
    later = {i for t in types for i in t.members if i != t.first}
    try:
        with torch.no_grad(), prec.autocast(device), _skipping(blocks, calls, types, later):
            step(module, _to_device(batch, device, prec))
    finally:
        for h in handles:
            h.remove()
    missing = sorted(firsts - set(calls))
    if missing:
        raise ValueError(f"the training step never called block(s) {missing}; are the blocks those the model runs?")
    return _Captured(calls)


@contextlib.contextmanager
def _skipping(blocks: Sequence[nn.Module], calls: Mapping[int, _BlockCall], types: Sequence[_BlockType], which: set[int]) -> Iterator[None]:
    """Blocks in ``which`` return their input in the structure of their type's output instead of running.

    The output template is looked up at call time (while capturing, the first block of a type has
    run by then); a block without one, or one that changes the shape of the hidden states, runs.
    """
    type_of = {i: t for t in types for i in t.members}

    def stand_in(i: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = calls.get(type_of[i].first)
            if call is None or call.output is None or not _skippable(call):
                return type(blocks[i]).forward(blocks[i], *args, **kwargs)
            return _with_hidden(call.output, _hidden_states(args, kwargs))

        return forward

    for i in which:
        blocks[i].forward = stand_in(i)
    try:
        yield
    finally:
        for i in which:
            del blocks[i].forward


# ---------------------------------------------------------------------------------------------- saved tensors
class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, per phase, each storage once.

    Use as ``with counter: <forward>``. Storages in ``exclude`` (parameters, buffers, the batch)
    are not counted; when one of them is saved, its phase is noted in ``used`` (which part of the
    model uses which parameters). DTensors are counted by their local shard.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self.excluded = {_storage_key(t) for t in exclude}
        self.seen: set[tuple] = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.used: dict[str, set[tuple]] = defaultdict(set)
        self.phase = "forward"
        # CUDA, for comparison: memory the forward left allocated, and its peak above the start.
        self.allocator_bytes: int | None = None
        self.allocator_peak_bytes: int | None = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key in self.excluded:
            self.used[self.phase].add(key)
        elif key not in self.seen:
            self.seen.add(key)
            self.bytes[self.phase] += _storage_bytes(tensor)
        return tensor

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> Any:
    """The storage's identity (not its data pointer: fake tensors have none, so a dry run can count them too)."""
    local = local_tensor(tensor)
    try:
        return StorageWeakRef(local.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: count it by identity
        return ("object", id(local))


def _storage_bytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    try:
        return local.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return local.numel() * local.element_size()


def _per_sample(points: Sequence[tuple[int, float]]) -> float:
    """Bytes per sample from counts at two or more batch sizes: the slope (a batch-independent part drops out)."""
    if len(points) == 1:
        (b, v), = points
        return v / b
    (b0, v0), (b1, v1) = points[0], points[-1]
    return max((v1 - v0) / (b1 - b0), 0.0)


# ---------------------------------------------------------------------------------------------- embedding/head
def _profile_vocab(
    module: nn.Module,
    structure: ModelStructure,
    types: Sequence[_BlockType],
    captured: _Captured,
    batch: Any,
    step: Step,
    prec: _PrecisionConfig,
    device: torch.device,
    sizes: Sequence[int],
    degrees: Sequence[int],
) -> VocabProfile:
    """Time and count everything outside the blocks, with every block stood in for by the identity."""
    blocks = structure.blocks
    params = {id(p): p for p in module.parameters()}
    fixed = [*params.values(), *module.buffers()]
    times: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[tuple[int, float]]] = defaultdict(list)
    used: dict[str, set[tuple]] = defaultdict(set)
    repeats = MIN_REPEATS
    with _skipping(blocks, captured.inputs, types, set(range(len(blocks)))):
        for b in sizes:
            local_batch = _to_device(_resize_batch(batch, b), device, prec)
            counter = SavedTensorCounter([*fixed, *tree_flatten(local_batch)[0]])
            with counter:  # the counting run doubles as the warm-up
                _PhaseTimer(blocks, device, counter).run(module, local_batch, step, prec)
            for phase in ("embedding", "head"):
                counts[phase].append((b, float(counter.bytes[phase])))
                used[phase] |= counter.used[phase]
            trial = [_PhaseTimer(blocks, device).run(module, local_batch, step, prec) for _ in range(repeats)]
            for key in trial[0]:
                times[key].append(statistics.median(t[key] for t in trial))
            _zero_grads(params.values())

    # Which part uses which parameter: those its ops saved (a linear head saves its weight), else,
    # for parameters no op saved (an embedding saves only the indices), where they are registered;
    # a head tied to the token embedding uses the embedding's table.
    key_of = {_storage_key(p): id(p) for p in params.values()}
    saved_by = {phase: {key_of[k] for k in used[phase] if k in key_of} for phase in ("embedding", "head")}
    unseen = set(params) - saved_by["embedding"] - saved_by["head"]
    vocab_size, vocab_parallel, tied_table = _vocabulary(structure)
    in_embedding = saved_by["embedding"] | (_modules_params(module, blocks, "before") & unseen)
    in_head = saved_by["head"] | (_modules_params(module, blocks, "after") & unseen)
    if tied_table is not None:
        in_embedding.add(id(tied_table))
        in_head.add(id(tied_table))
    block_params = structure.block_parameter_ids()
    outside = {pid for pid in params if pid not in block_params}
    tied = bool(in_embedding & in_head & outside)
    # With tied weights the format has no room for the head's own parameters (a final norm, say):
    # they go with the embedding, so the model's total is exact.
    head_only = set() if tied else (in_head - in_embedding) & outside
    embedding_parameters = sum(params[pid].numel() for pid in outside - head_only)
    head_parameters = sum(params[pid].numel() for pid in head_only)
    fw = sum(times["embedding_forward"]) + sum(times["head_forward"])
    bw = sum(times["embedding_backward"]) + sum(times["head_backward"])
    # The runtime gathers the logits for the user's loss, so a vocabulary-parallel group does not
    # split what the head keeps: the same bytes at every degree.
    constant = lambda v: DegreeTable(tuple((g, v) for g in degrees))  # noqa: E731
    return VocabProfile(
        vocab_size=vocab_size,
        embedding_parameters=embedding_parameters,
        head_parameters=head_parameters,
        embedding_forward_time=LinearFit.fit(sizes, times["embedding_forward"]),
        head_forward_time=LinearFit.fit(sizes, times["head_forward"]),
        embedding_activation_bytes_per_sample=constant(_per_sample(counts["embedding"])),
        head_activation_bytes_per_sample=constant(_per_sample(counts["head"])),
        tied=tied,
        backward_to_forward=bw / fw if fw > 0 else 2.0,
        supports_tensor_parallel=vocab_parallel,
        supports_sequence_split=False,  # the runtime runs the embedding and head on whole sequences
    )


class _PhaseTimer:
    """One step (forward + backward) split into embedding and head time by hooks on the first and last block.

    Forward: start -> first block's input (embedding) ... last block's output -> loss (head).
    Backward: loss -> gradient of the last block's output (head) ... gradient of the first
    block's input -> end (embedding). With a counter, saved tensors are attributed to the phases.
    """

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, counter: SavedTensorCounter | None = None) -> None:
        self.blocks, self.device, self.counter = blocks, device, counter
        self.marks: dict[str, float] = {}

    def _mark(self, name: str) -> None:
        _synchronize(self.device)
        self.marks.setdefault(name, time.perf_counter())

    def _phase(self, name: str) -> None:
        if self.counter is not None:
            self.counter.phase = name

    def run(self, module: nn.Module, batch: Any, step: Step, prec: _PrecisionConfig) -> dict[str, float]:
        def first_in(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if "blocks_start" in self.marks:
                return
            self._mark("blocks_start")
            self._phase("blocks")
            hidden = _hidden_states(args, kwargs)
            if hidden.requires_grad:
                hidden.register_hook(lambda g: self._mark("embedding_backward_start"))

        def last_out(mod: nn.Module, args: tuple, output: Any) -> None:
            self._mark("blocks_end")
            self._phase("head")
            hidden = _with_hidden_leaf(output)
            if hidden.requires_grad:
                hidden.register_hook(lambda g: self._mark("head_backward_end"))

        handles = [
            self.blocks[0].register_forward_pre_hook(first_in, with_kwargs=True),
            self.blocks[-1].register_forward_hook(last_out),
        ]
        self._phase("embedding")
        try:
            self._mark("start")
            with prec.autocast(self.device):
                loss = step(module, batch)
            self._mark("loss")
            self._phase("backward")
            self._mark("backward_start")
            loss.backward()
            self._mark("end")
        finally:
            for h in handles:
                h.remove()
        m = self.marks
        return {
            "embedding_forward": m["blocks_start"] - m["start"],
            "head_forward": m["loss"] - m["blocks_end"],
            "head_backward": m.get("head_backward_end", m["end"]) - m["backward_start"],
            "embedding_backward": m["end"] - m.get("embedding_backward_start", m["end"]),
        }


def _with_hidden_leaf(output: Any) -> torch.Tensor:
    leaves, _ = tree_flatten(output)
    return next(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


def _modules_params(module: nn.Module, blocks: Sequence[nn.Module], where: str) -> set[int]:
    """Parameters of the modules registered before (``"before"``) or after the blocks: a fallback for
    parameters no saved tensor revealed (e.g. an embedding table, which saves only the indices)."""
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    first_block = next(i for i, m in enumerate(module.modules()) if m is blocks[0])
    last_block = next(i for i, m in enumerate(module.modules()) if m is blocks[-1])
    out = set()
    for i, m in enumerate(module.modules()):
        if id(m) in in_blocks or not any(True for _ in m.parameters(recurse=False)):
            continue
        if (where == "before" and i < first_block) or (where == "after" and i > last_block):
            out |= {id(p) for p in m.parameters(recurse=False)}
    return out


def _vocabulary(structure: ModelStructure) -> tuple[int, bool, nn.Parameter | None]:
    """(vocabulary size, whether the runtime can split it, the table a tied head shares with the embedding)."""
    from lightning_galvatron.plan import PlanError
    from lightning_galvatron.runtime.vocab_parallel import find_vocabulary_layers

    try:
        layers = find_vocabulary_layers(structure)
    except PlanError:
        layers = None
    if layers is None or layers.embedding is None:
        return 1, False, None  # no token table: nothing to split by vocabulary
    return layers.embedding.num_embeddings, True, layers.embedding.weight if layers.tied else None


def _zero_grads(params: Any) -> None:
    for p in params:
        p.grad = None


# ---------------------------------------------------------------------------------------------- blocks
class _BlockProfiler:
    """Times and counts one block type on deep copies of its first block."""

    def __init__(self, block: nn.Module, call: _BlockCall, prec: _PrecisionConfig, device: torch.device, name: str) -> None:
        self.block = block
        self.call = call
        self.prec = prec
        self.device = device
        self.name = name
        self.hidden = call.hidden
        self.tp_plan: BlockTensorParallelPlan | None = tensor_parallel_plan(block)

    # ------------------------------------------------------------------ inputs
    def copy(self) -> nn.Module:
        clone = copy.deepcopy(self.block)
        for t in (*clone.parameters(), *clone.buffers()):
            t.data = self.prec.place(t.data, self.device)
        return clone.train()

    def inputs(self, batch: int, seq_split: int = 1) -> tuple[tuple, dict]:
        """Random hidden states of ``batch`` samples (sequence split ``seq_split`` ways) and the other
        captured arguments resized to the batch."""
        shape = list(self.hidden.shape)
        captured_batch = shape[0]
        shape[0] = batch
        if seq_split > 1:
            shape[1] //= seq_split
        hidden = torch.randn(shape, dtype=self.hidden.dtype, device=self.device, requires_grad=True)

        def resize(value: Any) -> Any:
            if value is self.hidden:
                return hidden
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == captured_batch:
                return _resize_tensor(value, batch)
            return value

        args = tuple(resize(a) for a in self.call.args)
        kwargs = {k: resize(v) for k, v in self.call.kwargs.items()}
        return args, kwargs

    # ------------------------------------------------------------------ measurements
    def time_forward_backward(self, block: nn.Module, batch: int) -> tuple[float, float]:
        """Median (forward, backward) seconds of ``block`` on ``batch`` samples."""

        def once() -> tuple[float, float]:
            args, kwargs = self.inputs(batch)
            _synchronize(self.device)
            start = time.perf_counter()
            with self.prec.autocast(self.device):
                out = block(*args, **kwargs)
            _synchronize(self.device)
            middle = time.perf_counter()
            _backward(out)
            _synchronize(self.device)
            return middle - start, time.perf_counter() - middle

        warm = once()
        repeats = int(min(max(TARGET_POINT_S / max(sum(warm), 1e-9), MIN_REPEATS), MAX_REPEATS))
        samples = [once() for _ in range(repeats)]
        for p in block.parameters():
            p.grad = None
        return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)

    def saved_bytes(
        self, block: nn.Module, batch: int, seq_split: int = 1, attribute: bool = False, keep_input: bool = False
    ) -> SavedTensorCounter:
        """Bytes autograd saves in one forward of ``block`` (optionally attributed to its submodules).

        ``keep_input`` adds the hidden states if no op saved them: a recomputed block holds its
        input for the replay outside autograd's saved tensors (the checkpoint keeps the arguments).
        """
        args, kwargs = self.inputs(batch, seq_split)
        exclude = [*block.parameters(), *block.buffers()]
        exclude += [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v is not _hidden_states(args, kwargs)]
        counter = SavedTensorCounter(exclude)
        handles = _attribute_to_submodules(block, counter, self.attribution_names()) if attribute else []
        hidden = _hidden_states(args, kwargs)
        before = _allocated(self.device, reset_peak=True)
        try:
            with counter, self.prec.autocast(self.device):
                out = block(*args, **kwargs)
            if self.device.type == "cuda":
                # What stays allocated besides the output, plus the input if an op saved it (it was allocated before).
                counted_input = _storage_bytes(hidden) if _storage_key(hidden) in counter.seen else 0
                counter.allocator_bytes = _allocated(self.device) - before - _output_bytes(out) + counted_input
                counter.allocator_peak_bytes = torch.cuda.max_memory_allocated(self.device) - before
            if keep_input:
                counter.phase = "input"
                counter._pack(hidden)
        finally:
            for h in handles:
                h.remove()
        del out
        return counter

    def attribution_names(self) -> dict[str, str]:
        """Submodule name -> role for the derived per-degree model: ``column`` (the column-parallel
        projections, whose input stays whole: gathered under SP, replicated without) and ``norm``
        (the block's own norms, which only SP splits; named like the TP plans name them)."""
        if self.tp_plan is None:
            return {}
        from torch.distributed.tensor.parallel import ColwiseParallel

        from lightning_galvatron.runtime.tensor_parallel import ColwiseConv1D

        roles = {
            name: "column"
            for name, style in self.tp_plan.styles(False).items()
            if isinstance(style, (ColwiseParallel, ColwiseConv1D))
        }
        for name, child in self.block.named_children():
            if "norm" in type(child).__name__.lower() or name.startswith("ln"):
                roles[name] = "norm"
        return roles

    def attention_calls(self, block: nn.Module) -> int:
        """How many times the block calls ``F.scaled_dot_product_attention`` (Ulysses wraps each)."""
        counter = _AttentionCounter()
        args, kwargs = self.inputs(1)
        with torch.no_grad(), counter, self.prec.autocast(self.device):
            block(*args, **kwargs)
        return counter.calls

    # ------------------------------------------------------------------ the profile
    def profile(self, sizes: Sequence[int], degrees: Sequence[int], world: int) -> LayerTypeProfile:
        from torch.distributed._composable import checkpoint

        block, recompute = self.copy(), self.copy()
        checkpoint(recompute)
        forward, backward, recompute_backward = [], [], []
        for b in sizes:
            f, bw = self.time_forward_backward(block, b)
            _, rbw = self.time_forward_backward(recompute, b)
            forward.append(f)
            backward.append(bw)
            recompute_backward.append(rbw)
        count_sizes = sizes[:2] if len(sizes) > 1 else sizes
        plain = [(b, self.saved_bytes(block, b, attribute=True)) for b in count_sizes]
        per_sample = _per_sample([(b, float(c.total)) for b, c in plain])
        roles = {role: _per_sample([(b, float(c.bytes[role])) for b, c in plain]) for role in ("column", "norm")}
        kept = [(b, float(self.saved_bytes(recompute, b, keep_input=True).total)) for b in count_sizes]
        self._cross_check(plain)

        attention_calls = self.attention_calls(block)
        plan = self.tp_plan
        styles = _Styles(
            tensor_parallel=plan is not None,
            megatron_sp=plan is not None and plan.megatron_sp,
            ulysses=plan is not None and plan.ulysses and attention_calls > 0,
        )
        split, replicated = self.per_degree(per_sample, roles, degrees, world, count_sizes, styles)
        log.info(
            "%s: forward %s s at batch %s; backward/forward %.2f; recompute adds %.2f forwards; %.0f activation bytes/sample",
            self.name, [f"{t:.2e}" for t in forward], list(sizes), sum(backward) / sum(forward),
            (sum(recompute_backward) - sum(backward)) / sum(forward), per_sample,
        )
        heads = self.num_heads()
        return LayerTypeProfile(
            name=self.name,
            parameters=sum(p.numel() for p in self.block.parameters()),
            hidden_size=int(self.hidden.shape[-1]),
            num_heads=heads,
            ffn_hidden_size=self.ffn_hidden_size(),
            seq_length=int(self.hidden.shape[1]) if self.hidden.dim() >= 3 else 1,
            forward_time=LinearFit.fit(sizes, forward),
            activation_bytes_per_sample=split,
            recompute_activation_bytes_per_sample=_per_sample(kept),
            replicated_activation_bytes_per_sample=replicated,
            backward_to_forward=sum(backward) / sum(forward) if sum(forward) > 0 else 2.0,
            supports_tensor_parallel=styles.tensor_parallel,
            supports_megatron_sp=styles.megatron_sp,
            supports_ulysses=styles.ulysses,
            tp_collectives_per_forward=self.row_parallel_layers() or 2,
            ulysses_all_to_alls_per_forward=4 * attention_calls if attention_calls else 4,
        )

    def per_degree(
        self,
        per_sample: float,
        roles: Mapping[str, float],
        degrees: Sequence[int],
        world: int,
        count_sizes: Sequence[int],
        styles: _Styles,
    ) -> tuple[DegreeTable, float]:
        """(bytes per sample per degree of a group that splits the activations, the part plain TP keeps whole).

        The table is the largest of the sequence-splitting styles the block supports (Megatron-SP,
        Ulysses), so a memory estimate never undershoots either; the replicated part is what plain
        Megatron TP keeps on top of it: ``(plain(g) - split(g)) / (1 - 1/g)``, which reproduces
        the measured plain-TP bytes exactly in the cost model.
        """
        table = {1: per_sample}
        replicated: list[float] = []
        measured = [g for g in degrees if 1 < g <= world and world % g == 0 and (styles.tensor_parallel or styles.ulysses)]
        for g in measured:
            results = self.measure_degree(g, world, count_sizes, styles)
            if not results:
                continue  # no style runs at this degree (it splits a head): the search will not offer it
            splitting = [results[s] for s in ("megatron", "ulysses") if s in results]
            table[g] = max(splitting) if splitting else results["none"]
            if "none" in results:
                replicated.append(max(results["none"] - table[g], 0.0) / (1 - 1 / g))
        if len(table) == 1:  # no group to measure on: derive from the degree-1 count (module docstring)
            for g in (g for g in degrees if g > 1):
                candidates = []
                if styles.tensor_parallel:  # plain TP adds the replicated norms below to this
                    candidates.append(roles["column"] + (per_sample - roles["column"]) / g)
                if styles.ulysses:
                    candidates.append(per_sample / g)
                if candidates:
                    table[g] = max(candidates)
            replicated = [roles["norm"]] if styles.tensor_parallel else []
        return DegreeTable(tuple(table.items())), (statistics.fmean(replicated) if replicated else 0.0)

    def measure_degree(self, g: int, world: int, count_sizes: Sequence[int], styles: _Styles) -> dict[str, float]:
        """Bytes per sample on one rank of a group of ``g`` ranks, per style the runtime can run at ``g``.

        Every rank takes part (each in its consecutive group of ``g``); the decision of which styles
        run depends only on the model, so all ranks issue the same collectives.
        """
        from lightning_galvatron.runtime.mesh import Layout, MeshCache
        from lightning_galvatron.runtime.tensor_parallel import apply_tensor_parallel
        from lightning_galvatron.runtime.ulysses import apply_ulysses

        tp_mesh = MeshCache.shared(self.device.type).tp_mesh(Layout(world, 1, g, True))
        seq = int(self.hidden.shape[1]) if self.hidden.dim() >= 3 else 1
        results = {}
        plan = self.tp_plan
        runnable = []
        if styles.tensor_parallel and plan is not None and plan.unsupported(g, "none") is None:
            runnable.append("none")
        if styles.megatron_sp and plan is not None and plan.unsupported(g, "megatron") is None and seq % g == 0:
            runnable.append("megatron")
        if styles.ulysses and seq % g == 0 and self.num_heads() % g == 0:
            runnable.append("ulysses")
        for style in runnable:
            block = self.copy()
            if style == "ulysses":
                apply_ulysses(block, tp_mesh.get_group())
            else:
                assert plan is not None
                apply_tensor_parallel(block, plan.styles(style == "megatron"), tp_mesh)
                plan.localize(block, g)
            split = 1 if style == "none" else g
            points = [(b, float(self.saved_bytes(block, b, seq_split=split).total)) for b in count_sizes]
            results[style] = _per_sample(points)
            log.debug("%s at degree %d, sp=%s: saved bytes per batch size %s", self.name, g, style, points)
        return results

    # ------------------------------------------------------------------ shape
    def num_heads(self) -> int:
        """Attention heads as the divisibility rules need them: the gcd of the head counts (query and
        key/value heads), else of the sizes the TP plan says a degree must divide, else 1."""
        heads = _attention_heads(self.block)
        if heads:
            return math.gcd(*heads.values())
        if self.tp_plan is not None and self.tp_plan.divisible:
            return math.gcd(*self.tp_plan.divisible.values())
        return 1

    def ffn_hidden_size(self) -> int:
        widths = [int(s) for m in self.block.modules() if isinstance(m, nn.Linear) for s in (m.in_features, m.out_features)]
        widths += [int(s) for m in self.block.modules() if type(m).__name__ == "Conv1D" for s in m.weight.shape]
        return max(widths, default=int(self.hidden.shape[-1]))

    def row_parallel_layers(self) -> int:
        """All-reduces per forward under Megatron TP: one behind each row-parallel layer."""
        if self.tp_plan is None:
            return 0
        from torch.distributed.tensor.parallel import RowwiseParallel

        from lightning_galvatron.runtime.tensor_parallel import ParallelMultiheadAttention, RowwiseConv1D

        row_parallel = (RowwiseParallel, RowwiseConv1D, ParallelMultiheadAttention)  # the attention ends in its out_proj
        return sum(isinstance(s, row_parallel) for s in self.tp_plan.styles(False).values())

    def _cross_check(self, plain: Sequence[tuple[int, SavedTensorCounter]]) -> None:
        for b, counter in plain:
            allocated = counter.allocator_bytes
            if allocated is None:
                continue
            agree = abs(allocated - counter.total) <= 0.1 * max(counter.total, 1)
            (log.debug if agree else log.info)(
                "%s at batch %d: autograd saves %d bytes; the CUDA allocator kept %d (peak %d above the start)%s",
                self.name, b, counter.total, allocated, counter.allocator_peak_bytes,
                "" if agree else ": they differ by more than 10% (allocator rounding, workspaces, tensors kept outside autograd)",
            )


@dataclass(frozen=True)
class _Styles:
    """The model-parallel styles the runtime can run on a block type."""

    tensor_parallel: bool
    megatron_sp: bool
    ulysses: bool


class _AttentionCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _attribute_to_submodules(block: nn.Module, counter: SavedTensorCounter, roles: Mapping[str, str]) -> list[Any]:
    """Hooks that set the counter's phase to a submodule's role while it runs (``other`` outside them)."""
    counter.phase = "other"
    handles = []
    for name, role in roles.items():
        try:
            sub = block.get_submodule(name)
        except AttributeError:
            continue

        def enter(mod: nn.Module, args: Any, role: str = role) -> None:
            counter.phase = role

        def leave(mod: nn.Module, args: Any, out: Any) -> None:
            counter.phase = "other"

        handles += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]
    return handles


def _backward(out: Any) -> None:
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(tensors[:1], [torch.randn_like(tensors[0])])


def _output_bytes(out: Any) -> int:
    return sum(_storage_bytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


def _allocated(device: torch.device, reset_peak: bool = False) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


# ---------------------------------------------------------------------------------------------- helpers
def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _detach(value: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _module_device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _batch_size(batch: Any) -> int:
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not leaves:
        raise ValueError("the example batch holds no tensors with a batch dimension")
    return int(leaves[0].shape[0])


def _resize_tensor(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` samples, tiling the tensor along dim 0 when it has fewer."""
    if size <= tensor.shape[0]:
        return tensor[:size]
    reps = math.ceil(size / tensor.shape[0])
    return tensor.repeat(reps, *([1] * (tensor.dim() - 1)))[:size]


def _resize_batch(batch: Any, size: int) -> Any:
    """The batch with ``size`` samples: tensors whose first dimension is the batch are sliced or tiled."""
    current = _batch_size(batch)
    return tree_map(
        lambda t: _resize_tensor(t, size) if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == current else t,
        batch,
    )


def _to_device(batch: Any, device: torch.device, prec: _PrecisionConfig) -> Any:
    return tree_map(lambda t: prec.place(t, device) if isinstance(t, torch.Tensor) else t, batch)


__all__ = ["SavedTensorCounter", "block_signature", "default_step", "profile_model"]
