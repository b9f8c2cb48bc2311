"""``dry_run``: resolve the model, the plan and the prediction, simulate the ranks, report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_galvatron.dryrun import PHASES
from lightning_galvatron.dryrun.driver import resolve_ranks, run_ranks
from lightning_galvatron.dryrun.models import ModelSource, token_batch
from lightning_galvatron.dryrun.rank import RankJob, RankResult, first_optimizer
from lightning_galvatron.dryrun.trace import PLACEHOLDER_NOTE, OrderCheck, check_order
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError, load_plan
from lightning_galvatron.units import format_bytes, parse_bytes


@dataclass
class DryRunReport:
    """Per simulated rank: what it holds, its groups, measured and predicted memory; the order proof."""

    model: str
    plan: ParallelPlan
    precision: str
    seq_length: int
    ranks: list[RankResult]
    estimate: Any | None = None  # search.estimate.Estimate of the plan (None without a profile)
    order: OrderCheck | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"

    @property
    def ok(self) -> bool:
        """Every rank applied and stepped, breaking none of NCCL's rules; (when checked) the collective order holds."""
        return all(r.error is None and not r.violations for r in self.ranks) and (self.order is None or self.order.ok)

    def checkpoint_index(self) -> Any:
        """DCP's index (``.metadata``) of the checkpoint the simulated save writes: every rank's save plan combined as
        DCP's coordinator combines them, which refuses shards that overlap or leave part of a tensor out. What
        ``dry_run(..., load_from=)`` loads into another plan; needs the checkpoint phase on every rank."""
        from lightning_galvatron.dryrun.checkpoint import saved_index

        plans = [r.save_plan for r in self.ranks]
        if len(plans) != self.plan.world_size or any(p is None for p in plans):
            raise ValueError(
                "a checkpoint's index combines every rank's save: dry-run every rank (ranks='all') with the "
                "checkpoint phase"
            )
        return saved_index(plans)

    def host_syncs_per_step(self, phase: str = "train") -> dict[int, int]:
        """Per simulated GPU: the host synchronisations of one step of ``phase`` (empty on the CPU)."""
        return {r.rank: sum(s["count"] for s in r.host_syncs if s["phase"] == phase) for r in self.ranks}

    def predicted_memory(self, rank: int) -> dict[str, float] | None:
        """The cost model's memory for ``rank``'s stage, by the measured categories it corresponds to."""
        if self.estimate is None:
            return None
        stage = self.estimate.stages[rank // self.plan.devices_per_stage]
        return {
            "model_states": stage.block_state_bytes,
            "activations": stage.block_activation_bytes,
            "embedding_head": stage.vocab_bytes,
            "working": stage.working_bytes,
            "overhead": stage.overhead_bytes,
            "total": stage.peak_memory_bytes - stage.overhead_bytes,  # the fixed overhead is no tensor
        }

    def memory_ratio(self, rank: int) -> float | None:
        """Measured peak / predicted peak (without the fixed overhead) for ``rank``."""
        result = next(r for r in self.ranks if r.rank == rank)
        predicted = self.predicted_memory(rank)
        if predicted is None or result.memory is None or not predicted["total"]:
            return None
        return result.memory["total"] / predicted["total"]

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "world_size": self.plan.world_size,
            "precision": self.precision,
            "seq_length": self.seq_length,
            "global_batch_size": self.plan.global_batch_size,
            "plan": self.plan.to_dict(),
            "ok": self.ok,
            "seconds": self.seconds,
            "ranks": [
                {
                    **r.to_dict(events),
                    "predicted_memory": self.predicted_memory(r.rank),
                    "memory_ratio": self.memory_ratio(r.rank),
                }
                for r in self.ranks
            ],
            "collective_order": self.order.to_dict() if self.order is not None else None,
            "host_syncs_per_step": self.host_syncs_per_step() if self.device == "cuda" else None,
            "prediction": self.estimate.to_dict() if self.estimate is not None else None,
            "notes": self.notes,
        }

    def describe(self) -> str:
        """A short table for people."""
        from lightning_galvatron.search.report import plan_summary, text_table

        p = self.plan
        lines = [
            (
                f"Dry run of {self.model} on {p.world_size} {'GPUs' if self.device == 'cuda' else 'ranks'} "
                f"({len(self.ranks)} simulated), {self.precision}, "
                f"sequence {self.seq_length}, global batch {p.global_batch_size}: {plan_summary(p)}"
            ),
        ]
        rows = [
            (
                "rank",
                "stage",
                "blocks",
                "local params",
                "groups",
                "measured peak",
                "params+grads+opt",
                "act",
                "temp",
                "predicted",
                "ratio",
                "s",
            )
        ]
        for r in self.ranks:
            if r.error is not None:
                rows.append((str(r.rank), str(r.stage), "error", "", "", "", "", "", "", "", "", f"{r.seconds:.1f}"))
                continue
            blocks = _ranges([b["index"] for b in r.blocks])
            elements = sum(b["local_elements"] for b in r.blocks) + sum(
                _numel(q["local_shape"]) for q in r.outside_blocks
            )
            m = r.memory or {}
            states = m.get("parameters", 0) + m.get("gradients", 0) + m.get("optimizer_states", 0) if m else None
            predicted = self.predicted_memory(r.rank)
            ratio = self.memory_ratio(r.rank)
            rows.append(
                (
                    str(r.rank),
                    str(r.stage),
                    blocks,
                    f"{elements / 1e6:.1f} M",
                    str(len(r.groups)),
                    format_bytes(m["total"]) if m else "-",
                    format_bytes(states) if states is not None else "-",
                    format_bytes(m["activations"]) if m else "-",
                    format_bytes(m["temporaries"]) if m else "-",
                    format_bytes(predicted["total"]) if predicted else "-",
                    f"{ratio:.2f}" if ratio else "-",
                    f"{r.seconds:.1f}",
                )
            )
        lines.append(text_table(rows))
        for r in self.ranks:
            if r.error is not None:
                lines.append(f"\nrank {r.rank} failed:\n{r.error}")
        if self.device == "cuda":
            lines.extend(_describe_gpu_checks(self.ranks))
        if self.order is not None:
            lines.append(self.order.describe())
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(f"Simulated in {self.seconds:.1f} s.")
        return "\n".join(lines)


