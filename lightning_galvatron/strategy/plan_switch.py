"""Moving a model that is training into another plan, in memory, between two optimizer steps.

What a checkpoint and a resume into another plan do through files (:mod:`lightning_galvatron.strategy.checkpoint`), done
without them; :mod:`lightning_galvatron.strategy.replan` decides when.

- :class:`ModuleBlueprint`: the module's structure as it was before the first plan was applied -- its children, own
  parameters and buffers deep-copied with every parameter and persistent buffer on the meta device (no memory; the
  values come from the training state). The LightningModule stays the same object (the Trainer, the callbacks and
  the user's code hold it): what the last plan attached to it (FSDP's class and hooks on the root, wrapped step
  methods) is taken off and it gets fresh children, to which the runtime applies the new plan as in ``setup``.
  torchmetrics ``Metric`` objects are kept as they are, with the epoch's states.
- :func:`gather_whole_state` / :func:`load_whole_state`: parameters and optimizer states by name, gathered whole to
  the host (one tensor at a time on the device), handed between pipeline stages where the new plan places a tensor
  on a rank that did not hold it, and loaded into the new plan's shards with DCP's state-dict API -- the same
  ``set_model_state_dict`` / ``set_optimizer_state_dict`` a resume calls. The optimizers stay the same objects (their
  parameter groups are given the new parameters), so Lightning's schedulers and references stay valid.
- :class:`CarriedShards`: the data loaders keep the old plan's sharding until Lightning makes them again; every step
  then regroups its samples into the new plan's data shards (one all-gather of the batch), in the order a loader
  made for the new plan would give them: ``DistributedSampler`` gives shard ``s`` of ``n`` the samples ``s, s + n,
  ...`` of the step's block, so the global batch of every step is the same whatever the plan.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torchmetrics import Metric

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.runtime.apply import input_shard
from lightning_galvatron.runtime.mesh import collective_device
from lightning_galvatron.strategy.data import DataShards


# ---------------------------------------------------------------------------------------------- the module
def _root_marks(module: nn.Module) -> tuple[set[str], dict[str, set[Any]]]:
    """The root's attribute names and the keys of each of its hook dicts (``_forward_pre_hooks``, ...)."""
    state = vars(module)
    return set(state), {
        name: set(value) for name, value in state.items() if "hooks" in name and isinstance(value, dict)
    }


class ModuleBlueprint:
    """The structure of ``module`` before any plan: taken in ``setup`` right before the first plan is applied."""

    def __init__(self, module: nn.Module) -> None:
        self.cls = type(module)
        memo: dict[int, Any] = {id(module): module}  # a child's reference to the root stays the root
        for param in module.parameters():
            memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and name not in sub._non_persistent_buffers_set:
                    memo[id(buffer)] = torch.empty_like(buffer, device="meta")
        self._parts = copy.deepcopy(
            {"_modules": module._modules, "_parameters": module._parameters, "_buffers": module._buffers}, memo
        )
        self._non_persistent = set(module._non_persistent_buffers_set)
        self._added: tuple[set[str], dict[str, set[Any]]] = (set(), {})

    @contextmanager
    def tracking(self, module: nn.Module) -> Iterator[None]:
        """Record what a plan's application adds to the root (attributes, hooks), to take it off again."""
        keys, hooks = _root_marks(module)
        yield
        after_keys, after_hooks = _root_marks(module)
        self._added = (after_keys - keys, {name: ids - hooks.get(name, set()) for name, ids in after_hooks.items()})

    def install(self, module: nn.Module) -> None:
        """Take the last plan off the root and give it fresh, unparallelised children (meta weights)."""
        import torch.distributed._composable_state as composable

        parts = copy.deepcopy(self._parts, {id(module): module})
        _keep_metrics(parts["_modules"], module)
        keys, hooks = self._added
        for key in keys:
            module.__dict__.pop(key, None)
        for name, ids in hooks.items():
            for key in ids:
                getattr(module, name, {}).pop(key, None)
        module.__class__ = self.cls  # FSDP swaps the root's class for a subclass of it
        # FSDP registers each module it wraps in a process-wide map and refuses to wrap one twice; the module's old
        # state goes with the old children (torch has no public call that unwraps a module).
        getattr(composable, "_module_state_mapping", {}).pop(module, None)
        module.__dict__.update(parts)
        module._non_persistent_buffers_set = set(self._non_persistent)
        self._added = (set(), {})


