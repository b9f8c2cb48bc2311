"""``plan="auto"``: profile the model and the cluster, search the plan, agree on it everywhere.

Every rank profiles (collectively: the hardware profiler measures the live process groups; the
cache makes a second run nearly free), rank 0 searches, and the plan -- or the search's error --
is broadcast, so all ranks apply the same plan or all stop with the same message before anything
is changed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.model.outside_layers import pipeline_loop_problem
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search.engine import SearchResult
from lightning_galvatron.search.estimate import Estimate
from lightning_galvatron.strategy.token_means import has_ignored_labels
from lightning_galvatron.units import format_bytes, parse_bytes

# Left free on a GPU for the CUDA context, the allocator's fragmentation and NCCL buffers.
CUDA_MEMORY_RESERVE = 0.05
# Share of a CPU machine's memory one process may plan for (the rest: OS, other processes, data).
CPU_MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class SearchSettings:
    """What ``GalvatronStrategy`` passes on to the search (see its arguments), checked when it is made.

    The strategy makes these in its constructor, so a wrong limit or budget stops the program before any
    process is launched or anything is profiled. The knobs are one
    :class:`~lightning_galvatron.search.options.SearchOptions`, passed to the search whole.
    """

    memory_budget: int | str | None = None
    profile_cache: bool | str | os.PathLike = True
    options: Any = None  # a SearchOptions (None: the defaults)

    def __post_init__(self) -> None:
        from lightning_galvatron.search.options import SearchOptions

        if self.memory_budget is not None:
            try:
                budget = parse_bytes(self.memory_budget)
            except (TypeError, ValueError) as err:
                raise ValueError(f"memory_budget: {err}") from None
            if budget <= 0:
                raise ValueError(f"memory_budget must be a positive size such as '24GB', got {self.memory_budget!r}")
        if not isinstance(self.profile_cache, (bool, str, os.PathLike)):
            raise ValueError(f"profile_cache must be True, False or a directory, got {self.profile_cache!r}")
        object.__setattr__(self, "options", SearchOptions.of(self.options))

    @classmethod
    def of(
        cls, memory_budget: Any, profile_cache: Any, search_options: Any = None, **shorthands: Any
    ) -> SearchSettings:
        """The strategy's arguments: ``search_options`` (a SearchOptions or a dict of its fields) and its
        fields given by name, which win where given (not None, False or empty: the strategy's defaults)."""
        from lightning_galvatron.search.options import SearchOptions

        given = {
            name: value
            for name, value in shorthands.items()
            if value is not None and value is not False and not (isinstance(value, (list, tuple, set)) and not value)
        }
        return cls(memory_budget, profile_cache, SearchOptions.of(search_options, **given))

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)


class AutomaticPlanFailed(PlanError):
    """Profiling or searching the model failed (on the rank the message names) for another reason than no plan
    fitting: ``plan="auto"`` then trains it under the floor
    (:func:`~lightning_galvatron.strategy.model_setup.whole_model_plan`) and says why. Raised on every rank alike."""


def _agree_on_failure(failure: str | None, what: str) -> None:
    """Raise :class:`AutomaticPlanFailed` on every rank if ``what`` failed on any, with the first failing rank's
    error (every rank reaches this point: a failure the model's code raises alike on every rank, or after the
    collectives of ``what``)."""
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = [(rank, error) for rank, error in enumerate(failures) if error is not None]
    if failed:
        rank, error = failed[0]
        where = f"rank {rank}: {error}" if len(failed) == 1 else f"{len(failed)} ranks (rank {rank}: {error})"
        raise AutomaticPlanFailed(f"{what} failed on {where}")


@dataclass
class AutoPlan:
    """What :func:`plan_automatically` found: the plan, the profile it was searched on, and what the search was given
    (measured selection searches again with it)."""

    plan: ParallelPlan
    profile: Profile
    report: str  # what the search compared its plan with, and its cost (rank 0; empty elsewhere)
    memory_budget_bytes: int
    estimate: Estimate  # the plan's predicted time and memory (every rank)
    seconds: dict[str, float] = field(default_factory=dict)
    profile_cached: bool = False
    search_result: SearchResult | None = None  # rank 0; None elsewhere
    search_arguments: dict[str, Any] = field(default_factory=dict)  # what the search was given (rank 0)


