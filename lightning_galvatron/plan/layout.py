"""What a plan means for ranks: the one owner of the plan's geometry (torch-free).

A stage of ``n = world_size / pp`` devices owns the consecutive ranks ``[s*n, (s+1)*n)``. A block with
group size ``tp`` splits them into ``dp = n / tp`` groups; with a consecutive layout the ``tp`` ranks
of a group are neighbours, with a strided one they are ``dp`` apart (the ``dp`` ranks are then
neighbours instead, which keeps gradient traffic inside a node). The blocks are cut into
``pp * virtual_stages`` chunks; chunk ``c`` runs on stage ``c % pp``. Launchers number ranks by node:
ranks ``[k*D, (k+1)*D)`` share node ``k`` for ``D`` devices per node.

Everything here is arithmetic on those rules, used by the search (costs, the collectives it looks
up), the profiler (which groups it measures), the runtime (:class:`~lightning_galvatron.runtime.mesh.MeshCache`
only turns a :class:`Layout` into a ``DeviceMesh``; relocation reads :class:`ActivationLayout`) and the
estimates. It imports nothing from torch (the search runs offline) and nothing from this package at
run time (``plan.py`` imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_galvatron.plan import LayerStrategy, ParallelPlan

Range = tuple[int, int]
Region = tuple[Range, Range]  # (batch rows, sequence positions), half-open


# ---------------------------------------------------------------------------------------------- pipeline chunks
def rank_chunks(stage: int, pp: int, virtual_stages: int = 1) -> range:
    """The pipeline chunks held by pipeline rank ``stage``: ``stage, stage + pp, ...`` below ``pp * v``."""
    return range(stage, pp * virtual_stages, pp)


# ---------------------------------------------------------------------------------------------- nodes
def ranks_per_node(group_size: int, stride: int, devices_per_node: int, world_size: int) -> int:
    """How many ranks of a group (members ``stride`` apart, aligned to nodes) share a node."""
    if world_size <= devices_per_node:
        return group_size
    if stride >= devices_per_node:
        return 1
    return max(1, min(group_size, devices_per_node // stride))


def stage_neighbours_share_node(world_size: int, pp: int, devices_per_node: int) -> bool:
    """Whether every rank and its peer in the next pipeline stage (``W/pp`` ranks on) share a node.

    The profiler runs all stage-to-stage pairs at once, so its timing is that of the slowest pair; the
    cost model asks for the same entry. With ranks numbered by node this holds exactly when the whole
    world fits one node: otherwise rank ``max(0, D - W/pp)`` and its peer straddle the first node boundary.
    """
    return world_size <= devices_per_node


def p2p_ranks_per_node(world_size: int, pp: int, devices_per_node: int) -> int:
    """The ``ranks_per_node`` key of a stage-to-stage transfer: 2 when the pair shares a node, else 1."""
    return 2 if stage_neighbours_share_node(world_size, pp, devices_per_node) else 1


# ---------------------------------------------------------------------------------------------- rank layouts
@dataclass(frozen=True)
class Layout:
    """Where the ranks of one block sit: pipeline degree, group size and rank order."""

    world_size: int
    pp: int
    tp: int
    consecutive: bool = True

    @classmethod
    def of(cls, plan: ParallelPlan, strategy: LayerStrategy) -> Layout:
        n = plan.world_size // plan.pp
        # With tp of 1 or n both orders give the same groups: normalise so they share one mesh.
        consecutive = strategy.tp_consecutive or strategy.tp in (1, n)
        return cls(plan.world_size, plan.pp, strategy.tp, consecutive)

    @classmethod
    def stage(cls, plan: ParallelPlan) -> Layout:
        """The layout whose data-parallel groups are whole stages (``tp = 1``)."""
        return cls(plan.world_size, plan.pp, 1)

    @classmethod
    def of_group(cls, world_size: int, group_size: int, stride: int) -> Layout:
        """The layout whose ``tp`` groups are ``group_size`` ranks ``stride`` apart, tiling the world."""
        if world_size % (group_size * stride):
            raise ValueError(f"groups of {group_size} ranks {stride} apart do not tile {world_size} ranks")
        return cls(world_size, world_size // (group_size * stride), group_size, consecutive=stride == 1)

    @property
    def stage_size(self) -> int:
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        return self.world_size // self.pp // self.tp

    @property
    def tp_stride(self) -> int:
        """Rank distance between neighbours of a tensor-parallel group."""
        return 1 if self.consecutive else self.dp

    @property
    def dp_stride(self) -> int:
        """Rank distance between neighbours of a data-parallel group."""
        return self.tp if self.consecutive else 1

    def rank(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        """The global rank at ``(stage, dp_rank, tp_rank)``."""
        return stage * self.stage_size + dp_rank * self.dp_stride + tp_rank * self.tp_stride

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(stage, dp_rank, tp_rank)`` of a global rank."""
        stage, position = divmod(rank, self.stage_size)
        if self.consecutive:
            dp_rank, tp_rank = divmod(position, self.tp)
        else:
            tp_rank, dp_rank = divmod(position, self.dp)
        return stage, dp_rank, tp_rank

    def rank_grid(self) -> list[list[list[int]]]:
        """Ranks arranged as ``[pp][dp][tp]`` (a ``DeviceMesh`` with dimensions ``pp, dp, tp``)."""
        return [[[self.rank(s, d, t) for t in range(self.tp)] for d in range(self.dp)] for s in range(self.pp)]

    def tp_group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s tensor-parallel group, in group order."""
        stage, dp_rank, _ = self.coordinates(rank)
        return [self.rank(stage, dp_rank, t) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s data-parallel group, in group order."""
        stage, _, tp_rank = self.coordinates(rank)
        return [self.rank(stage, d, tp_rank) for d in range(self.dp)]

    def tp_groups(self) -> list[list[int]]:
        """Every tensor-parallel group: each rank is in exactly one."""
        return [row for stage in self.rank_grid() for row in stage]

    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.stage_size, (stage + 1) * self.stage_size)