def dry_run(
    model: ModelSource | nn.Module,
    plan: ParallelPlan | str | dict[str, Any] | Any,
    *,
    world_size: int | None = None,
    ranks: str | int | Iterable[int] = "sample",
    precision: str = "bf16-mixed",
    seq_length: int | None = None,
    global_batch_size: int | None = None,
    phases: Sequence[str] = ("train", "validate", "checkpoint"),
    hardware: str | Any | None = None,
    reference: str | Any | None = None,
    profile: str | Any | None = None,
    memory_per_device: int | str | None = None,
    search_options: Any = None,
    make_batch: Callable[[int, int], Any] = token_batch,
    measure_memory: bool = True,
    check_collective_order: bool | None = None,
    keep_stacks: bool = True,
    gradient_clip_val: float | None = None,
    real_tensors: bool = False,
    workers: int | None = None,
    device: str = "cpu",
    devices_per_node: int | None = None,
    load_from: DryRunReport | None = None,
) -> DryRunReport:
    """Apply ``plan`` to ``model`` as ``ranks`` of a world of ``world_size`` and step it on fake tensors.

    Args:
        model: a :class:`ModelSource` (``ModelSource.from_hf_config(path)``, ``from_class(path, init_args)``)
            or a module on the meta device.
        plan: a :class:`~lightning_galvatron.plan.ParallelPlan`, a dict or JSON file (ours or the reference
            system's format), or ``"auto"``: searched for ``world_size`` devices of ``memory_per_device``
            from an analytic profile of the model scaled from ``hardware`` (see ``lightning-galvatron estimate``).
        ranks: ``"sample"`` (first, middle and last rank of each stage), ``"all"``, a rank or a list of ranks.
        hardware / reference / profile: where the cost model's prediction comes from: a hardware profile
            (with ``reference``'s measured blocks scaled to the model, default the hardware profile's), or a
            full ``profile`` of this model; without them only measurements are reported.
        phases: of ``train``, ``validate``, ``checkpoint``.
        check_collective_order: compare the ranks' sequences (default: when every rank is simulated).
        gradient_clip_val: clip by the global norm before the optimizer step, as with the Trainer's option.
        real_tensors: run on zero-filled CPU tensors instead of fake ones: several times faster, but every rank
            allocates its share of the model for real (for small models, e.g. proving the collective order of a
            plan on a narrow copy of the model: the order depends on the plan and the model's structure, not on
            tensor sizes or values).
        workers: processes at a time (default: the CPU count).
        device: ``"cuda"``: every rank holds fake tensors on its own simulated GPU (``cuda:rank % devices_per_node``,
            :mod:`.cuda`), its process group is a simulated NCCL whose rules are checked (:mod:`.nccl_rules`), and
            host synchronisations are counted per step. ``"cpu"``: what gloo runs, unchecked.
        devices_per_node: GPUs per node with ``device="cuda"`` (default 8).
        load_from: the dry run of another plan of this model, with the checkpoint phase on every rank: its checkpoint
            is loaded into this plan after the phases, as ``Trainer.fit(ckpt_path=...)`` resumes (the reads planned
            against its index, :mod:`.checkpoint`).
    """
    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.model.sources import seq_length_of
    from lightning_galvatron.model.tensor_parallel_plans import block_tensor_parallel_plans
    from lightning_galvatron.runtime.apply import check_runtime_support
    from lightning_galvatron.strategy.autoplan import optimizer_kind

    started = time.perf_counter()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: choose 'cpu' or 'cuda'")
    if device == "cuda" and real_tensors:
        raise ValueError("device='cuda' simulates GPUs with fake tensors: real_tensors makes CPU tensors")
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    source = model if isinstance(model, ModelSource) else ModelSource.from_module(model)
    with torch.device("meta"):
        module = source.build()
    structure = find_blocks(module, source.layers)
    optimizer = optimizer_kind(first_optimizer(module))

    estimate = None
    architecture = None
    if plan == "auto" or (profile is None and hardware is not None):
        architecture = source.architecture()
        if architecture is None:
            raise ValueError(f"the cost model cannot read the shape of {source.label}; pass a plan and a full profile")
    seq = seq_length or (architecture.default_seq_length if architecture is not None else None) or seq_length_of(module)
    if not seq and architecture is None:  # the model's own default (a config's max_position_embeddings)
        shape = source.architecture()
        seq = shape.default_seq_length if shape is not None else None
    if not seq:
        raise ValueError("the sequence length is not known from the model: pass seq_length")
    if plan == "auto":
        if world_size is None or hardware is None:
            raise ValueError('plan="auto" needs world_size and a hardware profile to search with')
        from lightning_galvatron.search.cluster_estimate import estimate_cluster

        assert architecture is not None  # read (or refused) above for plan="auto"
        found = estimate_cluster(
            architecture,
            world_size,
            memory_per_device,
            hardware=hardware,
            reference=reference,
            seq_length=seq,
            global_batch_size=global_batch_size,
            precision=precision,
            optimizer=optimizer,
            options=search_options,
        )
        if found.result is None:
            raise PlanError(f"the search found no plan: {found.error}")
        resolved, estimate = found.result.plan, found.result.estimate
    else:
        resolved = load_plan(plan, world_size=world_size)
        if global_batch_size is not None:
            resolved = resolved.replace(global_batch_size=global_batch_size)
        if resolved.global_batch_size is None:
            resolved = resolved.replace(
                global_batch_size=resolved.batch_granularity * -(-resolved.world_size // resolved.batch_granularity)
            )
        estimate = _predict(resolved, architecture, seq, hardware, reference, profile, precision, optimizer)
    check_runtime_support(resolved, structure, block_tensor_parallel_plans(structure))

    chosen = resolve_ranks(ranks, resolved)
    job = RankJob(
        module=module,
        plan=resolved,
        precision=precision,
        seq_length=seq,
        make_batch=make_batch,
        layers=source.layers,
        phases=tuple(phases),
        measure_memory=measure_memory,
        keep_stacks=keep_stacks,
        gradient_clip_val=gradient_clip_val,
        real_tensors=real_tensors,
        device=device,
        devices_per_node=devices_per_node or 8,
        device_memory=None if memory_per_device is None else parse_bytes(memory_per_device),
        load_index=load_from.checkpoint_index() if load_from is not None else None,
    )
    results = run_ranks(job, chosen, workers)
    order = None
    if check_collective_order if check_collective_order is not None else len(chosen) == resolved.world_size:
        order = check_order({r.rank: r.events or [] for r in results if r.error is None}, resolved.world_size)
    notes = [PLACEHOLDER_NOTE] if any(r.placeholders for r in results) else []
    if plan == "auto":
        notes.append(
            "plan auto: the cost model's best plan is simulated; the measured selection a Trainer runs (short trials "
            "of the search's candidates) is skipped: on fake tensors they would time nothing"
        )
    if "checkpoint" in phases:
        notes.append(
            "checkpoint: sharded state dicts collected and this rank's save planned; DCP's exchange of plans "
            "between ranks and the writing are not simulated"
        )
    if load_from is not None:
        from lightning_galvatron.search.report import plan_summary

        notes.append(
            f"load: the checkpoint of the dry run of {plan_summary(load_from.plan)} loaded into this plan, each rank's "
            "reads planned against its index; DCP's exchange of plans between ranks and the reading are not simulated"
        )
    return DryRunReport(
        source.label, resolved, precision, seq, results, estimate, order, time.perf_counter() - started, notes, device
    )


def _describe_gpu_checks(ranks: Sequence[RankResult]) -> list[str]:
    """NCCL's rules broken (each with where) and the host synchronisations of each phase, ranks alike merged."""
    from lightning_galvatron.dryrun.nccl_rules import HostSync, Violation

    lines: list[str] = []
    broken = {(v["rule"], v["message"], tuple(v["stack"])): v for r in ranks for v in r.violations}
    if broken:
        lines.append(f"NCCL's rules: {len(broken)} violation(s)")
        lines.extend(
            Violation(v["rule"], v["message"], v["phase"], tuple(v["stack"])).describe() for v in broken.values()
        )
    else:
        lines.append(
            "NCCL's rules: every collective and point-to-point tensor on the rank's own GPU, object "
            "collectives on the current device"
        )
    for phase in ("train", "validate"):
        counts = sorted({sum(s["count"] for s in r.host_syncs if s["phase"] == phase) for r in ranks if not r.error})
        if not counts:
            continue
        span = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
        lines.append(f"host synchronisations per {phase} step (a GPU waits for each): {span} per rank")
        seen: dict[tuple[str, tuple[str, ...]], HostSync] = {}
        for r in ranks:
            for s in r.host_syncs:
                if s["phase"] == phase:
                    seen.setdefault(
                        (s["what"], tuple(s["stack"])),
                        HostSync(phase, s["what"], tuple(s["stack"]), s["via"], s["count"]),
                    )
        lines.extend(f"  {sync.describe()}" for sync in seen.values())
    return lines


def shortened_plan(plan: ParallelPlan) -> ParallelPlan:
    """``plan`` with every run of equal consecutive block strategies inside a pipeline chunk cut to one block.

    Stages, chunks, schedule, micro-batches, the vocabulary strategy and every change of strategy between
    neighbouring blocks stay; only repeats go. The blocks of such a run issue the same operations on the
    same groups one after the other, so proving the collective order of the shortened plan on a model with
    as many blocks proves it for every length of the runs -- at a fraction of the cost: what the full-world
    proofs of long models use (with a narrow copy of the model: the order does not depend on tensor sizes).
    """
    layers: list[LayerStrategy] = []
    partition: list[int] = []
    for chunk in range(plan.pp * plan.virtual_stages):
        kept: list[LayerStrategy] = []
        for index in plan.chunk_layers(chunk):
            if not kept or kept[-1] != plan.layers[index]:
                kept.append(plan.layers[index])
        layers.extend(kept)
        partition.append(len(kept))
    return plan.replace(layers=tuple(layers), partition=tuple(partition))


def _predict(
    plan: ParallelPlan,
    architecture: Any,
    seq: int,
    hardware: Any,
    reference: Any,
    profile: Any,
    precision: str,
    optimizer: str,
) -> Any:
    """The cost model's estimate of ``plan``: from a full profile, or an analytic one scaled from ``hardware``."""
    from lightning_galvatron.producers.analytic import analytic_profile
    from lightning_galvatron.profiles import load_profile
    from lightning_galvatron.search.estimate import evaluate

    if profile is not None:
        priced = load_profile(profile)
    elif hardware is not None:
        hardware_profile = load_profile(hardware)
        priced, _ = analytic_profile(
            architecture,
            load_profile(reference) if reference is not None else hardware_profile,
            seq,
            hardware_profile.hardware,
        )
    else:
        return None
    return evaluate(priced, plan, precision=precision, optimizer=optimizer)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    if not indices:
        return "-"
    parts, start, prev = [], indices[0], indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if i is not None:
            start = prev = i
    return ", ".join(parts)
