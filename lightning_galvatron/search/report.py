"""Plain-text reports of a search and of a plan's predicted costs (shared by the CLI and the strategy)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from lightning_galvatron.units import format_bytes

if TYPE_CHECKING:  # only annotations: the reports need no more of the search at import
    from lightning_galvatron.plan import ParallelPlan
    from lightning_galvatron.search.engine import SearchResult
    from lightning_galvatron.search.estimate import Estimate


def describe_search(result: SearchResult, title: str) -> str:
    """The best plan's per-block table and stage breakdown, the uniform baselines and the search's cost."""
    return "\n".join([title, describe_estimate(result.estimate), describe_alternatives(result)])


def describe_alternatives(result: SearchResult) -> str:
    """What the search compared its plan with (the uniform baselines), its notes and its cost."""
    lines = []
    if result.baselines:
        lines.append("\nUniform baselines (same cost model):")
        rows: list[tuple[str, ...]] = [("baseline", "samples/s", "step", "peak memory", "plan")]
        for b in result.baselines:
            e = b.estimate
            if e is None:
                rows.append((b.name, "-", "-", "-", "not executable here"))
                continue
            speed = f"{e.throughput_samples_per_s:.2f}" if b.fits else "does not fit"
            rows.append(
                (b.name, speed, f"{e.step_time_s:.3f} s", format_bytes(e.peak_memory_bytes), plan_summary(e.plan))
            )
        lines.append(text_table(rows))
    lines.extend(f"note: {note}" for note in result.notes)
    lines.append(
        f"\nSearch took {result.search_time_s:.2f} s ({result.shapes_considered} pipeline shapes, "
        f"{result.shapes_solved} solved by DP; memory tolerance {result.memory_tolerance:g})"
    )
    return "\n".join(lines)


def plan_summary(plan: ParallelPlan) -> str:
    kinds = sorted({s.short() for s in plan.layers})
    head = f"pp{plan.pp}"
    if plan.pp > 1:
        head += f" {plan.schedule}" + (f"x{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return f"{head} m{plan.micro_batches} [{', '.join(kinds)}] vocab {plan.vocab.short()}"


LABEL_PARTS = {
    "tpN": "tensor parallel over N devices (tp1: none)",
    "spN": "Ulysses sequence parallel over N devices",
    "msp": "with Megatron sequence parallelism",
    "strided": "tensor-parallel ranks strided, not consecutive",
    "ddp": "data parallel, whole weights on every device",
    "zero2": "data parallel, gradients and optimizer states sharded",
    "zero3": "data parallel, weights, gradients and optimizer states sharded",
    "rc": "activations recomputed in backward",
}


def legend(labels: Iterable[str]) -> str:
    """What the parts of strategy labels such as ``tp2-msp-zero3-rc`` mean, for the parts that occur in ``labels``."""
    present = {re.sub(r"^(tp|sp)\d+$", r"\1N", part) for label in labels for part in label.split("-")}
    return "Labels: " + "; ".join(f"{part} = {meaning}" for part, meaning in LABEL_PARTS.items() if part in present)


def describe_estimate(estimate: Estimate) -> str:
    plan = estimate.plan
    lines = [
        f"pp={plan.pp}  schedule={plan.schedule}  micro-batches={plan.micro_batches}"
        + (f"  virtual stages={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
        + (f"  partition={list(plan.chunk_sizes)}" if plan.pp > 1 else "")
        + f"  embedding/head: {plan.vocab.short()}",
        "",
    ]
    rows: list[tuple[str, ...]] = [("blocks", "stage", "strategy", "memory/device", "time/micro-batch")]
    blocks = list(estimate.blocks)
    i = 0
    while i < len(blocks):
        j = i
        while (
            j + 1 < len(blocks)
            and blocks[j + 1].strategy == blocks[i].strategy
            and blocks[j + 1].stage == blocks[i].stage
            and blocks[j + 1].index == blocks[j].index + 1
        ):
            j += 1
        group = blocks[i : j + 1]
        label = str(group[0].index) if i == j else f"{group[0].index}-{group[-1].index}"
        per = " each" if i != j else ""
        rows.append(
            (
                label,
                str(group[0].stage),
                group[0].strategy.short(),
                format_bytes(group[0].memory_bytes) + per,
                f"{group[0].time_per_micro_batch_s * 1e3:.2f} ms" + per,
            )
        )
        i = j + 1
    lines.append(text_table(rows))
    lines.append("")
    rows = [
        (
            "stage",
            "peak memory",
            "block states",
            "activations",
            "embedding/head",
            "working",
            "overhead",
            "time/micro-batch",
        )
    ]
    for s in estimate.stages:
        rows.append(
            (
                str(s.stage),
                format_bytes(s.peak_memory_bytes),
                format_bytes(s.block_state_bytes),
                format_bytes(s.block_activation_bytes),
                format_bytes(s.vocab_bytes),
                format_bytes(s.working_bytes),
                format_bytes(s.overhead_bytes),
                f"{s.time_per_micro_batch_s * 1e3:.1f} ms",
            )
        )
    lines.append(text_table(rows))
    budget = estimate.memory_budget_bytes  # estimate.fits is None exactly without one
    if budget is None:
        fits = ""
    else:
        fits = "  (fits the budget)" if estimate.fits else f"  (DOES NOT FIT {format_bytes(budget)})"
    lines.append("")
    lines.append(
        f"Predicted: step {estimate.step_time_s:.3f} s, {estimate.throughput_samples_per_s:.2f} samples/s, "
        f"peak {format_bytes(estimate.peak_memory_bytes)} per device{fits}"
    )
    return "\n".join(lines)


def text_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
