"""Pipeline stages and micro-batches around the user's own step function.

The plan cuts the blocks into ``pp * virtual_stages`` chunks; chunk ``c`` runs on pipeline stage
``c % pp``. Each rank keeps only its chunks' blocks (the others are removed from their container
*by key*, so the remaining parameter names do not change), the layers before the blocks only on
the first stage and those after only on the last.

The user's model code and ``training_step`` are not split by hand. For every micro-batch, each
stage runs the user's step function; while it runs, iterating over a block container yields only
the blocks of the chunk being executed:

- the first of them receives the activation sent by the previous stage instead of its input (what
  the layers before it computed is discarded; on later stages those layers are parameter-free
  stand-ins that return zeros of the shape and dtype the real layer would, and refuse to run once
  the blocks have started);
- after the last of them the step is cut short and the activation is handed to
  ``torch.distributed.pipelining``, which sends it on -- in the sending block's layout; the
  receiving block relocates it on arrival like any other input;
- on the last stage the step runs to its end and returns the micro-batch loss.

``torch.distributed.pipelining`` (``PipelineStage``, GPipe, 1F1B, interleaved 1F1B) orders the
forward and backward passes. Without a pipeline (``pp = 1``) but with several micro-batches, the
micro-batches simply run one after another. Either way the micro-batch losses are scaled by the
caller (``loss_scale``) before backward, never the gradients afterwards, so gradient accumulation
across optimizer steps stays exact.

Which layers outside the blocks run before them and which after is not read from the order of
``__init__`` but observed on the step itself, once, before training
(:func:`~lightning_galvatron.model.outside_layers.trace_outside_layers`), which also refuses what a
pipeline could not run exactly. Weights shared between the two sides (a tied embedding and head)
live on both end stages; their gradients are summed across the two.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.runtime.gradient_sync import match_parameter_layout
from lightning_galvatron.runtime.mesh import local_tensor
from lightning_galvatron.runtime.structure import (
    ModelStructure,
    OutsideLayers,
    block_output_hidden,
    hidden_states_of,
    is_kv_cache,
    parameter_holders,
)

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class _Boundary(Exception):
    """Raised after the last block of a non-final chunk to stop the step and hand over the activation."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class PipelineUsageError(RuntimeError):
    pass


@dataclass
class _Chunk:
    index: int
    blocks: range  # global block indices
    final: bool
    received: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------- stand-ins
class _AbsentAttribute(PipelineUsageError, AttributeError):
    """An attribute of a layer or block that lives on another pipeline stage (an ``AttributeError``, so that
    ``hasattr`` still answers ``False``)."""


class _StandIn(nn.Module):
    """A parameter-free module in the place of a layer that lives on another stage (``home``)."""

    def __init__(self, name: str, stage: int, home: str) -> None:
        super().__init__()
        self._name, self._stage, self._home = name, stage, home

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            own = self.__dict__
            raise _AbsentAttribute(
                f"{own.get('_name')} lives on the {own.get('_home')} pipeline stage only; {name!r} was read on stage "
                f"{own.get('_stage')}"
            ) from None


