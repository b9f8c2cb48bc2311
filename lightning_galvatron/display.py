"""The plan as a table: what a user reads on rank 0 before training starts.

Plain text (:func:`~lightning_galvatron.search.report.text_table`), so that installing this package does not
pull in a terminal-rendering library that would change Lightning's own defaults (Lightning switches its
progress bar and model summary to Rich when ``rich`` is installed).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_galvatron.plan import LayerStrategy, ParallelPlan
from lightning_galvatron.search.report import text_table


def plan_table(plan: ParallelPlan, block_names: Sequence[str] | None = None, title: str | None = None) -> str:
    """One row per block (and one for the vocabulary layers): stage, strategy, degrees."""
    names = list(block_names) if block_names is not None else [f"block {i}" for i in range(plan.num_layers)]
    pipeline = f", pp={plan.pp} {plan.schedule} x{plan.micro_batches} micro-batches" if plan.pp > 1 else ""
    batch = f", global batch {plan.global_batch_size}" if plan.global_batch_size else ""
    rows = [("layer", "stage", "tp", "sp", "dp", "dp type", "recompute", "layout")]
    stage_of = {layer: stage for stage in range(plan.pp) for layer in plan.stage_layers(stage)}

    def row(name: str, stage: str, s: LayerStrategy) -> tuple[str, ...]:
        layout = "-" if s.tp == 1 else ("consecutive" if s.tp_consecutive else "strided")
        return (name, stage, str(s.tp), s.sp, str(plan.dp_of(s)), s.dp_type, "yes" if s.recompute else "no", layout)

    rows.append(row("embedding / head", "first / last" if plan.pp > 1 else "0", plan.vocab))
    rows.extend(row(names[i], str(stage_of[i]), strategy) for i, strategy in enumerate(plan.layers))
    return "\n".join([title or f"Galvatron plan: {plan.world_size} devices{pipeline}{batch}", text_table(rows)])
