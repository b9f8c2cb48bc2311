"""The plan as a table: what a user reads on rank 0 before training starts."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from lightning_galvatron.plan import LayerStrategy, ParallelPlan


def plan_table(plan: ParallelPlan, block_names: Sequence[str] | None = None, title: str | None = None) -> Table:
    """One row per block (and one for the vocabulary layers): stage, strategy, degrees."""
    names = list(block_names) if block_names is not None else [f"block {i}" for i in range(plan.num_layers)]
    pipeline = f", pp={plan.pp} {plan.schedule} x{plan.micro_batches} micro-batches" if plan.pp > 1 else ""
    batch = f", global batch {plan.global_batch_size}" if plan.global_batch_size else ""
    table = Table(title=title or f"Galvatron plan: {plan.world_size} devices{pipeline}{batch}")
    for column in ("layer", "stage", "tp", "sp", "dp", "dp type", "recompute", "layout"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    stage_of = {layer: stage for stage in range(plan.pp) for layer in plan.stage_layers(stage)}

    def row(name: str, stage: str, s: LayerStrategy) -> None:
        layout = "-" if s.tp == 1 else ("consecutive" if s.tp_consecutive else "strided")
        table.add_row(
            name, stage, str(s.tp), s.sp, str(plan.dp_of(s)), s.dp_type, "yes" if s.recompute else "no", layout
        )

    row("embedding / head", "first / last" if plan.pp > 1 else "0", plan.vocab)
    for i, strategy in enumerate(plan.layers):
        row(names[i], str(stage_of[i]), strategy)
    return table


def render(table: Table, width: int = 120) -> str:
    """Plain text of a rich table (for logs and files)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False, color_system=None).print(table)
    return buffer.getvalue()