class _FirstStageOnly(_StandIn):
    """Stand-in for a layer before the blocks, on stages that discard its output.

    It returns zeros of the shape and dtype the real layer would return (computed by a copy of the
    layer on the meta device, which holds no memory), and refuses to run after the blocks started:
    there its output would be used.
    """

    def __init__(self, original: nn.Module, name: str, stage: int, gate: _Gate) -> None:
        super().__init__(name, stage, "first")
        self._gate = gate
        meta = {id(t): _on_meta(t) for t in (*original.parameters(), *original.buffers())}
        self._shapes = [copy.deepcopy(original, meta)]  # a list: not registered (no parameters, no state)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        chunk = self._gate.chunk
        if chunk is None or self._gate.blocks_started:
            raise PipelineUsageError(
                f"{self._name} runs before the Transformer blocks (as traced on the step before training), so with "
                f"pipeline parallelism it lives on the first stage only; on stage {self._stage} it was called "
                + ("outside the Lightning steps" if chunk is None else "after the blocks (does this step use it "
                   "differently from the traced one?)")
            )
        device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        shapes = self._shapes[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tree_map(zeros, shapes)


class _LastStageOnly(_StandIn):
    """Stand-in for a layer after the blocks on stages that never reach it."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__(name, stage, "last")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineUsageError(
            f"{self._name} runs after the Transformer blocks (as traced on the step before training), so with pipeline "
            f"parallelism it lives on the last stage only; it was called on stage {self._stage} (does this step use "
            "it before the blocks?)"
        )


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _outermost(names: Sequence[str]) -> list[str]:
    """Names not inside another of ``names`` (replacing a module replaces its submodules)."""
    return [n for n in names if not any(n.startswith(f"{other}.") for other in names if other != n)]


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


# ----------------------------------------------------------------------------------------- the gate
class _BlockCall:
    """What the user's loop calls instead of a block while a chunk runs."""

    def __init__(
        self, gate: _Gate, block: nn.Module, receive: torch.Tensor | None, hand_over: torch.dtype | None
    ) -> None:
        self.gate, self.block, self.receive, self.hand_over = gate, block, receive, hand_over

    def __getattr__(self, name: str) -> Any:
        # The loop may read the block's configuration (Qwen2: ``decoder_layer.attention_type``).
        return getattr(self.block, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.gate.blocks_started = True
        if self.receive is not None:
            args, kwargs = _replace_hidden(args, kwargs, self.receive)
        out = self.block(*args, **kwargs)
        if self.hand_over is not None:
            raise _Boundary(block_output_hidden(out).to(self.hand_over))
        return out


def _replace_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    where, _ = hidden_states_of(args, kwargs)
    if isinstance(where, int):
        return (*args[:where], hidden, *args[where + 1 :]), kwargs
    return args, {**kwargs, where: hidden}


class _Gate:
    """While a chunk runs, block containers yield that chunk's blocks (as :class:`_BlockCall`)."""

    def __init__(self, index_of: dict[int, int], boundary_dtype: torch.dtype) -> None:
        self.index_of = index_of  # id(block) -> global block index
        self.boundary_dtype = boundary_dtype
        self.chunk: _Chunk | None = None
        self.blocks_started = False  # whether the running chunk's first block was called

    def calls(self, blocks: Sequence[nn.Module]) -> list[_BlockCall]:
        chunk = self.chunk
        if chunk is None:
            raise PipelineUsageError(
                "with pipeline parallelism the model runs only inside the Lightning steps (training, validation, "
                "test, predict), where the strategy drives the pipeline schedule"
            )
        chosen = [b for b in blocks if self.index_of.get(id(b), -1) in chunk.blocks]
        first, last = chunk.blocks[0], chunk.blocks[-1]
        return [
            _BlockCall(
                self,
                b,
                receive=chunk.received if self.index_of[id(b)] == first else None,
                hand_over=self.boundary_dtype if self.index_of[id(b)] == last and not chunk.final else None,
            )
            for b in chosen
        ]


class _AbsentBlock:
    """A block of another stage, looked up by index: its configuration reads like a local block's.

    Only configuration: its tensors and methods are refused (they would be another block's), and its
    submodules read the same way.
    """

    def __init__(self, representative: nn.Module, key: str, path: str = "") -> None:
        self._representative, self._key, self._path = representative, key, path

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._representative, name)
        path = f"{self._path}.{name}" if self._path else name
        if isinstance(value, nn.Module):
            return _AbsentBlock(value, self._key, path)
        if isinstance(value, torch.Tensor) or inspect.ismethod(value):
            raise _AbsentAttribute(
                f"block {self._key} lives on another pipeline stage; its {path!r} is not on this one (its "
                "configuration can be read, its tensors and methods cannot)"
            )
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineUsageError(
            f"block {self._key} lives on another pipeline stage; with pipeline parallelism blocks must be called "
            "by iterating over their list (for block in self.layers: ...), not by index"
        )


def _gated_class(cls: type, gate: _Gate) -> type:
    def __iter__(self):  # noqa: ANN001, ANN202, N807
        return iter(gate.calls(list(self._modules.values())))

    def __getitem__(self, index):  # noqa: ANN001, ANN202, N807
        if isinstance(index, slice):
            return gate.calls(list(self._modules.values())[index])
        key = str(index % self.galvatron_length)  # keys are the global positions
        if key in self._modules:
            return self._modules[key]
        return _AbsentBlock(next(iter(self._modules.values())), key)  # e.g. nn.TransformerEncoder reads layers[0]

    return type(f"Pipelined{cls.__name__}", (cls,), {"__iter__": __iter__, "__getitem__": __getitem__})


# ----------------------------------------------------------------------------------------- the stage
class StagePartition:
    """This rank's share of the model: its chunks, and what was removed or stood in for.

    ``outside`` says which layers outside the blocks run before them and which after (see
    :func:`~lightning_galvatron.model.outside_layers.trace_outside_layers`).

    Activations cross stages in ``boundary_dtype`` (fixed, so that every stage knows the shapes and
    dtypes it will receive before the first micro-batch runs).
    """

    def __init__(
        self,
        structure: ModelStructure,
        plan: ParallelPlan,
        rank: int,
        boundary_dtype: torch.dtype,
        outside: OutsideLayers,
    ) -> None:
        if structure.num_blocks != plan.num_layers:
            raise PlanError(f"the plan has {plan.num_layers} layer strategies but the model has {structure.num_blocks} blocks")
        self.plan = plan
        self.stage = rank // plan.devices_per_stage
        num_chunks = plan.pp * plan.virtual_stages
        self.chunks = [
            _Chunk(c, plan.chunk_layers(c), final=c == num_chunks - 1) for c in range(self.stage, num_chunks, plan.pp)
        ]
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.pp - 1
        self.local_blocks = [i for chunk in self.chunks for i in chunk.blocks]

        holders = parameter_holders(structure)
        before = [(name, holders[name]) for name in outside.before]
        after = [(name, holders[name]) for name in outside.after]
        before_params = {id(p) for _, m in before for p in m.parameters()}
        # Where this stage holds each weight shared by the first and last stage: (module, attribute).
        after_params = {id(p) for _, m in after for p in m.parameters()}
        self._has_tied = bool(before_params & after_params)  # known on every stage: the group is collective
        holders_here = before if self.is_first else after if self.is_last else []
        self._tied_slots = [
            (m, name)
            for _, m in holders_here
            for name, p in m.named_parameters(recurse=False)
            if id(p) in before_params and id(p) in after_params
        ]
        # The layers outside the blocks that this stage runs, grouped for data parallelism by the caller.
        # (the outermost ones: a module holding parameters may sit inside another, BERT's ``cls.predictions``)
        here = [*(outside.before if self.is_first else ()), *(outside.after if self.is_last else ())]
        self.vocabulary_modules = [holders[name] for name in _outermost(here)]

        # Remove the blocks of other stages, by key so that the remaining names do not change.
        local = set(self.local_blocks)
        index_of: dict[int, int] = {}
        index = 0
        for block_list in structure.block_lists:
            block_list.container.galvatron_length = len(block_list.container)  # before blocks are removed
            for key, block in list(block_list.container._modules.items()):
                if index in local:
                    index_of[id(block)] = index
                else:
                    del block_list.container._modules[key]
                index += 1
        self.gate = _Gate(index_of, boundary_dtype)
        self.boundary_dtype = boundary_dtype
        for block_list in structure.block_lists:
            container = block_list.container
            container.__class__ = _gated_class(type(container), self.gate)
        if not self.is_first:
            for name in _outermost(outside.before):
                _replace(structure.root, name, _FirstStageOnly(holders[name], name, self.stage, self.gate))
        if not self.is_last:
            for name in _outermost(outside.after):
                _replace(structure.root, name, _LastStageOnly(name, self.stage))

    @property
    def has_tied_weights(self) -> bool:
        return self._has_tied

    @property
    def tied(self) -> list[nn.Parameter]:
        """This stage's copies of weights shared by the first and last stage (as they are now: sharding
        replaces parameter objects)."""
        return [getattr(module, name) for module, name in self._tied_slots]

    @contextmanager
    def running(self, chunk: _Chunk, received: torch.Tensor | None) -> Iterator[None]:
        chunk.received = received
        self.gate.chunk = chunk
        self.gate.blocks_started = False
        try:
            yield
        finally:
            self.gate.chunk = None
            chunk.received = None


class _ChunkModule(nn.Module):
    """The ``nn.Module`` a ``PipelineStage`` drives: one chunk of the user's step on one micro-batch."""

    def __init__(self, runner: PipelineRunner, chunk: _Chunk) -> None:
        super().__init__()
        self._runner = [runner]  # a list: not registered as a submodule
        self.chunk = chunk

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._runner[0]._run_chunk(self.chunk, inputs)


# ----------------------------------------------------------------------------------------- the runner
StepFn = Callable[[Any], Any]


class PipelineRunner:
    """Runs a step function over micro-batches, through the pipeline schedule when ``pp > 1``.

    Args:
        plan: the plan.
        partition: this rank's stage (see :class:`StagePartition`); ``None`` when ``pp == 1``.
        pipeline_group: the ranks at this rank's position on every stage (``None`` when ``pp == 1``).
        tied_group: the first and last stage ranks at this position, when they share weights.
        boundary_shape: local ``(batch, seq)`` of the activation leaving block ``i`` on this rank, for a
            stage-wide micro-batch of ``batch`` samples of length ``seq``: ``boundary_shape(i, batch, seq)``.
        hidden_size: width of the activations between blocks.
        set_micro_batch_size: told the stage-wide micro-batch size before each micro-batch runs
            (the relocation between layouts needs it).
        input_shards: data shards of the input layout (the stage-wide micro-batch is
            ``input_shards`` times the local one).
    """

    def __init__(
        self,
        plan: ParallelPlan,
        partition: StagePartition | None,
        pipeline_group: dist.ProcessGroup | None,
        tied_group: dist.ProcessGroup | None,
        device: torch.device,
        set_micro_batch_size: Callable[[int], None],
        input_shards: int,
        boundary_shape: Callable[[int, int, int], tuple[int, int]] | None = None,
        hidden_size: int | None = None,
    ) -> None:
        self.plan = plan
        self._boundary_shape = boundary_shape
        self._hidden_size = hidden_size
        self.partition = partition
        self.group = pipeline_group
        self._tied_group = tied_group
        self.device = device
        self._set_micro_batch_size = set_micro_batch_size
        self._input_shards = input_shards
        self._schedules: dict[tuple[int, bool, int, int], Any] = {}
        self._step: StepFn | None = None
        self._micro_batches: list[Any] = []
        self._next: dict[int, int] = {}
        self._outputs: list[Any] = []
        self._train = True
        self._last_rank = dist.get_process_group_ranks(pipeline_group)[-1] if pipeline_group is not None else None

    # ------------------------------------------------------------------ public
    def run(self, batch: Any, step: StepFn, loss_scale: float, train: bool) -> list[Any]:
        """Run ``step`` on the micro-batches of ``batch``; backward too when ``train``.

        Returns the step's outputs per micro-batch on the last stage (an empty list elsewhere). The
        loss returned by each micro-batch is multiplied by ``loss_scale`` before backward.
        """
        micro_batches = split_micro_batches(batch, self.plan.micro_batches)
        if self.partition is None:
            return self._run_sequentially(micro_batches, step, loss_scale, train)
        self._step, self._micro_batches, self._outputs, self._train = step, micro_batches, [], train
        self._next = {chunk.index: 0 for chunk in self.partition.chunks}
        try:
            self._run_schedule(loss_scale, train)
        finally:
            self._step, self._micro_batches = None, []
        if train and self._tied_group is not None:
            self._sum_tied_gradients()
        return self._outputs

    def broadcast_from_last_stage(self, obj: Any) -> Any:
        """Give every stage (at this position) the last stage's ``obj``."""
        if self.group is None:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=self._last_rank, group=self.group)
        return holder[0]

    # ------------------------------------------------------------------ execution
    def _run_sequentially(self, micro_batches: list[Any], step: StepFn, loss_scale: float, train: bool) -> list[Any]:
        """No pipeline: the micro-batches one after another, each with its backward (gradients accumulate)."""
        outputs = []
        for micro_batch in micro_batches:
            self._set_micro_batch_size(_leading_size(micro_batch) * self._input_shards)
            out = step(micro_batch)
            outputs.append(out)
            loss = loss_of(out)
            if train and loss is not None:
                (loss * loss_scale).backward()
        return outputs

    def _run_schedule(self, loss_scale: float, train: bool) -> None:
        m = len(self._micro_batches)
        schedule = self._schedule(m, train, loss_scale, _leading_size(self._micro_batches[0]), _sequence_length(self._micro_batches[0]))
        kwargs: dict[str, Any] = {}
        if self.partition.is_last:
            kwargs["target"] = torch.zeros(m, device=self.device)
        args = (torch.arange(m, device=self.device),) if self.partition.is_first else ()
        if train:
            schedule.step(*args, return_outputs=False, **kwargs)
        else:
            schedule.eval(*args, return_outputs=False, **kwargs)

    def _schedule(self, m: int, train: bool, loss_scale: float, local_batch: int, seq: int) -> Any:
        """One schedule per (micro-batches, mode, shape), with the stages' tensor shapes given up front.

        Given shapes, ``PipelineStage`` needs no trial forward pass to discover them (which would run the
        user's step, collectives included, on placeholder data).
        """
        key = (m, train, local_batch, seq)
        if key not in self._schedules:
            assert self.partition is not None and self._boundary_shape is not None and self._hidden_size is not None
            num_chunks = self.plan.pp * self.plan.virtual_stages
            batch = local_batch * self._input_shards
            dtype = self.partition.boundary_dtype

            def activation(block: int) -> torch.Tensor:
                shape = (*self._boundary_shape(block, batch, seq), self._hidden_size)
                return torch.empty(shape, dtype=dtype, device="meta", requires_grad=train)  # received -> grad sent back

            stages = []
            for chunk in self.partition.chunks:
                received = activation(chunk.blocks[0] - 1) if chunk.index else None
                sent = None if chunk.final else activation(chunk.blocks[-1])
                stages.append(
                    PipelineStage(
                        _ChunkModule(self, chunk),
                        chunk.index,
                        num_chunks,
                        self.device,
                        input_args=received if received is not None else torch.empty(1, dtype=torch.long, device="meta"),
                        output_args=sent if sent is not None else torch.empty((), device="meta"),
                        input_grads=received,  # gradients have their activation's shape and dtype
                        output_grads=sent,
                        group=self.group,
                    )
                )
            schedule_cls = _SCHEDULES[self.plan.schedule]
            loss_fn = _ScaledLoss(loss_scale)
            if self.plan.schedule == "interleaved_1f1b":
                schedule = schedule_cls(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
            else:
                (stage,) = stages
                schedule = schedule_cls(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
            self._schedules[key] = (schedule, loss_fn)
        schedule, loss_fn = self._schedules[key]
        loss_fn.scale = loss_scale
        return schedule

    def _run_chunk(self, chunk: _Chunk, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        assert self._step is not None
        index = self._next[chunk.index]
        self._next[chunk.index] = index + 1
        micro_batch = self._micro_batches[index]
        self._set_micro_batch_size(_leading_size(micro_batch) * self._input_shards)
        received = inputs[0] if chunk.index > 0 else None
        with self.partition.running(chunk, received):
            try:
                out = self._step(micro_batch)
            except _Boundary as boundary:
                return boundary.hidden
        if not chunk.final:
            raise PipelineUsageError(
                "the step finished before reaching the last block of this pipeline stage; with pipeline parallelism "
                "every step must run all Transformer blocks in order"
            )
        self._outputs.append(out)
        loss = loss_of(out) if self._train else None  # forward-only: the schedule needs a scalar, not predictions
        return torch.zeros((), device=self.device) if loss is None else loss.float()

    def _sum_tied_gradients(self) -> None:
        assert self.partition is not None
        for param in self.partition.tied:
            if param.grad is not None:
                match_parameter_layout(param)  # the embedding's and the head's gradients may differ in layout
                dist.all_reduce(local_tensor(param.grad), group=self._tied_group)


class _ScaledLoss:
    """The pipeline's loss function: the stage output already is the micro-batch loss."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output * self.scale


def loss_of(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return out["loss"]
    return None


def split_micro_batches(batch: Any, micro_batches: int) -> list[Any]:
    """Split every tensor of a (nested) batch into ``micro_batches`` equal parts along dim 0."""
    if micro_batches == 1:
        return [batch]
    leaves, spec = tree_flatten(batch)
    size = _leading_size(batch)
    if size % micro_batches:
        raise PlanError(
            f"a local batch of {size} samples cannot be split into {micro_batches} micro-batches; make the "
            f"DataLoader's batch a multiple of {micro_batches} per data shard"
        )
    parts = [leaf.chunk(micro_batches) if isinstance(leaf, torch.Tensor) else [leaf] * micro_batches for leaf in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(micro_batches)]


def join_micro_batches(outputs: list[Any]) -> Any:
    """The step outputs of the micro-batches of one batch as the output of the whole batch, on the CPU.

    Outputs are joined leaf by leaf in their common structure (tensors, tuples, dicts, Hugging Face
    ``ModelOutput``): tensors with a batch dimension are concatenated along it, scalars averaged (the
    micro-batches are equal in size, so a mean over the batch is the mean of the micro-batch means),
    equal non-tensor leaves kept. A KV cache belongs to one call of the model and becomes ``None``.
    Outputs of different structures are returned as the list they are.
    """
    if len(outputs) == 1:
        return tree_map(lambda x: None if is_kv_cache(x) else x, _to_cpu(outputs[0]))
    flat = [tree_flatten(_to_cpu(out)) for out in outputs]
    spec = flat[0][1]
    if any(str(s) != str(spec) for _, s in flat[1:]):
        return outputs
    joined = []
    for leaves in zip(*(leaves for leaves, _ in flat)):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            joined.append(torch.cat(leaves) if first.dim() else torch.stack(leaves).float().mean().to(first.dtype))
        elif is_kv_cache(first):
            joined.append(None)
        else:
            joined.append(first if all(leaf == first for leaf in leaves[1:]) else list(leaves))
    return tree_unflatten(joined, spec)


def _to_cpu(out: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, out)


def _sequence_length(batch: Any) -> int:
    """Length of the sequences in a batch: the second dimension of its first tensor with one."""
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 1:
            return leaf.shape[1]
    raise PlanError("pipeline parallelism needs batches of sequences ([batch, seq, ...] tensors)")


def _leading_size(batch: Any) -> int:
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise PlanError("a batch without tensors cannot be split into micro-batches")