def _keep_metrics(fresh: dict[str, nn.Module | None], live: nn.Module) -> None:
    """Where the live model has a torchmetrics ``Metric`` at a fresh copy's place, keep the live one: it carries no
    plan, and its state (the epoch's so far) is no parameter."""
    for name, copied in list(fresh.items()):
        kept = live._modules.get(name)
        if copied is None or kept is None or type(kept) is not type(copied):
            continue
        if isinstance(kept, Metric):
            fresh[name] = kept
        else:
            _keep_metrics(copied._modules, kept)


# ---------------------------------------------------------------------------------------------- the state
@dataclass
class WholeState:
    """This rank's parameters and optimizer states, each whole, on the host; keyed ``("model", name)`` and
    ``(optimizer index, name, state)``. ``groups[i]``: each parameter group of optimizer ``i``, its names over all
    ranks (a pipeline stage knows its own) and its hyper-parameters."""

    tensors: dict[tuple, Any] = field(default_factory=dict)
    groups: list[list[tuple[set[str], dict[str, Any]]]] = field(default_factory=list)


def _whole(value: Any) -> Any:
    """A tensor whole on the host (collective for a DTensor: every rank of its mesh, in the same order)."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def whole_state_bytes(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """What :func:`gather_whole_state` will hold on this rank's host: its parameters and states, whole."""
    params = [p for p in model.parameters()]
    states = [v for o in optimizers for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in (*params, *states))  # a DTensor's numel is its whole size


def host_memory_available() -> int | None:
    """Bytes the host can still give (``MemAvailable`` on Linux), ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gather_whole_state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> WholeState:
    """Collective: every parameter and optimizer state of ``model`` as the plan holds it now, whole, by name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = WholeState()
    for name, value in get_model_state_dict(model).items():
        state.tensors[("model", name)] = _whole(value)
    for index, optimizer in enumerate(optimizers):
        saved = get_optimizer_state_dict(model, optimizer)
        for name, values in saved["state"].items():
            for key, value in values.items():
                state.tensors[(index, name, key)] = _whole(value)
        local = [list(group["params"]) for group in saved["param_groups"]]
        everywhere: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, local)  # a pipeline stage names only its own parameters
        state.groups.append(
            [
                ({name for rank in everywhere for name in rank[g]}, {k: v for k, v in group.items() if k != "params"})
                for g, group in enumerate(saved["param_groups"])
            ]
        )
    return state


def _names_of(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def give_new_parameters(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], groups: list[list[tuple[set[str], dict]]]
) -> None:
    """Each optimizer's parameter groups hold the new plan's parameters of the same names (in the model's order)."""
    names = _names_of(model)
    params = dict.fromkeys(p for p in model.parameters())
    for optimizer, optimizer_groups in zip(optimizers, groups):
        optimizer.state.clear()
        for group, (members, _) in zip(optimizer.param_groups, optimizer_groups):
            group["params"] = [p for p in params if any(n in members for n in names[id(p)])]


def _exchange(tensors: dict[tuple, Any], needed: set[str]) -> None:
    """Give this rank the entries of ``tensors`` it lacks whose name (``key[1]``) is in ``needed``, from the lowest
    rank that holds each (collective; nothing moves where every rank holds what it needs, as without a pipeline)."""
    specs = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v) for k, v in tensors.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (specs, needed))
    rank, device = dist.get_rank(), collective_device()
    anywhere = {key for held, _ in everyone for key in held}
    missing = sorted({k for held, wants in everyone for k in anywhere if k[1] in wants and k not in held}, key=repr)
    for key in missing:
        source = next(r for r, (held, _) in enumerate(everyone) if key in held)
        spec = everyone[source][0][key]
        if spec[0] == "value":
            value: Any = spec[1]
        else:
            buffer = tensors[key].to(device) if rank == source else torch.empty(spec[0], dtype=spec[1], device=device)
            dist.broadcast(buffer, source)
            value = buffer.cpu()
        if key[1] in needed and key not in tensors:
            tensors[key] = value


