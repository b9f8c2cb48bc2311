"""Is the plan really applied? Every rank's parameters, blocks and process groups against the plan.

Parity with one process would still hold if the runtime silently replicated everything, so the
parity runs also check, on every rank (:func:`assert_plan_applied`, called in the workers after
``fit``):

- which blocks the rank holds: those of its pipeline stage's chunks, and only those;
- per parameter: its global shape, which mesh dimensions shard it and over which ranks -- the
  block's tensor-parallel group for the weights its tensor-parallel plan splits, its data-parallel
  group under ZeRO-2/3 -- and that the shards over those ranks add up to the whole tensor exactly
  once (a replicated parameter would add up to several copies);
- per block: the ranks its DDP gradients are summed over, its Ulysses group, recomputation.

The expected groups come from the plan with this module's own arithmetic (a stage owns ``n = W/pp``
consecutive ranks; ``tp`` ranks adjacent, or ``dp`` apart when strided), not from the runtime's
``Layout``, so a wrong layout in the runtime cannot agree with itself here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.families._common import Compose
from lightning_galvatron.model.tensor_parallel_plans import tensor_parallel_plan
from lightning_galvatron.plan import LayerStrategy, ParallelPlan
from lightning_galvatron.runtime.mesh import local_tensor
from lightning_galvatron.runtime.multihead_attention import ParallelMultiheadAttention
from lightning_galvatron.runtime.tensor_parallel import (
    ColwiseEmbedding,
    ColwiseFused,
    CopyOutput,
    GatherSequence,
    RowwiseFused,
    SliceHeads,
    SplitPerHead,
)
from lightning_galvatron.runtime.ulysses import ulysses_group
from lightning_galvatron.runtime.vocab_parallel import find_vocabulary_layers


# ---------------------------------------------------------------------------------------------- what a rank holds
def describe_rank(strategy: Any) -> dict[str, Any]:
    """This rank's parameters (global shape, local size, sharded mesh dimensions and their ranks, DDP group) and
    blocks (recomputed, Ulysses group), read from the parallelised model."""
    module, applied = strategy.lightning_module, strategy.applied
    for sub in module.modules():  # ZeRO-2 blocks stay unsharded after a forward without backward (validation)
        if isinstance(sub, FSDPModule):
            sub.reshard()
    params = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        sharded, replicated = {}, {}
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            for dim, placement in zip(mesh.mesh_dim_names, p.placements):
                ranks = tuple(dist.get_process_group_ranks(mesh.get_group(dim)))
                (replicated if isinstance(placement, Replicate) else sharded)[dim] = ranks
        group = applied.gradients.group_of(p)
        params[name] = dict(
            shape=tuple(p.shape),
            local_numel=local_tensor(p).numel(),
            sharded=sharded,
            replicated=replicated,
            ddp=tuple(dist.get_process_group_ranks(group)) if group is not None else None,
        )
    blocks = {}
    for block_list in strategy.structure.block_lists:
        for key, block in block_list.container._modules.items():
            group = ulysses_group(block)
            blocks[f"{block_list.path}.{key}"] = dict(
                recompute=checkpoint.state(block) is not None,
                ulysses=tuple(dist.get_process_group_ranks(group)) if group is not None else None,
            )
    return dict(params=params, blocks=blocks, relocation_hooks=len(applied.hooks))


# ---------------------------------------------------------------------------------------------- what the plan says
def groups(plan: ParallelPlan, strategy: LayerStrategy, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tensor-parallel group, data-parallel group) of ``rank`` for a layer with ``strategy``."""
    n = plan.world_size // plan.pp
    first, position = divmod(rank, n)
    first *= n
    tp, dp = strategy.tp, n // strategy.tp
    if strategy.tp_consecutive or tp in (1, n):
        start = first + position // tp * tp
        return tuple(range(start, start + tp)), tuple(first + position % tp + k * tp for k in range(dp))
    start = first + position // dp * dp
    return tuple(first + position % dp + j * dp for j in range(tp)), tuple(range(start, start + dp))


