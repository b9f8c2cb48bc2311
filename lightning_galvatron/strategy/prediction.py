"""What the cost model predicts for the plan that runs, searched or given alike, on every rank.

A searched plan comes with the profile its search used. A given plan is priced with the profile that
``plan="auto"`` would use for the same model, precision, batch shape and cluster, if the profile cache
holds it: a lookup, never a measurement, because a plan is often given precisely to skip profiling (or
for a model created on the meta device, which cannot be run). Without one the report says so and how
to get one (one run with ``plan="auto"``, whose profile the cache keeps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.profiles import Profile, ProfileError
from lightning_galvatron.search.coefficients import Calibration
from lightning_galvatron.search.estimate import Estimate
from lightning_galvatron.strategy.autoplan import AutoPlan, SearchSettings, default_memory_budget


@dataclass(frozen=True)
class Prediction:
    """The plan that runs, where it came from, and its predicted time and memory (``estimate``) if known."""

    plan: ParallelPlan  # with the global batch it trains on, when known
    source: str  # "searched" (or "searched, chosen by measurement"), or where the given plan came from
    memory_budget_bytes: int
    estimate: Estimate | None = None
    missing: str = ""  # why there is no estimate
    profile: Profile | None = None
    profile_note: str = ""  # where the profile came from
    search_report: str = ""  # what the search compared its plan with (rank 0)
    seconds: dict[str, float] = field(default_factory=dict)
    calibrated: bool = False  # priced with the calibration measured selection fitted to its trials

    @property
    def searched(self) -> bool:
        return self.source.startswith("searched")

    def stage_peak_memory_bytes(self, rank: int) -> float | None:
        """The predicted peak memory of the pipeline stage that ``rank`` belongs to."""
        if self.estimate is None:
            return None
        return self.estimate.stages[rank // self.plan.devices_per_stage].peak_memory_bytes


def searched_prediction(
    auto: AutoPlan,
    chosen: ParallelPlan | None = None,
    *,
    optimizer: str = "adamw",
    precision: str = "bf16-mixed",
    calibration: Calibration | None = None,
) -> Prediction:
    """What the search predicted for its plan -- or for ``chosen``, where measured selection picked another of the
    candidates (priced with the same profile, budget, optimizer and precision). With measured selection's
    ``calibration`` the plan is priced with it, as the selection priced its candidates: the prediction the setup
    report prints, the loggers get and the first training steps are compared with is then one figure."""
    seconds = auto.seconds["profile"]
    measured = f"cached ({seconds:.2f} s to load)" if auto.profile_cached else f"measured in {seconds:.2f} s"
    estimate, source = auto.estimate, "searched"
    plan = auto.plan if chosen is None else chosen
    if plan != auto.plan:
        source = "searched, chosen by measurement"
    if plan != auto.plan or calibration is not None:
        from lightning_galvatron.search import evaluate

        estimate = evaluate(
            auto.profile,
            plan,
            optimizer=optimizer,
            precision=precision,
            memory_budget_bytes=auto.memory_budget_bytes,
            calibration=calibration,
        )
    return Prediction(
        plan=estimate.plan,
        source=source,
        memory_budget_bytes=auto.memory_budget_bytes,
        estimate=estimate,
        profile=auto.profile,
        profile_note=f"{auto.profile.source}; {measured}",
        search_report=auto.report,
        seconds=dict(auto.seconds),
        calibrated=calibration is not None,
    )


def plan_source_name(source: Any) -> str:
    """How the report names a given plan: its file, or what kind of object it was."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return "a ParallelPlan" if isinstance(source, ParallelPlan) else "a dict"


def price_given_plan(
    plan: ParallelPlan,
    source: str,
    module: nn.Module,
    structure: ModelStructure,
    loader: Any,
    per_device_batch: int | None,
    *,
    world_size: int,
    devices_per_node: int,
    precision: str,
    device: torch.device,
    settings: SearchSettings,
    optimizer: str,
) -> Prediction:
    """Price ``plan`` with the cached profile, if there is one (found by the shapes of ``loader``'s first batch).
    Collective: call on every rank."""
    from lightning_galvatron.profiler import profile
    from lightning_galvatron.search import evaluate
    from lightning_galvatron.strategy.data import example_batch

    budget = settings.memory_budget_bytes or default_memory_budget(device, devices_per_node)
    global_batch = plan.global_batch_size or (per_device_batch * world_size if per_device_batch else None)
    plan = plan.replace(global_batch_size=global_batch) if global_batch else plan
    given = Prediction(plan=plan, source=source, memory_budget_bytes=budget)
    if settings.profile_cache is False:
        return _without(given, "profile_cache=False, so no profile is looked up")
    if global_batch is None:
        return _without(given, "the DataLoader has no batch_size, so the global batch is not known")
    info: dict[str, Any] = {}
    found = profile(
        module,
        structure,
        example_batch(loader),
        world_size=world_size,
        devices_per_node=devices_per_node,
        precision=precision,
        cache=settings.profile_cache,
        device=device,
        info=info,
        measure=False,
    )
    if found is None:
        return _without(
            given,
            "no profile of this model, batch shape, precision and cluster in the profile cache; run once with "
            'plan="auto" (the cache keeps its profile) to have given plans priced',
        )
    try:
        estimate = evaluate(
            found,
            plan,
            optimizer=optimizer,
            precision=precision,
            memory_budget_bytes=budget,
            calibration=settings.options.calibration,
        )
    except (PlanError, ProfileError, ValueError) as error:
        return _without(given, f"the cached profile cannot price this plan: {error}")
    return Prediction(
        plan=plan,
        source=source,
        memory_budget_bytes=budget,
        estimate=estimate,
        profile=found,
        profile_note=f"{found.source}; cached in {info.get('cache_file')}",
    )


def _without(prediction: Prediction, reason: str) -> Prediction:
    return Prediction(prediction.plan, prediction.source, prediction.memory_budget_bytes, missing=reason)