def load_whole_state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], state: WholeState) -> None:
    """Collective: load ``state`` into ``model`` as parallelised now (its weights allocated, values not yet set) and
    into ``optimizers`` (given the new parameters by :func:`give_new_parameters`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    local = set(get_model_state_dict(model))
    names = _names_of(model)
    in_groups = {n for o in optimizers for g in o.param_groups for p in g["params"] for n in names[id(p)]}
    _exchange(state.tensors, local | in_groups)
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, {name: state.tensors[("model", name)] for name in local}, options=whole)
    for index, optimizer in enumerate(optimizers):
        states: dict[str, dict[str, Any]] = {}
        for key, value in state.tensors.items():
            if key[0] == index and key[1] in in_groups:
                states.setdefault(key[1], {})[key[2]] = value
        groups = [{**hyper, "params": sorted(members)} for members, hyper in state.groups[index]]
        set_optimizer_state_dict(
            model,
            optimizer,
            {"state": states, "param_groups": groups},
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        for group in optimizer.param_groups:  # DCP creates a state for every parameter: keep those there were
            for param in group["params"]:
                if not any(name in states for name in names[id(param)]):
                    optimizer.state.pop(param, None)


# ---------------------------------------------------------------------------------------------- the data
class CarriedShards(DataShards):
    """The new plan's data shards while the loaders of some stages still shard by the plan they were made for
    (``made_with``); :meth:`regroup` gives each step the samples its shard of the new plan reads."""

    def __init__(
        self, plan: ParallelPlan, rank: int, meshes: Any, device: torch.device, made_with: dict[Any, ParallelPlan]
    ) -> None:
        super().__init__(plan, rank, meshes, device)
        self.made_with = {stage: old for stage, old in made_with.items() if not same_data_shards(old, plan)}

    def process_dataloader(self, dataloader: object, stage: Any) -> object:
        self.made_with.pop(stage, None)  # Lightning made this stage's loader again: it reads the new plan's shards
        return super().process_dataloader(dataloader, stage)

    def regroup(self, batch: Any, stage: Any) -> Any:
        old = self.made_with.get(stage)
        return batch if old is None else regroup_batch(batch, old, self.plan, self.rank)


def same_data_shards(a: ParallelPlan, b: ParallelPlan) -> bool:
    """Whether every rank reads the same data shard under both plans."""
    return a.world_size == b.world_size and all(input_shard(a, r) == input_shard(b, r) for r in range(a.world_size))


def regroupable(batch: Any) -> str | None:
    """Why the samples of ``batch`` cannot be regrouped between data shards, or ``None``: every leaf a tensor with a
    batch dimension or a value without one (nothing to split)."""
    leaves, _ = tree_flatten(batch)
    sizes = {int(x.shape[0]) for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) > 1:
        return f"its tensors differ in their first (batch) dimension ({sorted(sizes)})"
    if not sizes:
        return "it holds no tensor with a batch dimension"
    return None


def regroup_batch(batch: Any, old: ParallelPlan, new: ParallelPlan, rank: int) -> Any:
    """Collective: this rank's batch of ``new``'s data shards, made of the batches every rank read for ``old``'s."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, batch))
    parts: dict[int, Any] = {}
    for r, part in enumerate(gathered):
        parts.setdefault(input_shard(old, r)[1], part)  # the ranks of a shard read the same
    return regrouped([parts[s] for s in sorted(parts)], *input_shard(new, rank))


def regrouped(parts: Sequence[Any], num_shards: int, shard: int) -> Any:
    """Shard ``shard`` of ``num_shards`` of the samples of ``parts`` (the batches of shards ``0, 1, ...`` of a step).

    Sample ``j`` of shard ``s`` of ``n`` is sample ``j * n + s`` of the step's samples (``DistributedSampler``'s
    order); the new shard ``t`` of ``m`` takes the samples ``t, t + m, ...`` of them. Leaves without a batch dimension
    are taken from the first part."""
    flats = [tree_flatten(part) for part in parts]
    columns = []
    for column in zip(*(flat for flat, _ in flats)):
        first = column[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            starts = [sum(t.shape[0] for t in column[:s]) for s in range(len(column))]
            order = sorted((j, s) for s, t in enumerate(column) for j in range(t.shape[0]))
            joined = torch.cat(column)[torch.tensor([starts[s] + j for j, s in order], dtype=torch.long)]
            columns.append(joined[shard::num_shards])
        else:
            columns.append(first)
    return tree_unflatten(columns, flats[0][1])


__all__ = [
    "CarriedShards",
    "ModuleBlueprint",
    "WholeState",
    "gather_whole_state",
    "give_new_parameters",
    "host_memory_available",
    "load_whole_state",
    "regroup_batch",
    "regroupable",
    "regrouped",
    "same_data_shards",
    "whole_state_bytes",
]
