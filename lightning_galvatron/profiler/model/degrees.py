"""Phase 4, degrees: a block's saved bytes per tensor/sequence-parallel degree.

With a live process group the block is split for real by the runtime's own code and counted on
each rank; without one, the degree-1 count split by module gives the degrees (see the package
docstring).
"""

from __future__ import annotations

import logging
import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_galvatron.model.tensor_parallel_plans import BlockTensorParallelPlan
from lightning_galvatron.profiler.model.saved import SavedTensorCounter, _per_sample
from lightning_galvatron.profiles import DegreeTable
from lightning_galvatron.runtime.mesh import reduce_over_ranks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Styles:
    """The model-parallel styles the runtime can run on a block type."""

    tensor_parallel: bool
    megatron_sp: bool
    ulysses: bool


class _DegreeMeasurement:
    """The per-degree half of the block profiler (:class:`~.blocks._BlockProfiler` supplies the block)."""

    name: str
    device: torch.device
    hidden: torch.Tensor
    tp_plan: BlockTensorParallelPlan | None
    #: style -> the error of its split block when profiled (the same on every rank).
    failed_styles: dict[str, str]

    def copy(self) -> nn.Module:
        raise NotImplementedError

    def saved_bytes(self, block: nn.Module, batch: int, seq_split: int = 1) -> SavedTensorCounter:
        raise NotImplementedError

    def per_degree(
        self,
        per_sample: float,
        roles: Mapping[str, float],
        degrees: Sequence[int],
        world: int,
        count_sizes: Sequence[int],
        styles: _Styles,
    ) -> tuple[DegreeTable, float]:
        """(bytes per sample per degree of a group that splits the activations, the part plain TP keeps whole).

        The table is the largest of the sequence-splitting styles the block supports (Megatron-SP,
        Ulysses), so a memory estimate never undershoots either; the replicated part is what plain
        Megatron TP keeps on top of it: ``(plain(g) - split(g)) / (1 - 1/g)``, which reproduces
        the measured plain-TP bytes exactly in the cost model.
        """
        table = {1: per_sample}
        replicated: list[float] = []
        measured = [
            g for g in degrees if 1 < g <= world and world % g == 0 and (styles.tensor_parallel or styles.ulysses)
        ]
        for g in measured:
            results = self.measure_degree(g, world, count_sizes, styles)
            if not results:
                continue  # no style runs at this degree (it splits a head): the search will not offer it
            splitting = [results[s] for s in ("megatron", "ulysses") if s in results]
            table[g] = max(splitting) if splitting else results["none"]
            if "none" in results:
                replicated.append(max(results["none"] - table[g], 0.0) / (1 - 1 / g))
        if len(table) == 1:  # no group to measure on: derive from the degree-1 count (module docstring)
            for g in (g for g in degrees if g > 1):
                candidates = []
                if styles.tensor_parallel:  # plain TP adds the replicated norms below to this
                    candidates.append(roles["column"] + (per_sample - roles["column"]) / g)
                if styles.ulysses:
                    candidates.append(per_sample / g)
                if candidates:
                    table[g] = max(candidates)
            replicated = [roles["norm"]] if styles.tensor_parallel else []
        return DegreeTable(tuple(table.items())), (statistics.fmean(replicated) if replicated else 0.0)

    def measure_degree(self, g: int, world: int, count_sizes: Sequence[int], styles: _Styles) -> dict[str, float]:
        """Bytes per sample on one rank of a group of ``g`` ranks, per style the runtime can run at ``g``.

        Every rank takes part (each in its consecutive group of ``g``); the decision of which styles
        run depends only on the model, so all ranks issue the same collectives.
        """
        results = {}
        for style in self.runnable_styles(g, styles):
            error = None
            try:
                block = self.split_copy(g, world, style)
                split = 1 if style == "none" else g
                points = [(b, float(self.saved_bytes(block, b, seq_split=split).total)) for b in count_sizes]
            except Exception as failure:  # noqa: BLE001 - reported, and the style is not planned
                error = f"{type(failure).__name__}: {failure}"
            # Every rank drops the same style: whether any rank failed.
            if reduce_over_ranks([error is not None], dist.ReduceOp.MAX)[0]:
                self.failed_styles.setdefault(style, error or "it failed on another rank")
                continue
            results[style] = _per_sample(points)
            log.debug("%s at degree %d, sp=%s: saved bytes per batch size %s", self.name, g, style, points)
        return results

    def styles_that_ran(self, styles: _Styles) -> _Styles:
        """``styles`` without those whose split block failed to run when profiled (:attr:`failed_styles`): a plan
        that passed its static checks but cannot run this block (a literal head count in a reshape) is planned
        with ``tp = 1`` instead of crashing ``plan="auto"``; rank 0 says why."""
        if not self.failed_styles:
            return styles
        quiet = dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
        for style, error in {} if quiet else self.failed_styles.items():
            warnings.warn(
                f"Galvatron: {self.name} failed to run split for "
                f"{'Ulysses' if style == 'ulysses' else 'tensor parallelism'} while profiling ({error}); it is "
                "planned without it (declare a plan with lightning_galvatron.register_tensor_parallel_plan)",
                stacklevel=2,
            )
        tensor_parallel = not {"none", "megatron"} & self.failed_styles.keys()
        return _Styles(
            tensor_parallel=styles.tensor_parallel and tensor_parallel,
            megatron_sp=styles.megatron_sp and tensor_parallel,
            ulysses=styles.ulysses and "ulysses" not in self.failed_styles,
        )

    def runnable_styles(self, g: int, styles: _Styles) -> list[str]:
        """The styles (``none``: Megatron TP, ``megatron``: with SP, ``ulysses``) the runtime can run at ``g``."""
        seq = int(self.hidden.shape[1]) if self.hidden.dim() >= 3 else 1
        plan = self.tp_plan
        if plan is None:
            return []
        runnable = []
        if styles.tensor_parallel and plan.unsupported(g, "none") is None:
            runnable.append("none")
        if styles.megatron_sp and plan.unsupported(g, "megatron") is None and seq % g == 0:
            runnable.append("megatron")
        if styles.ulysses and plan.unsupported(g, "ulysses") is None and seq % g == 0 and seq // g >= 2:
            runnable.append("ulysses")
        return runnable

    def split_copy(self, g: int, world: int, style: str) -> nn.Module:
        """A copy of the block split for real over this rank's consecutive group of ``g`` (collective)."""
        from lightning_galvatron.runtime.mesh import Layout, MeshCache
        from lightning_galvatron.runtime.tensor_parallel import apply_tensor_parallel
        from lightning_galvatron.runtime.ulysses import apply_ulysses

        plan = self.tp_plan
        assert plan is not None
        tp_mesh = MeshCache.shared(self.device.type).tp_mesh(Layout(world, 1, g, True))
        block = self.copy()
        if style == "ulysses":
            apply_ulysses(block, tp_mesh.get_group(), plan.position_inputs)
        else:
            apply_tensor_parallel(block, plan.styles(style == "megatron"), tp_mesh)
            plan.localize(block, g)
        return block
