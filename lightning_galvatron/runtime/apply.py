"""Execute a plan on a model: the recipe, one ``apply_*`` call per concern and block.

Reading order: check that the runtime can execute the plan exactly (:func:`check_runtime_support`,
called once by the strategy before the plan is printed); keep this rank's pipeline
stage only; then for every local block, the relocation of its input from the previous block's
layout, tensor or sequence parallelism on the block's group, recomputation and data parallelism on
the block's dp group; then the relocation of the last block's output back to the vocabulary
layout, vocabulary parallelism, the layers outside the blocks as the FSDP root, and the runner
that drives micro-batches and the pipeline schedule. Parameter names never change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, register_fsdp_forward_method

from lightning_galvatron.model.discovery import ModelStructure, model_class
from lightning_galvatron.model.outside_layers import OutsideLayers
from lightning_galvatron.model.tensor_parallel_plans import tensor_parallel_plan
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError
from lightning_galvatron.rules import pipeline_problem, schedule_problem, sequence_problem, vocab_problem
from lightning_galvatron.runtime.gradient_sync import GradientReducer
from lightning_galvatron.runtime.mesh import Layout, MeshCache
from lightning_galvatron.runtime.pipeline import PipelineRunner, StagePartition
from lightning_galvatron.runtime.recompute import apply_recompute, is_recomputing
from lightning_galvatron.runtime.relocate import ActivationLayout, exchange_plan, relocate
from lightning_galvatron.runtime.sharding import apply_data_parallel
from lightning_galvatron.runtime.tensor_parallel import apply_tensor_parallel
from lightning_galvatron.runtime.ulysses import apply_ulysses
from lightning_galvatron.runtime.vocab_parallel import VocabularyLayers, apply_vocab_parallel, find_vocabulary_layers


class NotSupportedYet(PlanError):
    """A valid plan that this version of the runtime cannot execute exactly."""


def check_runtime_support(plan: ParallelPlan, structure: ModelStructure, seq_length: int | None = None) -> None:
    """Refuse, with the reason, any plan the runtime would not execute exactly (the first of
    :func:`runtime_problems`). The caller checks once, before the plan is printed or applied."""
    if plan.num_layers != structure.num_blocks:
        lists = ", ".join(f"{bl.path} ({len(bl.blocks)} x {bl.block_type})" for bl in structure.block_lists)
        raise PlanError(
            f"the plan has {plan.num_layers} layer strategies but the model has {structure.num_blocks} blocks "
            f"({lists}); give one strategy per block"
        )
    problems = runtime_problems(plan, structure, seq_length)
    if problems:
        raise PlanError(problems[0])


def runtime_problems(plan: ParallelPlan, structure: ModelStructure, seq_length: int | None = None) -> list[str]:
    """Why the runtime would refuse ``plan`` for this model, each with where (empty: it executes it exactly).

    The rules of :mod:`lightning_galvatron.rules` with the model's facts: its block lists, whether it has a
    token embedding to split by vocabulary, each block's tensor-parallel plan and, when given, the sequence
    length the sequence-parallel degrees must divide. Pure: nothing is changed or communicated.
    """
    out = [p for p in (schedule_problem(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages),
                       pipeline_problem(plan.pp, [bl.path for bl in structure.block_lists])) if p is not None]
    problem = vocab_problem(plan.vocab, plan.vocab.tp == 1 or _has_token_embedding(structure))
    if problem is not None:
        out.append(f"vocab {problem}")
    for index, (block, strategy) in enumerate(zip(structure.blocks, plan.layers)):
        if strategy.tp == 1:
            continue
        tp_plan = tensor_parallel_plan(block)
        if tp_plan is None:
            kind = f"tp={strategy.tp}" if strategy.sp != "ulysses" else f"Ulysses of degree {strategy.tp}"
            out.append(
                f"layers[{index}]: {type(block).__name__} has no tensor-parallel plan, so {kind} cannot run; use tp=1 "
                "for it or register a plan with lightning_galvatron.register_tensor_parallel_plan"
            )
            continue
        reason = tp_plan.unsupported(strategy.tp, strategy.sp)
        if reason is None and seq_length is not None:
            reason = sequence_problem(strategy.tp, strategy.sp, seq_length)
        if reason is not None:
            where = f"layers[{index}] ({structure.block_names[index]})"
            out.append(f"{where}: tp={strategy.tp}, sp={strategy.sp!r}: {reason}")
    return out


def _has_token_embedding(structure: ModelStructure) -> bool:
    try:
        find_vocabulary_layers(structure)
    except PlanError:
        return False
    return True


@dataclass
class _MicroBatch:
    """The stage's micro-batch size of the forward in flight (learned from the first block's input)."""

    size: int = 0


@dataclass
class AppliedPlan:
    """What the strategy needs after the plan is applied."""

    plan: ParallelPlan
    input_shards: int  # data shards of the input layout: the loss of each is scaled by 1 / input_shards
    hooks: list[Any] = field(default_factory=list)
    gradients: GradientReducer = field(default_factory=GradientReducer)  # sums the ddp layers' gradients
    runner: PipelineRunner | None = None  # drives micro-batches / the pipeline; None for one micro-batch, pp=1
    pipeline_group: dist.ProcessGroup | None = None
    partition: StagePartition | None = None


def apply_plan(
    model: nn.Module,
    structure: ModelStructure,
    plan: ParallelPlan,
    meshes: MeshCache,
    mp_policy: MixedPrecisionPolicy,
    entry_methods: Sequence[str] = (),
    parallel_loss: bool = False,
    boundary_dtype: torch.dtype = torch.float32,
    outside_layers: OutsideLayers | None = None,
) -> AppliedPlan:
    """Parallelise ``model`` in place as ``plan`` says (checked first with :func:`check_runtime_support`).

    Args:
        model: the root module; it becomes the FSDP root holding the vocabulary layers.
        structure: the blocks of ``model`` (see :func:`~lightning_galvatron.model.discovery.find_blocks`).
        entry_methods: methods other than ``forward`` through which the root is run (e.g.
            ``training_step``); FSDP gathers the root's parameters around them.
        parallel_loss: with vocabulary parallelism, keep logits sharded (see ``vocab_parallel``).
        boundary_dtype: dtype of the activations sent between pipeline stages.
        outside_layers: with ``pp > 1``, which layers outside the blocks run before them and which after
            (:func:`~lightning_galvatron.model.outside_layers.trace_outside_layers` on the user's step).
    """
    rank = dist.get_rank()
    stage = Layout(plan.world_size, plan.pp, 1)
    # Creating a mesh is collective over all ranks; a pipeline stage only uses its own blocks' layouts,
    # so every rank creates every layout of the plan first, in the same order.
    for layout in dict.fromkeys([stage, *(Layout.of(plan, s) for s in (plan.vocab, *plan.layers))]):
        meshes.mesh(layout)
    stage_group = meshes.dp_mesh(stage).get_group()
    position = rank % plan.devices_per_stage
    micro_batch = _MicroBatch()
    vocab_layout = ActivationLayout.of(plan, plan.vocab)
    layouts = [ActivationLayout.of(plan, s) for s in plan.layers]
    applied = AppliedPlan(plan, input_shards=vocab_layout.layout.dp)
    all_blocks = structure.blocks
    starts, ends = _block_list_bounds(structure)  # before a pipeline stage removes other stages' blocks
    _disable_nested_tensors(structure)
    vocabulary = find_vocabulary_layers(structure) if plan.vocab.tp > 1 or plan.pp > 1 else None

    local_blocks = range(plan.num_layers)
    if plan.pp > 1:
        if outside_layers is None:
            raise PlanError(
                "pipeline parallelism needs to know which layers outside the blocks run before them and which after: "
                "pass outside_layers=trace_outside_layers(module, structure, step, example_batch)"
            )
        applied.partition = StagePartition(structure, plan, rank, boundary_dtype, outside_layers)
        local_blocks = applied.partition.local_blocks
        applied.pipeline_group = meshes.mesh(stage)["pp"].get_group()

    # Each block list (an encoder, a decoder) starts from and returns to the vocabulary layout: its first
    # block reads embeddings, its last block's output is used by layers outside the blocks (or as the
    # decoder's memory, which then reaches each decoder block along the batch).
    for index in local_blocks:
        block, strategy = all_blocks[index], plan.layers[index]
        source = vocab_layout if index in starts else layouts[index - 1]
        applied.hooks.append(
            _relocate_inputs(
                block, source, layouts[index], micro_batch, position, stage_group, first=index == 0, extras_source=vocab_layout
            )
        )
        layout = Layout.of(plan, strategy)
        if strategy.sp == "ulysses":
            apply_ulysses(block, meshes.tp_mesh(layout).get_group())
        elif strategy.tp > 1:
            tp_plan = tensor_parallel_plan(block)
            assert tp_plan is not None  # checked above
            apply_tensor_parallel(block, tp_plan.styles(strategy.sp == "megatron"), meshes.tp_mesh(layout))
            tp_plan.localize(block, strategy.tp)
        if strategy.recompute:
            apply_recompute(block)
        apply_data_parallel(block, strategy, _gradient_mesh(meshes, plan, strategy), mp_policy, applied.gradients)
    for end in ends:
        if end in local_blocks:
            applied.hooks.append(_relocate_output(all_blocks[end], layouts[end], vocab_layout, micro_batch, position, stage_group))

    if vocabulary is not None and plan.vocab.tp > 1:
        vocab_tp_mesh = meshes.tp_mesh(Layout.of(plan, plan.vocab))
        apply_vocab_parallel(vocabulary.present_in(model), vocab_tp_mesh, parallel_loss)
    vocab_dp_mesh = meshes.dp_mesh(Layout.of(plan, plan.vocab))
    if applied.partition is None:
        apply_data_parallel(model, plan.vocab, vocab_dp_mesh, mp_policy, applied.gradients, outside_blocks=True)
        if isinstance(model, FSDPModule):
            for name in entry_methods:
                register_fsdp_forward_method(model, name)
    else:
        # Pipelined: the step stops early on most stages, so no FSDP root wraps the whole step; each layer
        # outside the blocks is data-parallel on its own (hooked on its own forward calls).
        for module in applied.partition.vocabulary_modules:
            apply_data_parallel(module, plan.vocab, vocab_dp_mesh, mp_policy, applied.gradients, outside_blocks=True)
    applied.gradients.build()

    if plan.pp > 1 or plan.micro_batches > 1:
        applied.runner = PipelineRunner(
            plan,
            applied.partition,
            applied.pipeline_group,
            _tied_weights_group(plan, applied.partition, position),
            _device_of(model),
            set_micro_batch_size=lambda size: setattr(micro_batch, "size", size),
            input_shards=applied.input_shards,
            boundary_shape=lambda block, batch, seq: layouts[block].local_shape(position, batch, seq),
            hidden_size=_hidden_size(vocabulary),
        )
    return applied


def _hidden_size(vocabulary: VocabularyLayers | None) -> int | None:
    """Width of the residual stream (what pipeline stages exchange): the token embedding's width."""
    if vocabulary is None:
        return None
    if vocabulary.embedding is None:
        raise PlanError("pipeline parallelism needs the token embedding (an nn.Embedding before the blocks)")
    return vocabulary.embedding.embedding_dim


def _disable_nested_tensors(structure: ModelStructure) -> None:
    """``nn.TransformerEncoder`` may pack padded batches into nested tensors in eval mode, which cannot be
    relocated between layouts; the plain path computes the same result."""
    for block_list in structure.block_lists:
        parent_path = block_list.path.rpartition(".")[0]
        parent = structure.root.get_submodule(parent_path) if parent_path else structure.root
        if isinstance(parent, nn.TransformerEncoder):
            parent.use_nested_tensor = False


def _block_list_bounds(structure: ModelStructure) -> tuple[set[int], set[int]]:
    """Global indices of the first and of the last block of every block list."""
    starts, ends, offset = set(), set(), 0
    for block_list in structure.block_lists:
        count = len(block_list.blocks)
        starts.add(offset)
        ends.add(offset + count - 1)
        offset += count
    return starts, ends


def _tied_weights_group(plan: ParallelPlan, partition: StagePartition | None, position: int) -> dist.ProcessGroup | None:
    """First and last stage ranks at this position, when they share weights (created on every rank)."""
    if partition is None or not partition.has_tied_weights:
        return None
    n, last = plan.devices_per_stage, plan.pp - 1
    groups = [dist.new_group([p, last * n + p]) for p in range(n)]  # collective: all ranks, same order
    return groups[position] if partition.is_first or partition.is_last else None


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _gradient_mesh(meshes: MeshCache, plan: ParallelPlan, strategy: LayerStrategy):  # noqa: ANN202
    """The ranks over which a block's parameters are replicated (and its gradients summed).

    Ulysses keeps whole weights on every rank of the group, each seeing other sequence positions,
    so the group joins the data-parallel ranks: the whole stage.
    """
    if strategy.sp == "ulysses":
        return meshes.dp_mesh(Layout(plan.world_size, plan.pp, 1))
    return meshes.dp_mesh(Layout.of(plan, strategy))


def _relocate_inputs(
    block: nn.Module,
    source: ActivationLayout,
    target: ActivationLayout,
    micro_batch: _MicroBatch,
    position: int,
    group: dist.ProcessGroup,
    first: bool,
    extras_source: ActivationLayout,
):  # noqa: ANN202
    """Forward pre-hook: bring the block's inputs to the ``target`` layout.

    The hidden states (first tensor argument) move from ``source`` (the previous block's layout) along
    batch and sequence; other tensors whose first dimension is the local batch (masks, position
    tables, memory) move from ``extras_source`` (the vocabulary layout) along the batch only.
    Registered before recomputation so that recompute replays from already relocated inputs.
    """
    # Other inputs (masks, positions, an encoder's memory) are made outside the blocks and handed to every
    # block as they are: they always come from the vocabulary layout, whatever the previous block's was.
    batch_only_source = ActivationLayout(extras_source.layout)
    batch_only_target = ActivationLayout(target.layout)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if is_recomputing(module):
            return None
        hidden_index, hidden = next(((i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)), (None, None))
        if hidden is None:
            hidden = kwargs.get("hidden_states")
        if hidden is None:
            raise RuntimeError(f"{type(module).__name__} was called without a hidden-states tensor to relocate")
        if first:
            micro_batch.size = hidden.shape[0] * source.layout.dp  # the input layout's shards are even
        extras_batch = micro_batch.size // extras_source.layout.dp
        seq = source.global_seq(hidden.shape[1])
        slots = [*((i, a) for i, a in enumerate(args) if i != hidden_index), *kwargs.items()]
        slots = [(name, v) for name, v in slots if not (hidden_index is None and name == "hidden_states")]
        per_sample = {name for name, v in slots if _is_per_sample(name, v, extras_batch, seq, module)}
        if _extras_cross_ranks(batch_only_source, batch_only_target, micro_batch.size):
            _agree_on_per_sample_inputs(module, [name in per_sample for name, _ in slots], group)

        def move(name: Any, value: Any) -> Any:
            if name == "hidden":
                return relocate(value, source, target, micro_batch.size, position, group)
            if name in per_sample:
                return relocate(value, batch_only_source, batch_only_target, micro_batch.size, position, group)
            return value

        new_args = tuple(move("hidden" if i == hidden_index else i, a) for i, a in enumerate(args))
        new_kwargs = {k: move("hidden" if hidden_index is None and k == "hidden_states" else k, v) for k, v in kwargs.items()}
        return new_args, new_kwargs

    return block.register_forward_pre_hook(hook, with_kwargs=True)


def _is_per_sample(name: Any, value: Any, batch: int, seq: int, block: nn.Module) -> bool:
    """Whether a block input other than the hidden states holds one row per sample (and so moves with them).

    Batch-major tensors do (masks ``[b, ...]``, position tables ``[b, s, ...]``, an encoder's memory); a
    ``[seq, seq]`` mask over positions does not -- unless its name says it pads samples. With as many
    samples per shard as positions, a positional ``[seq, seq]`` input cannot be told apart: refuse.
    """
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != batch:
        return False
    if value.dim() == 2 and value.shape[1] == seq and batch == seq and "padding" not in str(name):
        raise PlanError(
            f"{model_class(block).__name__} received a [{seq}, {seq}] input ({name!r}) while each data shard holds "
            f"{batch} samples of {seq} positions: it could be a mask over positions or one row per sample. Pass a "
            "per-sample mask by a keyword with 'padding' in its name, or use a batch per shard other than the "
            "sequence length"
        )
    return True


_CROSSING: dict[tuple[ActivationLayout, ActivationLayout, int], bool] = {}


def _extras_cross_ranks(source: ActivationLayout, target: ActivationLayout, batch: int) -> bool:
    key = (source, target, batch)
    if key not in _CROSSING:
        _CROSSING[key] = any(t.source != t.target for t in exchange_plan(source, target, batch, 1))
    return _CROSSING[key]


def _agree_on_per_sample_inputs(block: nn.Module, present: list[bool], group: dist.ProcessGroup) -> None:
    """Ranks that exchange a block's per-sample inputs must all have them (else some would wait forever)."""
    flags = torch.tensor([int(p) for p in present] + [-int(p) for p in present], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    n = len(present)
    if any(flags[i] != -flags[n + i] for i in range(n)):  # max != min: some ranks have it, some do not
        raise PlanError(
            f"the ranks of a stage passed different inputs to {model_class(block).__name__}: some a per-sample "
            "tensor (e.g. an attention mask), others None. Hugging Face models drop the attention mask of a batch "
            "without padding: pass the mask on every batch (or pad every batch), or keep these blocks in the "
            "embedding's data-parallel layout"
        )


def _relocate_output(
    block: nn.Module,
    source: ActivationLayout,
    target: ActivationLayout,
    micro_batch: _MicroBatch,
    position: int,
    group: dist.ProcessGroup,
):  # noqa: ANN202
    """Forward hook on the last block: its hidden states back to the vocabulary layout."""

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return relocate(output, source, target, micro_batch.size, position, group)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            moved = relocate(output[0], source, target, micro_batch.size, position, group)
            return type(output)((moved, *output[1:]))
        raise RuntimeError(f"{type(module).__name__} returned {type(output).__name__}; expected the hidden states")

    return block.register_forward_hook(hook)


def input_shard(plan: ParallelPlan, rank: int) -> tuple[int, int]:
    """``(num_shards, shard_index)`` of the data this rank reads: the vocabulary layout's dp coordinates.

    Ranks of one tensor-parallel group (and of other pipeline stages at the same position) read the
    same shard.
    """
    layout = Layout.of(plan, plan.vocab)
    _, dp_rank, _ = layout.coordinates(rank)
    return layout.dp, dp_rank
