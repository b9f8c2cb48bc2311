"""The setup report: what a user reads on rank 0 before training starts, the same for searched and given plans.

The plan (blocks with the same strategy on the same stage grouped), its predicted time and memory per
device next to the memory budget, what the search compared it with, and a legend of the strategy labels.

Plain text (:func:`~lightning_galvatron.search.report.text_table`), so that installing this package does not
pull in a terminal-rendering library that would change Lightning's own defaults (Lightning switches its
progress bar and model summary to Rich when ``rich`` is installed).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.search.report import legend, text_table
from lightning_galvatron.strategy.prediction import Prediction
from lightning_galvatron.units import format_bytes


def setup_report(prediction: Prediction, block_names: Sequence[str] | None = None) -> str:
    plan, estimate = prediction.plan, prediction.estimate
    devices = f"{plan.world_size} device{'s' if plan.world_size > 1 else ''}"
    source = prediction.source if prediction.searched else f"given: {prediction.source}"
    batch = f", global batch {plan.global_batch_size}" if plan.global_batch_size else ""
    lines = [f"Galvatron plan for {devices} ({source}){batch}", _shape(plan), ""]
    lines.append(_blocks_table(prediction, block_names))
    budget = f"the memory budget of {format_bytes(prediction.memory_budget_bytes)} per device"
    if estimate is None:
        lines += ["", f"Predicted: no prediction: {prediction.missing}"]
    else:
        lines += ["", _stages_table(prediction), ""]
        peak = estimate.peak_memory_bytes
        fits = "fits" if peak <= prediction.memory_budget_bytes else "DOES NOT FIT"
        basis = " (the cost model calibrated from the trials)" if prediction.calibrated else ""
        lines.append(
            f"Predicted{basis}: {estimate.step_time_s:.3g} s per step, {estimate.throughput_samples_per_s:.4g} "
            f"samples/s; peak memory {format_bytes(peak)} per device: {fits} {budget}"
        )
        if prediction.profile_note:
            lines.append(f"Profile: {prediction.profile_note}")
    if prediction.search_report:
        lines.append(prediction.search_report)
    lines.append(legend([s.short() for s in (plan.vocab, *plan.layers)]))
    return "\n".join(lines)


def _shape(plan: ParallelPlan) -> str:
    if plan.pp == 1:
        micro = f"{plan.micro_batches} micro-batches per step" if plan.micro_batches > 1 else "one micro-batch per step"
        return f"No pipeline, {micro}"
    virtual = f", {plan.virtual_stages} virtual stages each" if plan.virtual_stages > 1 else ""
    return (
        f"Pipeline of {plan.pp} stages{virtual} ({plan.schedule}, {plan.micro_batches} micro-batches), "
        f"blocks per {'chunk' if plan.virtual_stages > 1 else 'stage'} {list(plan.chunk_sizes)}"
    )


def _blocks_table(prediction: Prediction, block_names: Sequence[str] | None) -> str:
    """One row for the embedding/head and one per run of consecutive blocks with the same strategy and stage."""
    plan, estimate = prediction.plan, prediction.estimate
    names = list(block_names) if block_names is not None else [f"block {i}" for i in range(plan.num_layers)]
    stage_of = {layer: stage for stage in range(plan.pp) for layer in plan.stage_layers(stage)}
    columns = ("layers", "stage", "strategy", "dp") + (("memory/device", "time/micro-batch") if estimate else ())
    vocab_stage = "first / last" if plan.pp > 1 else "0"
    vocab_row = ("embedding / head", vocab_stage, plan.vocab.short(), str(plan.dp_of(plan.vocab)))
    if estimate is not None:
        vocab_row += (format_bytes(sum(s.vocab_bytes for s in estimate.stages)), "-")
    rows = [columns, vocab_row]
    start = 0
    for end in range(1, plan.num_layers + 1):
        if end < plan.num_layers and (plan.layers[end], stage_of[end]) == (plan.layers[start], stage_of[start]):
            continue
        strategy, each = plan.layers[start], " each" if end - start > 1 else ""
        row = (_span(names, start, end - 1), str(stage_of[start]), strategy.short(), str(plan.dp_of(strategy)))
        if estimate is not None:
            block = estimate.blocks[start]
            row += (format_bytes(block.memory_bytes) + each, f"{block.time_per_micro_batch_s * 1e3:.3g} ms{each}")
        rows.append(row)
        start = end
    return text_table(rows)


def _span(names: Sequence[str], first: int, last: int) -> str:
    """``model.blocks.0-3`` for a run of numbered blocks of one container, else both names."""
    if first == last:
        return names[first]
    a, b = re.fullmatch(r"(.*\.)(\d+)", names[first]), re.fullmatch(r"(.*\.)(\d+)", names[last])
    if a and b and a.group(1) == b.group(1):
        return f"{names[first]}-{b.group(2)}"
    return f"{names[first]} .. {names[last]}"


def _stages_table(prediction: Prediction) -> str:
    assert prediction.estimate is not None
    columns = ("peak memory", "block states", "activations", "embedding/head", "working", "overhead")
    rows = [("stage", *columns, "time/micro-batch")]
    for s in prediction.estimate.stages:
        sizes = (
            s.peak_memory_bytes,
            s.block_state_bytes,
            s.block_activation_bytes,
            s.vocab_bytes,
            s.working_bytes,
            s.overhead_bytes,
        )
        rows.append((str(s.stage), *map(format_bytes, sizes), f"{s.time_per_micro_batch_s * 1e3:.3g} ms"))
    return text_table(rows)
