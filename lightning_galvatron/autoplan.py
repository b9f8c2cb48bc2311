"""``plan="auto"``: profile the model and the cluster, search the plan, agree on it everywhere.

Every rank profiles (collectively: the hardware profiler measures the live process groups; the
cache makes a second run nearly free), rank 0 searches, and the plan -- or the search's error --
is broadcast, so all ranks apply the same plan or all stop with the same message before anything
is changed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.profiles import Profile
from lightning_galvatron.units import format_bytes, parse_bytes

# Left free on a GPU for the CUDA context, the allocator's fragmentation and NCCL buffers.
CUDA_MEMORY_RESERVE = 0.05
# Share of a CPU machine's memory one process may plan for (the rest: OS, other processes, data).
CPU_MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class SearchSettings:
    """What ``GalvatronStrategy`` passes on to the search (see its arguments), checked when it is made.

    The strategy makes these in its constructor, so a wrong limit or budget stops the program before any
    process is launched or anything is profiled; the rules are the search's own (:class:`SearchOptions`).
    """

    memory_budget: int | str | None = None
    max_tp: int | None = None
    max_pp: int | None = None
    disable: Sequence[str] = ()
    schedules: Sequence[str] | None = None
    search_batch_size: bool = False
    max_global_batch_size: int | None = None
    profile_cache: bool | str | os.PathLike = True
    calibration: Any = None  # a Calibration, its dict or JSON file: price plans with the calibrated cost model

    def __post_init__(self) -> None:
        from lightning_galvatron.search.calibration import load_calibration
        from lightning_galvatron.search.space import SearchOptions

        # A single name is a list of one (YAML users write `disable: zero3`).
        for name in ("disable", "schedules"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.memory_budget is not None:
            try:
                budget = parse_bytes(self.memory_budget)
            except (TypeError, ValueError) as err:
                raise ValueError(f"memory_budget: {err}") from None
            if budget <= 0:
                raise ValueError(f"memory_budget must be a positive size such as '24GB', got {self.memory_budget!r}")
        SearchOptions(
            max_tp=self.max_tp,
            max_pp=self.max_pp,
            disable=frozenset(self.disable),
            schedules=self.schedules or SearchOptions().schedules,
        )
        value = self.max_global_batch_size
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"max_global_batch_size must be a positive integer or None, got {value!r}")
        if not isinstance(self.profile_cache, (bool, str, os.PathLike)):
            raise ValueError(f"profile_cache must be True, False or a directory, got {self.profile_cache!r}")
        object.__setattr__(self, "calibration", load_calibration(self.calibration))

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)


@dataclass
class AutoPlan:
    plan: ParallelPlan
    profile: Profile
    report: str  # the search's table and baselines (rank 0; empty elsewhere)
    memory_budget_bytes: int
    seconds: dict[str, float] = field(default_factory=dict)
    profile_cached: bool = False
    search_result: Any = None  # the search's SearchResult (rank 0; None elsewhere)
    search_arguments: dict[str, Any] = field(default_factory=dict)  # what the search was given (rank 0)


def device_memory(device: torch.device, processes_per_node: int) -> tuple[int, str]:
    """The memory one process can have at most, and where that figure comes from (for messages)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"{torch.cuda.get_device_name(device)} has {format_bytes(total)}"
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = physical // max(processes_per_node, 1)
    return share, f"this machine's {format_bytes(physical)} shared by {processes_per_node} processes is {format_bytes(share)} each"


def default_memory_budget(device: torch.device, processes_per_node: int) -> int:
    """The device's memory less a reserve on CUDA; a share of the machine's memory per process on CPU."""
    total, _ = device_memory(device, processes_per_node)
    return int(total * (1 - CUDA_MEMORY_RESERVE if device.type == "cuda" else CPU_MEMORY_SHARE))


def check_memory_budget(budget: int, device: torch.device, processes_per_node: int) -> None:
    """Refuse a budget above what a device (on CPU: the machine's share per process) has: plans made for it
    would be sized for memory that is not there."""
    total, where = device_memory(device, processes_per_node)
    if budget > total:
        raise ValueError(
            f"memory_budget={format_bytes(budget)} is more than a device has ({where}): a plan made for it would not "
            f"fit; give at most {format_bytes(total)}, or leave memory_budget out for the default "
            f"({format_bytes(default_memory_budget(device, processes_per_node))})"
        )


def optimizer_kind(optimizer: torch.optim.Optimizer | None) -> str:
    """The search's name for how many states per parameter an optimizer keeps."""
    if optimizer is None:
        return "adamw"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adamw"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd_momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
    return "adamw"  # unknown optimizers are planned like Adam (two states), the common worst case


def plan_automatically(
    module: nn.Module,
    structure: ModelStructure,
    example_batch: Any,
    *,
    world_size: int,
    devices_per_node: int,
    precision: str,
    global_batch_size: int,
    device: torch.device,
    settings: SearchSettings,
    optimizer: str = "adamw",
) -> AutoPlan:
    """Profile (all ranks), search (rank 0), broadcast. Raises the same :class:`PlanError` on every rank.

    On one device nothing communicates: the hardware profile holds only the device's memory, and the search
    chooses recomputation and micro-batches (gradient accumulation inside the step) to fit the budget.
    """
    from lightning_galvatron.profiler import profile
    from lightning_galvatron.search import search
    from lightning_galvatron.search.report import describe_search

    started = time.perf_counter()
    cache_info: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # training must not see its draws
        measured = profile(
            module,
            structure,
            example_batch,
            world_size=world_size,
            devices_per_node=devices_per_node,
            precision=precision,
            cache=settings.profile_cache,
            device=device,
            info=cache_info,
        )
    profiled = time.perf_counter()
    budget = settings.memory_budget_bytes or default_memory_budget(device, devices_per_node)
    # Pipelines cannot carry an encoder's output to decoder stages (see runtime.pipeline).
    max_pp = 1 if len(structure.block_lists) > 1 else settings.max_pp
    outcome: tuple[dict | None, str, str | None] = (None, "", None)
    arguments: dict[str, Any] = {
        "world_size": world_size,
        "memory_budget_bytes": budget,
        "global_batch_size": global_batch_size,
        "max_tp": settings.max_tp,
        "max_pp": max_pp,
        "disable": settings.disable,
        "schedules": settings.schedules,
        "optimizer": optimizer,
        "precision": precision,
        "search_batch_size": settings.search_batch_size,
        "max_global_batch_size": settings.max_global_batch_size,
        "calibration": settings.calibration,
    }
    result = None
    if dist.get_rank() == 0:
        try:
            result = search(measured, **arguments, baselines=world_size > 1)  # on one device every uniform plan is the same
            devices = f"{world_size} device{'s' if world_size > 1 else ''}"
            title = (
                f"Galvatron plan for {devices}, {format_bytes(budget)} per device, "
                f"global batch {result.global_batch_size}"
            )
            outcome = (result.plan.to_dict(), describe_search(result, title), None)
        except ValueError as error:  # infeasible budget, no valid plan: say it on every rank
            outcome = (None, "", str(error))
    holder = [outcome]
    dist.broadcast_object_list(holder, src=0)
    plan_dict, report, error = holder[0]
    if error is not None:
        raise PlanError(f"automatic plan search failed: {error}")
    assert plan_dict is not None
    return AutoPlan(
        plan=ParallelPlan.from_dict(plan_dict),
        profile=measured,
        report=report,
        memory_budget_bytes=budget,
        seconds={"profile": profiled - started, "search": time.perf_counter() - profiled},
        profile_cached=bool(cache_info.get("cached")),
        search_result=result,
        search_arguments=arguments,
    )
