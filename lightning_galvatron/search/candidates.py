"""Candidates for measured selection: a few diverse plans that fit, for short real runs to decide between.

The cost model is good at ruling plans out and at ordering plans whose costs differ a lot; between plans of
different *kinds* (a pipeline or not, sharded or replicated states, tensor parallelism or not, recomputation,
micro-batches) it is only as good as its per-call terms on this machine. So besides the search's best plan the
candidates are the best plan of each other kind -- the search again with one kind switched off or on -- and the
uniform plans that fit (the baselines a user would otherwise pick). :func:`diverse_candidates` orders them so
that a short time budget still measures as many kinds as it can: the search's best first, then the fastest
predicted plan of each kind not measured yet, then the rest by predicted time.

Torch-free, like the rest of the search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from lightning_galvatron.plan import SCHEDULES, LayerStrategy, ParallelPlan, PlanError
from lightning_galvatron.plan.rules import token_mean_problem
from lightning_galvatron.profiles import Profile
from lightning_galvatron.search.engine import SearchResult, search
from lightning_galvatron.search.estimate import Estimate, evaluate


class PlanKind(NamedTuple):
    """The choices whose costs the model is least sure of: two plans of one kind differ in degree, not nature."""

    pipeline: int  # the pipeline degree (1: none); the depth changes the bubble and the data-parallel width
    sharded: bool  # some states sharded (ZeRO-2/3)
    tensor_parallel: bool  # some blocks split (TP, Megatron-SP or Ulysses)
    recompute: bool
    micro_batches: bool

    def describe(self) -> str:
        parts = [
            f"pp{self.pipeline}" if self.pipeline > 1 else "no pipeline",
            "ZeRO" if self.sharded else "DDP",
            "TP" if self.tensor_parallel else "no TP",
        ]
        if self.recompute:
            parts.append("recompute")
        if self.micro_batches:
            parts.append("micro-batches")
        return ", ".join(parts)


def plan_kind(plan: ParallelPlan) -> PlanKind:
    strategies = (*plan.layers, plan.vocab)
    return PlanKind(
        pipeline=plan.pp,
        sharded=any(s.dp_type != "ddp" for s in strategies),
        tensor_parallel=any(s.tp > 1 for s in strategies),
        recompute=any(s.recompute for s in plan.layers),
        micro_batches=plan.micro_batches > 1,
    )


@dataclass(frozen=True)
class Candidate:
    """A plan to measure: how it was found (``name``) and what the cost model predicts for it."""

    name: str
    plan: ParallelPlan
    estimate: Estimate

    @property
    def kind(self) -> PlanKind:
        return plan_kind(self.plan)


def diverse_candidates(
    profile: Profile,
    result: SearchResult,
    search_arguments: Mapping[str, Any],
    *,
    max_candidates: int = 8,
) -> list[Candidate]:
    """The search's best plan, the best of each other kind and the uniform plans that fit, in trial order.

    Args:
        profile: the profile the search priced.
        result: what :func:`~.engine.search` returned for ``search_arguments``.
        search_arguments: the arguments of that search (``world_size``, ``memory_budget_bytes`` and the keyword
            arguments): the other kinds are searched with the same, one limit changed.
        max_candidates: at most this many (the search's best always among them).
    """
    best = result.plan
    # Every candidate trains the best plan's global batch, so that step times compare.
    arguments = {
        **search_arguments,
        "baselines": False,
        "search_batch_size": False,
        "global_batch_size": best.global_batch_size,
    }
    world_size = arguments.pop("world_size")
    budget = arguments.pop("memory_budget_bytes")
    disable = frozenset(arguments.get("disable") or ())
    kind = plan_kind(best)
    found: list[Candidate] = [Candidate("searched", best, result.estimate)]

    # The best plan of the other kinds: the search again with one choice of the best plan excluded.
    variants: list[tuple[str, dict[str, Any]]] = []
    if kind.pipeline > 1:
        variants.append(("searched, no pipeline", {"max_pp": 1}))
    if kind.tensor_parallel:
        variants.append(("searched, no TP", {"max_tp": 1}))
    if kind.sharded:
        variants.append(("searched, DDP only", {"disable": disable | {"zero2", "zero3"}}))
    elif world_size > 1:
        variants.append(("searched, ZeRO only", {"disable": disable | {"ddp"}}))
    if kind.recompute:
        variants.append(("searched, no recompute", {"disable": disable | {"recompute"}}))
    if kind.micro_batches:  # their fixed costs per call are what an uncalibrated profile prices least surely
        variants.append(("searched, fewer micro-batches", {"max_micro_batches": best.micro_batches // 2}))
    for name, change in variants:
        try:
            other = search(profile, world_size, budget, **{**arguments, **change})
        except ValueError:  # nothing of that kind fits, or the limit leaves no valid plan
            continue
        found.append(Candidate(name, other.plan, other.estimate))

    # The uniform plans a user would pick instead, where they fit.
    for baseline in result.baselines:
        if baseline.fits and baseline.estimate is not None:
            found.append(Candidate(f"uniform {baseline.name}", baseline.estimate.plan, baseline.estimate))
    price = _pricer(profile, arguments, budget)
    for name, plans in _other_uniform_plans(result, world_size, disable, arguments).items():
        if arguments.get("token_means"):  # as the searches above: one DDP rank's samples per micro-batch
            plans = [p for p in plans if token_mean_problem(p.pp, p.micro_batches, p.vocab.tp) is None]
        estimates = [e for e in map(price, plans) if e is not None and e.fits]
        if estimates:
            fastest = min(estimates, key=lambda e: e.step_time_s)
            found.append(Candidate(name, fastest.plan, fastest))
    return trial_order(found)[:max_candidates]


def unmeasured(plans: Iterable[ParallelPlan]) -> frozenset[str]:
    """The search's ``disable`` names of every mechanism none of ``plans`` uses.

    A calibration fitted to measurements of some plans prices a mechanism none of them used by its shared terms
    only (its own per-call terms come out as zero), so the calibrated search would favour exactly what was not
    measured: it searches without these.
    """
    plans = list(plans)
    blocks = [s for p in plans for s in p.layers]
    used = {s.dp_type for p in plans for s in (*p.layers, p.vocab)}
    if any(s.recompute for s in blocks):
        used.add("recompute")
    if any(s.tp > 1 and s.sp == "none" for s in blocks):
        used |= {"tensor_parallel", "tp_without_sp"}
    if any(s.sp == "megatron" for s in blocks):
        used |= {"tensor_parallel", "megatron_sp"}
    if any(s.sp == "ulysses" for s in blocks):
        used.add("ulysses")
    if any(p.vocab.tp > 1 for p in plans):
        used.add("vocab_parallel")
    if any(s.tp > 1 and not s.tp_consecutive for s in blocks):
        used.add("strided")
    if any(p.pp > 1 for p in plans):
        used.add("pipeline")
    names = {
        "ddp",
        "zero2",
        "zero3",
        "recompute",
        "tensor_parallel",
        "tp_without_sp",
        "megatron_sp",
        "ulysses",
        "vocab_parallel",
        "strided",
        "pipeline",
    }
    return frozenset(names - used)


def executed(plan: ParallelPlan) -> ParallelPlan:
    """``plan`` as it executes: a pipeline's partition written out, so that the search's pipeline (which names its
    partition) and the uniform one of the same partition (which leaves it out) compare equal."""
    return plan.replace(partition=plan.chunk_sizes) if plan.pp > 1 else plan


def trial_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Distinct plans: the first given, then greedily the fastest predicted plan of a kind not yet listed,
    then the remaining plans by predicted time.

    Plans are the same when they execute the same (:func:`executed`); tried twice, a plan would get two draws of
    the trials' noise."""
    distinct: dict[ParallelPlan, Candidate] = {}
    for c in candidates:
        distinct.setdefault(executed(c.plan), c)
    items = list(distinct.values())
    if not items:
        return []
    ordered, rest = [items[0]], sorted(items[1:], key=lambda c: c.estimate.step_time_s)
    kinds = {items[0].kind}
    while rest:
        pick = next((c for c in rest if c.kind not in kinds), rest[0])
        rest.remove(pick)
        kinds.add(pick.kind)
        ordered.append(pick)
    return ordered


def _pricer(
    profile: Profile, arguments: Mapping[str, Any], budget: int | str | None
) -> Callable[[ParallelPlan], Estimate | None]:
    def price(plan: ParallelPlan) -> Estimate | None:
        try:
            return evaluate(
                profile,
                plan,
                optimizer=arguments.get("optimizer", "adamw"),
                precision=arguments.get("precision", "bf16-mixed"),
                memory_budget_bytes=budget,
                calibration=arguments.get("calibration"),
            )
        except (PlanError, ValueError):
            return None

    return price


def _other_uniform_plans(
    result: SearchResult, world_size: int, disable: frozenset[str], arguments: Mapping[str, Any]
) -> dict[str, list[ParallelPlan]]:
    """Uniform plans the search's baselines leave out: ZeRO-2 and DDP with 2 or 4 micro-batches (from the DDP
    baseline), pipelines of DDP blocks of every degree (each schedule, a few micro-batch counts), and on one
    device -- where the only choices are recomputation and micro-batches -- every combination of the two."""
    out: dict[str, list[ParallelPlan]] = {}
    best = result.plan
    batch = best.global_batch_size or world_size
    max_pp = arguments.get("max_pp") or world_size
    if world_size > 1 and "pipeline" not in disable and "ddp" not in disable:
        schedules = arguments.get("schedules") or SCHEDULES
        for pp in (d for d in range(2, min(world_size, max_pp, best.num_layers) + 1) if world_size % d == 0):
            plans = []
            for schedule in schedules:
                for m in (pp, 2 * pp, 4 * pp):
                    try:
                        plans.append(
                            ParallelPlan.uniform(
                                world_size,
                                best.num_layers,
                                LayerStrategy(),
                                pp=pp,
                                schedule=schedule,
                                micro_batches=m,
                                virtual_stages=2 if schedule == "interleaved_1f1b" else 1,
                                global_batch_size=batch,
                            )
                        )
                    except (PlanError, ValueError):
                        continue
            out[f"uniform pp{pp}"] = plans
    ddp = next((b.estimate for b in result.baselines if b.name == "ddp" and b.estimate is not None), None)
    if ddp is not None and world_size > 1:
        # DDP over micro-batches of another size: often a winner on its own, and it lets the calibration tell a
        # block's per-call time from its compute (trials of one micro-batch size cannot).
        plans = []
        for m in (2, 4):
            try:
                plans.append(ddp.plan.replace(micro_batches=m))
            except (PlanError, ValueError):
                continue
        out["uniform ddp, micro-batches"] = plans
    if ddp is not None and world_size > 1 and "zero2" not in disable:
        plan = ddp.plan
        out["uniform zero2"] = [
            plan.replace(
                layers=tuple(dataclasses.replace(s, dp_type="zero2") for s in plan.layers),
                vocab=dataclasses.replace(plan.vocab, dp_type="zero2"),
            )
        ]
    if world_size == 1:
        micro = [m for m in range(1, batch + 1) if batch % m == 0][:6]
        for recompute in (False, True):
            if recompute and "recompute" in disable:
                continue
            for many in (False, True):
                label = (
                    f"uniform {'recompute' if recompute else 'no recompute'}, "
                    f"{'micro-batches' if many else 'one micro-batch'}"
                )
                out[label] = [
                    ParallelPlan.uniform(
                        1,
                        best.num_layers,
                        LayerStrategy(recompute=recompute),
                        vocab=LayerStrategy(),
                        micro_batches=m,
                        global_batch_size=batch,
                    )
                    for m in micro
                    if (m > 1) == many
                ]
    return out


__all__ = ["Candidate", "PlanKind", "diverse_candidates", "executed", "plan_kind", "trial_order", "unmeasured"]