def _split_parameters(style: ParallelStyle, layer: nn.Module) -> set[str] | None:
    """Which of ``layer``'s parameters a style splits over the tensor-parallel group (the others stay whole): what
    each style promises -- a fused projection's bias, a row-wise layer's bias and ``nn.MultiheadAttention``'s
    fused bias and output bias are kept whole on every rank. ``None`` for a style this check does not know."""
    if isinstance(style, (SequenceParallel, PrepareModuleInput, GatherSequence, SliceHeads, CopyOutput)):
        return set()  # they move or copy activations only
    if isinstance(style, Compose):
        parts = [_split_parameters(s, layer) for s in style.styles]
        return None if None in parts else set().union(*parts)
    if isinstance(style, ColwiseParallel):
        names = {"weight", "bias"}
    elif isinstance(style, (RowwiseParallel, RowwiseFused)):
        names = {"weight"}
    elif isinstance(style, ColwiseFused):  # split as a DTensor when every section is split evenly, else kept whole
        strided = all(style.split) and len(set(style.sections)) == 1
        names = ({"weight", "bias"} if len(style.sections) == 1 else {"weight"}) if strided else set()
    elif isinstance(style, SplitPerHead):
        return {name for name, p in layer.named_parameters(recurse=False)}
    elif isinstance(style, ColwiseEmbedding):
        names = {"weight"}
    elif isinstance(style, ParallelMultiheadAttention):
        names = {"in_proj_weight", "out_proj.weight"}
    else:
        return None
    return {n for n, _ in layer.named_parameters()} & names


def _split_by_tensor_parallelism(block: nn.Module, prefix: str, sequence_parallel: bool) -> tuple[set[str], set[str]]:
    """Names of the parameters the block's tensor-parallel plan splits, and of those under styles this check
    does not know (their split is taken as found; its group is still checked)."""
    plan = tensor_parallel_plan(block)
    split, unknown = set(), set()
    for path, style in (plan.styles(sequence_parallel) if plan is not None else {}).items():
        layer = block.get_submodule(path)
        names = _split_parameters(style, layer)
        if names is None:
            unknown |= {f"{prefix}.{path}.{n}" for n, _ in layer.named_parameters()}
        else:
            split |= {f"{prefix}.{path}.{n}" for n in names}
    return split, unknown


