"""Dynamic programming over the blocks of a stage, with memory discretised into cells.

State: (block ``i``, memory used by blocks ``0..i`` in cells, strategy of block ``i``); value: the
least time. A block's cost is its time plus the relocation from the previous block's activation
layout (nothing at the start of a pipeline chunk, where activations arrive by point-to-point).
Relocation depends only on the two layouts, so the transition first takes, per memory cell, the
best predecessor of each layout (``K`` of them, ``K`` << strategies), then adds the ``K x K``
relocation matrix: ``O(M * (S + K^2))`` per block, all in numpy -- no Python loop over cells.

Error bound. Each block's memory is rounded *up* to whole cells of ``c`` bytes, and a plan is
accepted if its rounded total fits the cap in cells. Hence (1) every plan the DP returns fits
the exact cap, and (2) any plan whose exact memory is at most ``cap - J*c`` (``J`` blocks) also
fits after rounding, so the DP's optimum is no slower than the exact optimum for a cap smaller
by ``J*c``. The engine picks ``c = eps * capacity / J_max`` so that this slack is at most ``eps``
(``SearchOptions.memory_tolerance``) of the memory left for the stage's blocks. The tests check
both statements against exhaustive enumeration.

One run gives the answer for every prefix length and every cap (:meth:`LayerDP.tables`), so stages
with the same blocks and micro-batches in flight, and every embedding/head strategy (which only
changes the cap), share it. A prefix may also pay a *closing* memory that depends on the strategy of
its last block (the search's working reserve, :func:`~.working.closing_reserve`): it is added where the
prefix ends, not carried to the next block, and rounded up to whole cells like a block's memory (one
rounding more per stage, which the engine's cell size allows for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

INF = np.inf


def cell_bytes(capacity_bytes: float, num_blocks: int, tolerance: float) -> float:
    """Cell size so that ``num_blocks`` roundings lose at most ``tolerance * capacity`` bytes."""
    return max(tolerance * max(capacity_bytes, 1.0) / max(num_blocks, 1), 1.0)


def cells_for(nbytes: NDArray[np.float64], cell: float) -> NDArray[np.int64]:
    """Memory in whole cells, rounded up (conservative)."""
    return np.ceil(np.asarray(nbytes, dtype=float) / cell).astype(np.int64)


def cap_cells(cap_bytes: float | NDArray[np.float64], cell: float) -> NDArray[np.int64]:
    """How many whole cells fit a cap (-1 when even an empty stage does not fit)."""
    return np.floor(np.asarray(cap_bytes, dtype=float) / cell * (1 - 1e-12)).astype(np.int64)


class Prepared(NamedTuple):
    """A step's columns grouped by layout for one cell size (:meth:`Step.prepared`)."""

    order: NDArray[np.intp]  # column order, grouped by layout
    layouts: NDArray[np.int64]  # the distinct layouts, increasing
    starts: NDArray[np.intp]  # where each layout's columns start in ``order``
    cells: NDArray[np.int64]  # each column's memory in whole cells, in ``order``
    pad: int  # rows of padding above the predecessor table (the most cells of a column)
    gather: NDArray[np.int64]  # flat index into the padded predecessor table, per (cell, column)


@dataclass(eq=False)
class Step:
    """The candidates of one block: per strategy its time, memory (bytes) and layout index.

    ``relocation[k_prev, k]`` is the time to go from layout ``k_prev`` of the previous block to layout
    ``k`` of this one (layouts are indices into one list shared by all steps of a run). ``candidates``
    maps the columns back to the caller's strategies (e.g. after pruning).
    """

    time: NDArray[np.float64]
    memory: NDArray[np.float64]
    layout: NDArray[np.int64]
    relocation: NDArray[np.float64]
    candidates: NDArray[np.intp] | None = None  # what each column stands for in the caller's list
    _cache: dict[tuple[float, int], Prepared] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.time = np.asarray(self.time, dtype=float)
        self.memory = np.asarray(self.memory, dtype=float)
        self.layout = np.asarray(self.layout, dtype=np.int64)
        if not (len(self.time) == len(self.memory) == len(self.layout)) or not len(self.time):
            raise ValueError("a DP step needs the same, non-zero number of times, memories and layouts")

    def candidate(self, column: int) -> int:
        """The caller's index of ``column`` (itself without ``candidates``)."""
        return column if self.candidates is None else int(self.candidates[column])

    def prepared(self, cell: float, num_cells: int) -> Prepared:
        """Column order grouped by layout, and the flat gather index for the shifted predecessor table."""
        key = (cell, num_cells)
        if key not in self._cache:
            order = np.argsort(self.layout, kind="stable")
            layouts, starts = np.unique(self.layout[order], return_index=True)
            position = np.searchsorted(layouts, self.layout[order])
            cells = np.minimum(cells_for(self.memory[order], cell), num_cells)
            pad = int(cells.max())
            rows = np.arange(num_cells)[:, None] - cells[None, :] + pad
            gather = rows * len(layouts) + position[None, :]
            self._cache[key] = Prepared(order, layouts, starts, cells, pad, gather)
        return self._cache[key]