# ---------------------------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class ActivationForm:
    """What decides whether a block takes the previous block's activations as they are (within one stage).

    ``group`` ranks hold each sample's activations, ``replicated`` (tensor parallel without sequence
    parallelism: identical copies) or split along the sequence (Megatron-SP and Ulysses of one degree
    split it the same way), in the rank order ``consecutive``. The search compares these; the runtime's
    :class:`ActivationLayout` of the same strategy has this form.
    """

    group: int
    replicated: bool
    consecutive: bool


@dataclass(frozen=True)
class ActivationLayout:
    """How the activation entering or leaving a block is spread over its stage's ranks.

    An activation ``[batch, seq, ...]`` of one micro-batch: rank ``r`` holds the batch rows of its dp
    shard and -- when the block shards the sequence (Megatron-SP, Ulysses) -- only its group rank's
    part of the sequence; otherwise the ``tp`` ranks of a group hold identical copies.
    """

    layout: Layout
    seq_sharded: bool = False

    @classmethod
    def of(cls, plan: ParallelPlan, strategy: LayerStrategy) -> ActivationLayout:
        return cls(Layout.of(plan, strategy), seq_sharded=strategy.sp != "none")

    @classmethod
    def in_stage(cls, strategy: LayerStrategy, devices_per_stage: int) -> ActivationLayout:
        """The layout on one stage of ``devices_per_stage`` ranks (positions within the stage)."""
        n = devices_per_stage
        consecutive = strategy.tp_consecutive or strategy.tp in (1, n)
        return cls(Layout(n, 1, strategy.tp, consecutive), seq_sharded=strategy.sp != "none")

    @property
    def form(self) -> ActivationForm:
        g = self.layout.tp
        return ActivationForm(g, g > 1 and not self.seq_sharded, self.layout.consecutive)

    @property
    def stage_size(self) -> int:
        return self.layout.stage_size

    def region(self, position: int, batch: int, seq: int) -> Region:
        """The rectangle held by the rank at ``position`` within its stage."""
        _, dp_rank, tp_rank = self.layout.coordinates(position)
        rows = split(batch, self.layout.dp, dp_rank)
        if not self.seq_sharded:
            return rows, (0, seq)
        if seq % self.layout.tp:
            raise ValueError(
                f"sequence length {seq} is not divisible by the sequence-parallel degree {self.layout.tp}; "
                "pad the sequence or choose a degree that divides it"
            )
        return rows, split(seq, self.layout.tp, tp_rank)

    def local_shape(self, position: int, batch: int, seq: int) -> tuple[int, int]:
        (b0, b1), (s0, s1) = self.region(position, batch, seq)
        return b1 - b0, s1 - s0

    def global_seq(self, local_seq: int) -> int:
        return local_seq * self.layout.tp if self.seq_sharded else local_seq


def activation_form(strategy: LayerStrategy, devices_per_stage: int) -> ActivationForm:
    """The :class:`ActivationForm` of a strategy on a stage of ``devices_per_stage`` devices."""
    return ActivationLayout.in_stage(strategy, devices_per_stage).form


def split(total: int, parts: int, index: int) -> Range:
    """Balanced contiguous split: part ``index`` of ``parts`` (sizes differ by at most one)."""
    return index * total // parts, (index + 1) * total // parts