def device_memory(device: torch.device, processes_per_node: int) -> tuple[int, str]:
    """The memory one process can have at most, and where that figure comes from (for messages)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"{torch.cuda.get_device_name(device)} has {format_bytes(total)}"
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = physical // max(processes_per_node, 1)
    return (
        share,
        f"this machine's {format_bytes(physical)} shared by {processes_per_node} processes is "
        f"{format_bytes(share)} each",
    )


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


def _blocks_changing_shape(measured: Profile) -> str | None:
    """Why pipelines are left out of the search where blocks change the shape of the hidden states (Swin's stages
    merge patches; a stage sends one shape, and such loops carry the shape from block to block), else ``None``."""
    shapes = {(t.seq_length, t.hidden_size): t.name for t in measured.model.layer_types}
    if len(shapes) < 2:
        return None
    listed = ", ".join(f"{name} {seq} x {hidden}" for (seq, hidden), name in shapes.items())
    return f"the blocks receive hidden states of different shapes (positions x width: {listed})"


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
    manual_optimizers: int = 0,
    step: Any = None,
) -> AutoPlan:
    """Profile (all ranks), search (rank 0), broadcast. Raises the same :class:`PlanError` on every rank.

    On one device nothing communicates: the hardware profile holds only the device's memory, and the search
    chooses recomputation and micro-batches (gradient accumulation inside the step) to fit the budget.

    ``manual_optimizers``: how many optimizers a module with manual optimization has (0: automatic
    optimization). Its step is profiled with stand-ins for them, and plans that run the backward pass inside the
    strategy (pipelines, micro-batches: :func:`~lightning_galvatron.plan.rules.manual_optimization_problem`) are
    left out.

    ``step``: how to run the module on a batch for the profiler, ``step(module, batch) -> loss`` (default: its
    ``training_step``; a plain module under Fabric: :func:`~lightning_galvatron.profiler.model.forward_step`).
    """
    from lightning_galvatron.profiler import profile
    from lightning_galvatron.profiler.model import manual_optimization_step
    from lightning_galvatron.search import evaluate, search
    from lightning_galvatron.search.report import describe_alternatives

    started = time.perf_counter()
    cache_info: dict[str, Any] = {}
    # Pipeline probes only where a pipeline can be chosen (one block list, max_pp, automatic optimization).
    pipelines = world_size > 1 and settings.options.max_pp != 1 and len(structure.block_lists) == 1
    pipelines = pipelines and not manual_optimizers
    failure = None
    try:
        # Training must not see the profiler's random draws.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
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
                step=manual_optimization_step(manual_optimizers) if manual_optimizers else step,
                pipelines=pipelines,
            )
    except Exception as error:  # noqa: BLE001 - the model's code, run by the profiler: the floor trains it
        failure = f"{type(error).__name__}: {error}"
    _agree_on_failure(failure, "profiling the model")
    profiled = time.perf_counter()
    budget = settings.memory_budget_bytes or default_memory_budget(device, devices_per_node)
    # Pipelines cannot carry an encoder's output to decoder stages (see runtime.pipeline), nor run a step that does
    # its own backward (manual optimization, as micro-batches cannot); on one device every
    # uniform plan is the same, so there are no baselines to compare with.
    # A loss averaged over tokens (labels -100 in the batch) trains as under DDP only with one DDP rank's samples per
    # micro-batch (rules.token_mean_problem): such plans are searched first; where none fits, all (the runtime warns).
    learned_token_means = not settings.options.token_means and has_ignored_labels(example_batch)
    no_pipeline = _blocks_changing_shape(measured)
    if no_pipeline is None and world_size > 1 and settings.options.max_pp != 1 and len(structure.block_lists) == 1:
        no_pipeline = pipeline_loop_problem(module, structure, step or "training_step", example_batch)
    options = dataclasses.replace(
        settings.options,
        max_pp=1 if len(structure.block_lists) > 1 or manual_optimizers or no_pipeline else settings.options.max_pp,
        max_micro_batches=1 if manual_optimizers else settings.options.max_micro_batches,
        baselines=settings.options.baselines and world_size > 1,
        token_means=settings.options.token_means or learned_token_means,
    )
    outcome: tuple[dict | None, str, str | None, bool] = (None, "", None, options.token_means)
    crashed: str | None = None  # the search failing otherwise than finding no plan that fits
    # What the search is given, flat (its options by field): measured selection searches again with them.
    arguments: dict[str, Any] = {
        "world_size": world_size,
        "memory_budget_bytes": budget,
        "global_batch_size": global_batch_size,
        "optimizer": optimizer,
        "precision": precision,
        **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)},
    }
    if no_pipeline and settings.options.max_pp != 1 and world_size > 1:
        rank_zero_info(f"Galvatron: no pipeline is searched: {no_pipeline}")
    result = None
    if dist.get_rank() == 0:
        for token_means in (True, False) if learned_token_means else (options.token_means,):
            try:
                result = search(measured, **{**arguments, "token_means": token_means})
                outcome = (result.plan.to_dict(), describe_alternatives(result), None, token_means)
                break
            except ValueError as error:  # infeasible budget, no valid plan: say it on every rank
                outcome = (None, "", str(error), token_means)
            except Exception as error:  # noqa: BLE001 - every rank waits for the broadcast below
                crashed = f"{type(error).__name__}: {error}"
                break
    holder = [(outcome, crashed)]
    dist.broadcast_object_list(holder, src=0)
    (plan_dict, report, error, arguments["token_means"]), crashed = holder[0]
    if crashed is not None:
        raise AutomaticPlanFailed(f"the search failed on rank 0: {crashed}")
    if error is not None:
        raise PlanError(f"automatic plan search failed: {error}")
    if learned_token_means:
        rank_zero_info(
            "Galvatron: the batch has labels -100 (a loss averaged over tokens): "
            + (
                "searched the plans with one DDP rank's samples per micro-batch (micro-batches = pp x vocab tp), "
                "whose losses train as DDP's"
                if arguments["token_means"]
                else "no plan with one DDP rank's samples per micro-batch fits, so its token means may differ from "
                "DDP's (see the warning when training starts)"
            )
        )
    assert plan_dict is not None and measured is not None
    plan = ParallelPlan.from_dict(plan_dict)
    return AutoPlan(
        plan=plan,
        profile=measured,
        report=report,
        memory_budget_bytes=budget,
        # The search's own estimate, recomputed where the search did not run (the same deterministic cost model).
        estimate=evaluate(
            measured,
            plan,
            optimizer=optimizer,
            precision=precision,
            memory_budget_bytes=budget,
            calibration=settings.options.calibration,
        ),
        seconds={"profile": profiled - started, "search": time.perf_counter() - profiled},
        profile_cached=bool(cache_info.get("cached")),
        search_result=result,
        search_arguments=arguments,
    )
