"""Pipeline stages and micro-batches around the user's own step function.

The plan cuts the blocks into ``pp * virtual_stages`` chunks; chunk ``c`` runs on pipeline stage
``c % pp``. Each rank keeps only its chunks' blocks, the layers before the blocks only on the first
stage and those after only on the last (:class:`~lightning_galvatron.runtime.stage.StagePartition`:
the partition and its stand-ins; this module is the runner and the schedules).

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
live on both end stages; their gradients are summed across the two once per optimizer step, with the
data-parallel sums (:meth:`~lightning_galvatron.runtime.gradient_sync.GradientReducer.add_shared`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.runtime.stage import Boundary, Chunk, PipelineUsageError, StagePartition
from lightning_galvatron.runtime.structure import is_kv_cache

__all__ = [
    "SCHEDULE_CLASSES",
    "PipelineRunner",
    "PipelineUsageError",
    "StagePartition",
    "join_micro_batches",
    "loss_of",
    "split_micro_batches",
]

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class _ChunkModule(nn.Module):
    """The ``nn.Module`` a ``PipelineStage`` drives: one chunk of the user's step on one micro-batch."""

    def __init__(self, runner: PipelineRunner, chunk: Chunk) -> None:
        super().__init__()
        self._runner = [runner]  # a list: not registered as a submodule
        self.chunk = chunk

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._runner[0]._run_chunk(self.chunk, inputs)


# ----------------------------------------------------------------------------------------- the runner
StepFn = Callable[[Any], Any]  # the user's step: a micro-batch -> its output
_Schedule = PipelineScheduleSingle | PipelineScheduleMulti


class PipelineRunner:
    """Runs a step function over micro-batches, through the pipeline schedule when ``pp > 1``.

    Args:
        plan: the plan.
        partition: this rank's stage (see :class:`StagePartition`); ``None`` when ``pp == 1``.
        pipeline_group: the ranks at this rank's position on every stage (``None`` when ``pp == 1``).
        boundary_shape: local ``(batch, seq)`` of the activation leaving block ``i`` on this rank, for a
            stage-wide micro-batch of ``batch`` samples of length ``seq``: ``boundary_shape(i, batch, seq)``.
        hidden_width: the width of the hidden states block ``i`` returns: ``hidden_width(i)``.
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
        device: torch.device,
        set_micro_batch_size: Callable[[int], None],
        input_shards: int,
        boundary_shape: Callable[[int, int, int], tuple[int, int]] | None = None,
        hidden_width: Callable[[int], int] | None = None,
    ) -> None:
        self.plan = plan
        self._boundary_shape = boundary_shape
        self._hidden_width = hidden_width
        self.partition = partition
        self.group = pipeline_group
        self.device = device
        self._set_micro_batch_size = set_micro_batch_size
        self._input_shards = input_shards
        self._schedules: dict[tuple[int, bool, int, int], tuple[_Schedule, _ScaledLoss]] = {}
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
        assert self.partition is not None  # run() schedules only a pipeline stage
        m = len(self._micro_batches)
        schedule = self._schedule(
            m, train, loss_scale, _leading_size(self._micro_batches[0]), _sequence_length(self._micro_batches[0])
        )
        kwargs: dict[str, Any] = {}
        if self.partition.is_last:
            kwargs["target"] = torch.zeros(m, device=self.device)
        args = (torch.arange(m, device=self.device),) if self.partition.is_first else ()
        if train:
            schedule.step(*args, return_outputs=False, **kwargs)
        else:
            schedule.eval(*args, return_outputs=False, **kwargs)

    def _schedule(self, m: int, train: bool, loss_scale: float, local_batch: int, seq: int) -> _Schedule:
        """One schedule per (micro-batches, mode, shape), with the stages' tensor shapes given up front.

        Given shapes, ``PipelineStage`` needs no trial forward pass to discover them (which would run the
        user's step, collectives included, on placeholder data).
        """
        key = (m, train, local_batch, seq)
        if key not in self._schedules:
            boundary_shape, hidden_width = self._boundary_shape, self._hidden_width
            assert self.partition is not None and boundary_shape is not None and hidden_width is not None
            num_chunks = self.plan.pp * self.plan.virtual_stages
            batch = local_batch * self._input_shards
            dtype = self.partition.boundary_dtype

            def activation(block: int) -> torch.Tensor:
                shape = (*boundary_shape(block, batch, seq), hidden_width(block))
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
                        input_args=received
                        if received is not None
                        else torch.empty(1, dtype=torch.long, device="meta"),
                        output_args=sent if sent is not None else torch.empty((), device="meta"),
                        input_grads=received,  # gradients have their activation's shape and dtype
                        output_grads=sent,
                        group=self.group,
                    )
                )
            schedule_cls = SCHEDULE_CLASSES[self.plan.schedule]
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

    def _run_chunk(self, chunk: Chunk, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        assert self._step is not None and self.partition is not None
        index = self._next[chunk.index]
        self._next[chunk.index] = index + 1
        micro_batch = self._micro_batches[index]
        self._set_micro_batch_size(_leading_size(micro_batch) * self._input_shards)
        received = inputs[0] if chunk.index > 0 else None
        with self.partition.running(chunk, received):
            try:
                out = self._step(micro_batch)
            except Boundary as boundary:
                return boundary.hidden
        if not chunk.final:
            raise PipelineUsageError(
                "the step finished before reaching the last block of this pipeline stage; with pipeline parallelism "
                "every step must run all Transformer blocks in order"
            )
        self._outputs.append(out)
        loss = loss_of(out) if self._train else None  # forward-only: the schedule needs a scalar, not predictions
        return torch.zeros((), device=self.device) if loss is None else loss.float()


class _ScaledLoss:
    """The pipeline's loss function: the stage output already is the micro-batch loss."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output * self.scale


def loss_of(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and isinstance(loss := out.get("loss"), torch.Tensor):
        return loss
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
    joined: list[Any] = []  # leaves of the user's outputs
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