def assert_plan_applied(strategy: Any, reference: Callable[[], nn.Module]) -> None:
    """Gather every rank's :func:`describe_rank` and compare it with the plan (on rank 0; collective).

    ``reference`` builds the unparallelised model (its parameter shapes and blocks are the expectation).
    """
    described: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(described, describe_rank(strategy))
    if dist.get_rank() != 0:
        return
    plan: ParallelPlan = strategy.plan
    model = reference()
    structure = find_blocks(model, [bl.path for bl in strategy.structure.block_lists])
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    n = plan.world_size // plan.pp
    stage_of_block = {i: c % plan.pp for c in range(plan.pp * plan.virtual_stages) for i in plan.chunk_layers(c)}
    errors: list[str] = []

    def expect(condition: bool, message: str) -> None:
        if not condition:
            errors.append(message)

    def check_parameter(name: str, rank: int, layer: LayerStrategy, split: bool | None) -> None:
        d = described[rank]["params"][name]
        split = "tp" in d["sharded"] if split is None else split
        tp_group, dp_group = groups(plan, layer, rank)
        ulysses = layer.sp == "ulysses"
        gradient_group = tuple(range(rank // n * n, rank // n * n + n)) if ulysses else dp_group
        expected = {}
        if split and not ulysses and len(tp_group) > 1:
            expected["tp"] = tp_group
        if layer.dp_type != "ddp" and len(gradient_group) > 1:
            expected["dp"] = gradient_group
        actual = {dim: ranks for dim, ranks in d["sharded"].items() if len(ranks) > 1}
        where = f"rank {rank} {name}"
        expect(d["shape"] == shapes[name], f"{where}: global shape {d['shape']}, the model's is {shapes[name]}")
        expect(actual == expected, f"{where}: sharded over {actual}, the plan says {expected}")
        for dim, ranks in d["replicated"].items():
            expect(dim != "tp" or ranks == tp_group, f"{where}: replicated over tp ranks {ranks}, not {tp_group}")
        # A frozen parameter (Whisper's sinusoidal positions) has no gradient to sum.
        ddp = gradient_group if layer.dp_type == "ddp" and len(gradient_group) > 1 and name not in frozen else None
        expect(d["ddp"] == ddp, f"{where}: DDP gradients summed over {d['ddp']}, the plan says {ddp}")
        holders = set(expected.get("tp", (rank,))) | set(expected.get("dp", (rank,)))
        if "tp" in expected and "dp" in expected:  # a 2-D shard: one copy over the tp x dp grid
            holders = {r for t in expected["tp"] for r in groups(plan, layer, t)[1]}
        total = sum(described[r]["params"][name]["local_numel"] for r in holders)
        numel = _numel(shapes[name])
        expect(total == numel, f"{name}: the shards on ranks {sorted(holders)} hold {total} elements, not {numel}")

    # Without tensor or sequence parallelism every activation stays in the data-parallel layout: nothing to move, so
    # no relocation hook should run on every call.
    if all(s.tp == 1 for s in (plan.vocab, *plan.layers)):
        for rank, d in enumerate(described):
            expect(d["relocation_hooks"] == 0, f"rank {rank}: {d['relocation_hooks']} relocation hooks, nothing moves")

    # Blocks: on the ranks of their stage only, split and synchronised as their strategies say.
    in_blocks = set()
    for index, (block_name, block) in enumerate(zip(structure.block_names, structure.blocks)):
        layer = plan.layers[index]
        stage = stage_of_block[index]
        split, unknown = set(), set()
        if layer.tp > 1:
            split, unknown = _split_by_tensor_parallelism(block, block_name, layer.sp == "megatron")
        names = [f"{block_name}.{n}" for n, _ in block.named_parameters()]
        in_blocks.update(names)
        for rank in range(plan.world_size):
            held = block_name in described[rank]["blocks"]
            verb = "holds" if held else "lacks"
            expect(held == (rank // n == stage), f"rank {rank} {verb} {block_name} of stage {stage}")
            if not held:
                continue
            b = described[rank]["blocks"][block_name]
            where = f"rank {rank} {block_name}"
            expect(b["recompute"] == layer.recompute, f"{where}: recompute {b['recompute']}")
            ulysses = groups(plan, layer, rank)[0] if layer.sp == "ulysses" else None
            expect(b["ulysses"] == ulysses, f"{where}: Ulysses group {b['ulysses']}, the plan says {ulysses}")
            for name in names:
                check_parameter(name, rank, layer, None if name in unknown else name in split)

    # The layers outside the blocks: on at least one rank (pipelines: the end stages), as the vocab strategy says.
    vocabulary = find_vocabulary_layers(structure) if plan.vocab.tp > 1 else None
    split_tensors = []  # the embedding's rows, the head's output rows (weight and bias)
    if vocabulary is not None:
        for layer in (vocabulary.embedding, vocabulary.head):
            split_tensors += [getattr(layer, n) for n in ("weight", "bias") if getattr(layer, n, None) is not None]
    split = {n for n, p in model.named_parameters(remove_duplicate=False) if any(p is t for t in split_tensors)}
    for name in shapes.keys() - in_blocks:
        holders = [r for r in range(plan.world_size) if name in described[r]["params"]]
        expect(bool(holders) or _tied_elsewhere(model, name, described), f"{name} is held by no rank")
        for rank in holders:
            check_parameter(name, rank, plan.vocab, name in split)
    assert not errors, "the plan is not applied as it says:\n" + "\n".join(errors[:40])


def _tied_elsewhere(model: nn.Module, name: str, described: list[Any]) -> bool:
    """A tied weight is named once per holder; a stage may hold it under the other name only."""
    target = dict(model.named_parameters(remove_duplicate=False))[name]
    aliases = [n for n, p in model.named_parameters(remove_duplicate=False) if p is target]
    return any(alias in d["params"] for alias in aliases for d in described)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