class LayerDP:
    """DP over a sequence of steps; ``resets[i]`` marks a block that starts a pipeline chunk."""

    def __init__(self, steps: Sequence[Step], resets: Sequence[bool], cell: float, num_cells: int):
        if not steps:
            raise ValueError("the DP needs at least one block")
        self.steps = list(steps)
        self.resets = [True, *list(resets)[1:]] if resets else [True] + [False] * (len(steps) - 1)
        self.cell = float(cell)
        self.num_cells = int(num_cells)
        self._values: list[NDArray[np.float64]] = []

    def _entry(self, i: int, previous: tuple[NDArray[np.float64], Step] | None) -> NDArray[np.float64]:
        """Best time per (cell, layout of step i) before adding step i, from the previous step's
        best per (cell, layout) (and that step): a min over the previous layouts of value + relocation."""
        step = self.steps[i]
        order, layouts, starts, cells, pad, gather = step.prepared(self.cell, self.num_cells)
        if previous is None:
            empty = np.full((self.num_cells, len(layouts)), INF)
            empty[0, :] = 0.0  # nothing before the first block: no memory used, no time
            return empty
        by_layout, previous_step = previous
        if self.resets[i]:
            return np.repeat(by_layout.min(axis=1, keepdims=True), len(layouts), axis=1)
        p_layouts = previous_step.prepared(self.cell, self.num_cells).layouts
        relocation: NDArray[np.float64] = step.relocation[np.ix_(p_layouts, layouts)]  # (K_prev, K)
        entry: NDArray[np.float64] = by_layout[:, :1] + relocation[0]
        for k in range(1, len(p_layouts)):
            np.minimum(entry, by_layout[:, k : k + 1] + relocation[k], out=entry)
        return entry

    def _advance(self, i: int, entry: NDArray[np.float64]) -> NDArray[np.float64]:
        """Values per (cell, strategy of step i): the entry shifted down by the strategy's cells, plus its time."""
        step = self.steps[i]
        order, layouts, starts, cells, pad, gather = step.prepared(self.cell, self.num_cells)
        padded = np.concatenate([np.full((pad, entry.shape[1]), INF), entry], axis=0)
        return np.take(padded, gather) + step.time[order][None, :]

    def _closing_cells(self, i: int, closing: NDArray[np.float64] | None) -> NDArray[np.int64] | None:
        """Step ``i``'s closing memory (bytes per column, in the caller's order) in whole cells, in the step's order."""
        if closing is None:
            return None
        order = self.steps[i].prepared(self.cell, self.num_cells).order
        return np.minimum(cells_for(np.asarray(closing, dtype=float)[order], self.cell), self.num_cells)

    def _closed(self, values: NDArray[np.float64], extra: NDArray[np.int64] | None) -> NDArray[np.float64]:
        """``values`` of prefixes that end here, each column shifted up by its closing cells."""
        if extra is None or not extra.any():
            return values
        rows = np.arange(self.num_cells)[:, None] - extra[None, :]
        shifted = np.take_along_axis(values, np.maximum(rows, 0), axis=0)
        return np.where(rows >= 0, shifted, INF)

    def tables(
        self, keep: bool = False, closing: Sequence[NDArray[np.float64] | None] | None = None
    ) -> NDArray[np.float64]:
        """``best[j, c]``: least time of the first ``j + 1`` blocks using at most ``c`` cells (inf if none fits),
        with ``closing[j]`` (bytes per column of step ``j``, or None) paid by the prefix that ends at step ``j``."""
        best = np.empty((len(self.steps), self.num_cells))
        previous: tuple[NDArray[np.float64], Step] | None = None
        self._values = []
        for i, step in enumerate(self.steps):
            values = self._advance(i, self._entry(i, previous))
            if keep:
                self._values.append(values)
            by_layout = np.minimum.reduceat(values, step.prepared(self.cell, self.num_cells).starts, axis=1)
            extra = self._closing_cells(i, closing[i] if closing is not None else None)
            ended = by_layout if extra is None else self._closed(values, extra)
            best[i] = np.minimum.accumulate(ended.min(axis=1))
            previous = (by_layout, step)
        return best

    def solve(self, cap: int, closing: NDArray[np.float64] | None = None) -> tuple[float, list[int]]:
        """Least time of all blocks within ``cap`` cells, the last block's ``closing`` memory included, and the chosen
        strategy index per block."""
        self.tables(keep=True)
        if cap < 0:
            return INF, []
        cap = min(cap, self.num_cells - 1)
        extra = self._closing_cells(len(self.steps) - 1, closing)
        last = self._closed(self._values[-1], extra)[: cap + 1]
        if not np.isfinite(last).any():
            return INF, []
        m, col = (int(x) for x in np.unravel_index(int(np.argmin(last)), last.shape))
        time = float(last[m, col])
        if extra is not None:
            m = int(m - extra[col])  # the row of the blocks' own memory
        choices = []
        for i in range(len(self.steps) - 1, -1, -1):
            step = self.steps[i]
            order, layouts, starts, cells, pad, gather = step.prepared(self.cell, self.num_cells)
            choices.append(int(order[col]))
            if i == 0:
                break
            m = int(m - cells[col])
            prev_step = self.steps[i - 1]
            p_order, p_layouts, *_ = prev_step.prepared(self.cell, self.num_cells)
            row = self._values[i - 1][m]
            if not self.resets[i]:
                row = row + step.relocation[prev_step.layout[p_order], step.layout[order[col]]]
            col = int(np.argmin(row))
        choices.reverse()
        return time, choices


