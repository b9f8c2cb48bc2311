"""Execute a plan on a model: the recipe, one ``apply_*`` call per concern and block.

Reading order: check that the runtime can execute the plan exactly (:func:`check_runtime_support`,
called once by the strategy before the plan is printed); keep this rank's pipeline
stage only; then for every local block, the relocation of its input from the previous block's
layout, tensor or sequence parallelism on the block's group, compilation (if asked),
recomputation and data parallelism on the block's dp group; then the relocation of the last
block's output back to the vocabulary layout, vocabulary parallelism, the layers outside the
blocks as the FSDP root, and the runner that drives micro-batches and the pipeline schedule.
Parameter names never change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, register_fsdp_forward_method
from torch.utils.hooks import RemovableHandle

from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError
from lightning_galvatron.plan.layout import ActivationLayout, Layout
from lightning_galvatron.plan.rules import plan_problems
from lightning_galvatron.runtime.compile import apply_compile
from lightning_galvatron.runtime.gradient_sync import GradientReducer
from lightning_galvatron.runtime.mesh import MeshCache
from lightning_galvatron.runtime.model_facts import LiveModelFacts
from lightning_galvatron.runtime.pipeline import PipelineRunner, StagePartition
from lightning_galvatron.runtime.recompute import apply_recompute
from lightning_galvatron.runtime.relocate import BlockOutputs, MicroBatch, relocate_inputs, relocate_output
from lightning_galvatron.runtime.sharding import apply_data_parallel
from lightning_galvatron.runtime.structure import ModelStructure, OutsideLayers
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan, apply_tensor_parallel
from lightning_galvatron.runtime.ulysses import apply_ulysses
from lightning_galvatron.runtime.vocab_parallel import apply_vocab_parallel, find_vocabulary_layers


def check_runtime_support(
    plan: ParallelPlan,
    structure: ModelStructure,
    tp_plans: Sequence[BlockTensorParallelPlan | str],
    seq_length: int | None = None,
    compile_options: Mapping[str, Any] | None = None,
) -> None:
    """Refuse, with the reason, any plan the runtime would not execute exactly (the first of
    :func:`runtime_problems`). Callers check before the plan is printed; :func:`apply_plan` checks again, with the
    ``torch.compile`` arguments, before anything is changed.

    ``tp_plans``: each block's tensor-parallel plan, or why it has none (resolved by the caller: see
    :func:`~lightning_galvatron.model.tensor_parallel_plans.block_tensor_parallel_plans`).
    """
    if plan.num_layers != structure.num_blocks:
        lists = ", ".join(f"{bl.path} ({len(bl.blocks)} x {bl.block_type})" for bl in structure.block_lists)
        raise PlanError(
            f"the plan has {plan.num_layers} layer strategies but the model has {structure.num_blocks} blocks "
            f"({lists}); give one strategy per block"
        )
    problems = runtime_problems(plan, structure, tp_plans, seq_length, compile_options)
    if problems:
        raise PlanError(problems[0])


def runtime_problems(
    plan: ParallelPlan,
    structure: ModelStructure,
    tp_plans: Sequence[BlockTensorParallelPlan | str],
    seq_length: int | None = None,
    compile_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Why the runtime would refuse ``plan`` for this model, each with where (empty: it executes it exactly): the
    one whole-plan check (:func:`~lightning_galvatron.plan.rules.plan_problems`) over the live model's facts
    (:class:`~lightning_galvatron.runtime.model_facts.LiveModelFacts`). Pure: nothing is changed or communicated."""
    return plan_problems(plan, LiveModelFacts(structure, tp_plans, seq_length, compile_options))


