"""Execute a plan on a model: the recipe, one ``apply_*`` call per concern and block.

Reading order: check that the runtime can execute the plan exactly, then per block recompute and
data parallelism on the block's own mesh, then the vocabulary layers (everything outside the
blocks) as the FSDP root on the vocabulary layout. Parameter names never change.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, register_fsdp_forward_method

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.runtime.mesh import Layout, MeshCache
from lightning_galvatron.runtime.recompute import apply_recompute
from lightning_galvatron.runtime.sharding import apply_data_parallel


class NotSupportedYet(PlanError):
    """A valid plan that this version of the runtime cannot execute exactly."""


def check_runtime_support(plan: ParallelPlan, structure: ModelStructure) -> None:
    """Refuse, with the reason, any plan the runtime would not execute exactly."""
    if plan.num_layers != structure.num_blocks:
        lists = ", ".join(f"{bl.path} ({len(bl.blocks)} x {bl.block_type})" for bl in structure.block_lists)
        raise PlanError(
            f"the plan has {plan.num_layers} layer strategies but the model has {structure.num_blocks} blocks "
            f"({lists}); give one strategy per block"
        )
    if plan.pp > 1:
        raise NotSupportedYet(f"pipeline parallelism (pp={plan.pp}) is not supported yet; use pp=1")
    if plan.micro_batches > 1:
        raise NotSupportedYet(f"micro_batches={plan.micro_batches} without a pipeline is not supported yet; use 1")
    for where, strategy in [*((f"layers[{i}]", s) for i, s in enumerate(plan.layers)), ("vocab", plan.vocab)]:
        if strategy.tp > 1:
            raise NotSupportedYet(
                f"{where}: tensor/sequence parallelism (tp={strategy.tp}, sp={strategy.sp!r}) is not supported yet; "
                "use tp=1"
            )


def apply_plan(
    model: nn.Module,
    structure: ModelStructure,
    plan: ParallelPlan,
    meshes: MeshCache,
    mp_policy: MixedPrecisionPolicy,
    entry_methods: Sequence[str] = (),
) -> None:
    """Parallelise ``model`` in place as ``plan`` says.

    Args:
        model: the root module; it becomes the FSDP root holding the vocabulary layers.
        structure: the blocks of ``model`` (see :func:`~lightning_galvatron.model.discovery.find_blocks`).
        entry_methods: methods other than ``forward`` through which the root is run (e.g.
            ``training_step``); FSDP gathers the root's parameters around them.
    """
    check_runtime_support(plan, structure)
    for block, strategy in zip(structure.blocks, plan.layers):
        if strategy.recompute:
            apply_recompute(block)
        apply_data_parallel(block, strategy, meshes.dp_mesh(Layout.of(plan, strategy)), mp_policy)
    apply_data_parallel(model, plan.vocab, meshes.dp_mesh(Layout.of(plan, plan.vocab)), mp_policy)
    for name in entry_methods:
        register_fsdp_forward_method(model, name)


def input_shard(plan: ParallelPlan, rank: int) -> tuple[int, int]:
    """``(num_shards, shard_index)`` of the data this rank reads: the vocabulary layout's dp coordinates.

    Ranks of one tensor-parallel group (and of other pipeline stages at the same position) read the
    same shard.
    """
    layout = Layout.of(plan, plan.vocab)
    _, dp_rank, _ = layout.coordinates(rank)
    return layout.dp, dp_rank