def undominated(
    time: NDArray[np.float64],
    memory: NDArray[np.float64],
    layout: NDArray[np.int64],
    relocation: Sequence[NDArray[np.float64]] = (),
    also: NDArray[np.float64] | None = None,
) -> NDArray[np.bool_]:
    """Candidates that no other candidate beats in both time and memory (and in ``also``, a second memory that must
    be no worse either), relocations included.

    ``y`` dominates ``x`` if it needs no more memory and ``t_y + slack <= t_x``, where ``slack``
    bounds how much more relocation ``y``'s layout can cost than ``x``'s, into the block from any
    layout and out of it into any layout (``relocation``: the matrices of the block types that can
    follow). Replacing every ``x`` by ``y`` in any plan then costs no time and no memory, so the DP
    loses nothing. Ties are broken by position, so one of equals survives.
    """
    S = len(time)
    if relocation:
        into = relocation[0]
        outs = np.max(np.stack(relocation), axis=0)
        ly, lx = layout[:, None], layout[None, :]
        slack_in = np.maximum((into[:, ly] - into[:, lx]).max(axis=0), 0.0)  # (S_y, S_x)
        slack_out = np.maximum((outs[ly, :] - outs[lx, :]).max(axis=2), 0.0)
        slack = slack_in + slack_out
    else:
        slack = np.where(layout[:, None] == layout[None, :], 0.0, np.inf)
    effective = time[:, None] + slack
    no_worse = (effective <= time[None, :]) & (memory[:, None] <= memory[None, :])
    better = (effective < time[None, :]) | (memory[:, None] < memory[None, :])
    if also is not None:
        no_worse &= also[:, None] <= also[None, :]
        better |= also[:, None] < also[None, :]
    earlier = np.arange(S)[:, None] < np.arange(S)[None, :]
    np.fill_diagonal(no_worse, False)
    dominated: NDArray[np.bool_] = (no_worse & (better | earlier)).any(axis=0)
    return ~dominated