@dataclass
class AppliedPlan:
    """What the strategy needs after the plan is applied."""

    plan: ParallelPlan
    input_shards: int  # data shards of the input layout: the loss of each is scaled by 1 / input_shards
    hooks: list[RemovableHandle] = field(default_factory=list)
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
    tp_plans: Sequence[BlockTensorParallelPlan | str] = (),
    compile_options: Mapping[str, Any] | None = None,
    place: Callable[[nn.Module], None] | None = None,
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
        compile_options: ``torch.compile`` arguments to compile each block with (see :mod:`.compile`).
        tp_plans: each block's tensor-parallel plan or why it has none (one per block; needed where tp > 1).
        place: puts the split model where it trains (materialise meta weights, move to the device), before the
            gradient hooks of ddp layers are installed. Moving a module swaps its DTensor parameters
            (``torch.utils.swap_tensors``), and a swapped parameter's post-accumulate-grad hooks no longer fire:
            moved afterwards, every gradient of a model whose trainable parameters are all DTensors went unsummed
            (OLMo under tensor parallelism), and the others were summed only at the end of backward.
    """
    tp_plans = list(tp_plans) or ["no tensor-parallel plans were given"] * structure.num_blocks
    if len(tp_plans) != structure.num_blocks:
        raise ValueError(f"tp_plans has {len(tp_plans)} entries for {structure.num_blocks} blocks")
    check_runtime_support(plan, structure, tp_plans, compile_options=compile_options)
    rank = dist.get_rank()
    stage = Layout.stage(plan)
    # Creating a mesh is collective over all ranks; a pipeline stage only uses its own blocks' layouts,
    # so every rank creates every layout of the plan first, in the same order.
    for layout in dict.fromkeys([stage, *(Layout.of(plan, s) for s in (plan.vocab, *plan.layers))]):
        meshes.mesh(layout)
    stage_group = meshes.dp_mesh(stage).get_group()
    position = rank % plan.devices_per_stage
    micro_batch = MicroBatch()
    vocab_layout = ActivationLayout.of(plan, plan.vocab)
    layouts = [ActivationLayout.of(plan, s) for s in plan.layers]
    applied = AppliedPlan(plan, input_shards=vocab_layout.layout.dp)
    all_blocks = structure.blocks
    starts, ends = _block_list_bounds(structure)  # before a pipeline stage removes other stages' blocks
    _disable_nested_tensors(structure)
    vocabulary = find_vocabulary_layers(structure) if plan.vocab.tp > 1 else None

    local_blocks: Sequence[int] = range(plan.num_layers)
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
    # Where every block keeps the vocabulary layout (data parallel and ZeRO plans), nothing ever moves: the
    # hooks would only cost Python on every call, so none are installed.
    relocating = any(layout != vocab_layout for layout in layouts)
    outputs = BlockOutputs()
    for index in local_blocks:
        block, strategy = all_blocks[index], plan.layers[index]
        given = tp_plans[index]
        tp_plan = given if isinstance(given, BlockTensorParallelPlan) else None
        source = vocab_layout if index in starts else layouts[index - 1]
        if relocating:
            applied.hooks += relocate_inputs(
                block,
                source,
                layouts[index],
                micro_batch,
                position,
                stage_group,
                first=index == 0,
                extras_source=vocab_layout,
                carried=outputs.of(index - 1) if index not in starts else None,
                folded=tp_plan.folded_inputs if tp_plan is not None else {},
                shared=tp_plan.shared_inputs if tp_plan is not None else frozenset(),
                positions=tp_plan.position_inputs if tp_plan is not None else {},
            )
            applied.hooks.append(outputs.record(block, index))
        layout = Layout.of(plan, strategy)
        if strategy.sp == "ulysses":
            apply_ulysses(
                block, meshes.tp_mesh(layout).get_group(), tp_plan.position_inputs if tp_plan is not None else None
            )
        elif strategy.tp > 1:
            assert tp_plan is not None  # checked above
            apply_tensor_parallel(block, tp_plan.styles(strategy.sp == "megatron"), meshes.tp_mesh(layout))
            tp_plan.localize(block, strategy.tp)
        if compile_options is not None:
            apply_compile(block, compile_options)
        if strategy.recompute:
            apply_recompute(block)
        apply_data_parallel(block, strategy, _gradient_mesh(meshes, plan, strategy), mp_policy, applied.gradients)
    for end in ends:
        if relocating and end in local_blocks:
            applied.hooks.append(
                relocate_output(all_blocks[end], layouts[end], vocab_layout, micro_batch, position, stage_group)
            )

    if vocabulary is not None and plan.vocab.tp > 1:
        vocab_tp_mesh = meshes.tp_mesh(Layout.of(plan, plan.vocab))
        apply_vocab_parallel(vocabulary.present_in(model), vocab_tp_mesh, parallel_loss, root=model)
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
    if place is not None:
        place(model)
    applied.gradients.build(order_group=stage_group)  # the stage agrees on the ready order of its buckets
    tied_group = _tied_weights_group(plan, applied.partition, position)
    if tied_group is not None:
        partition = applied.partition
        assert partition is not None  # only a pipeline stage has weights tied to another
        applied.gradients.add_shared(lambda: partition.tied, tied_group)

    if plan.pp > 1 or plan.micro_batches > 1:
        applied.runner = PipelineRunner(
            plan,
            applied.partition,
            applied.pipeline_group,
            _device_of(model),
            set_micro_batch_size=micro_batch.start,
            input_shards=applied.input_shards,
            boundary_shape=lambda block, batch, seq: layouts[block].local_shape(position, batch, seq),
            hidden_width=outside_layers.hidden_widths.__getitem__ if outside_layers is not None else None,
        )
    return applied


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


def _tied_weights_group(
    plan: ParallelPlan, partition: StagePartition | None, position: int
) -> dist.ProcessGroup | None:
    """First and last stage ranks at this position, when they share weights (created on every rank)."""
    if partition is None or not partition.has_tied_weights:
        return None
    n, last = plan.devices_per_stage, plan.pp - 1
    groups = [dist.new_group([p, last * n + p]) for p in range(n)]  # collective: all ranks, same order
    return groups[position] if partition.is_first or partition.is_last else None


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _gradient_mesh(meshes: MeshCache, plan: ParallelPlan, strategy: LayerStrategy) -> DeviceMesh:
    """The ranks over which a block's parameters are replicated (and its gradients summed).

    Ulysses keeps whole weights on every rank of the group, each seeing other sequence positions,
    so the group joins the data-parallel ranks: the whole stage.
    """
    if strategy.sp == "ulysses":
        return meshes.dp_mesh(Layout.stage(plan))
    return meshes.dp_mesh(Layout.of(plan, strategy))


def input_shard(plan: ParallelPlan, rank: int) -> tuple[int, int]:
    """``(num_shards, shard_index)`` of the data this rank reads: the vocabulary layout's dp coordinates.

    Ranks of one tensor-parallel group (and of other pipeline stages at the same position) read the
    same shard.
    """
    layout = Layout.of(plan, plan.vocab)
    _, dp_rank, _ = layout.coordinates(rank)
    return layout.dp, dp_rank


def input_shard_group(plan: ParallelPlan, meshes: MeshCache) -> dist.ProcessGroup:
    """The ranks that read this rank's data shard: every stage and tensor-parallel rank at its dp coordinate of the
    vocabulary layout, in mesh order. Collective the first time (the mesh caches it)."""
    return meshes.mesh(Layout.of(plan, plan.vocab))["pp", "tp"]._flatten().get_group()
