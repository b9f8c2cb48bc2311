"""A profile as the plan rules read it: the :class:`~lightning_galvatron.plan.rules.ModelFacts` of a profiled model.

The rules (:mod:`lightning_galvatron.plan.rules`) know nothing of profiles; the search, which holds profiles, reads
them through these views, as the runtime reads the live model through
:class:`~lightning_galvatron.runtime.model_facts.LiveModelFacts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_galvatron.plan import LayerStrategy
from lightning_galvatron.plan.rules import block_problem, degree_problem
from lightning_galvatron.profiles import LayerTypeProfile, ModelProfile

__all__ = ["LayerTypeFacts", "ProfileFacts", "layer_problem"]


@dataclass(frozen=True)
class LayerTypeFacts:
    """A profiled block type as :class:`~lightning_galvatron.plan.rules.BlockFacts`.

    Megatron TP splits what the block's tensor-parallel plan splits (the profile's ``tensor_parallel_divisors``:
    heads, key/value heads, widths; heads, hidden and FFN for profiles without them); Ulysses splits the
    (query) heads (``ulysses_divisors``, else ``num_heads``) and keeps whole weights. Which styles a block type
    has is the profile's ``supports_*`` (from its tensor-parallel plan, less what failed when profiled); one with
    none of them has no plan.
    """

    layer: LayerTypeProfile

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def seq_length(self) -> int:
        return self.layer.seq_length

    @property
    def why_no_tensor_parallel_plan(self) -> str | None:
        layer = self.layer
        if layer.supports_tensor_parallel or layer.supports_megatron_sp or layer.supports_ulysses:
            return None
        return "its profile supports no tensor-parallel style"

    def unsupported(self, tp: int, sp: str) -> str | None:
        layer = self.layer
        if sp == "ulysses":
            if not layer.supports_ulysses:
                return "it cannot run Ulysses sequence parallelism"
            return degree_problem(
                tp, [("attention heads", size) for size in layer.ulysses_divisors or (layer.num_heads,)]
            )
        if not layer.supports_tensor_parallel:
            return "it has no Megatron tensor parallelism"
        if layer.tensor_parallel_divisors:
            sizes = [("(a size its tensor-parallel plan splits)", size) for size in layer.tensor_parallel_divisors]
        else:
            sizes = [
                ("attention heads", layer.num_heads),
                ("hidden size", layer.hidden_size),
                ("FFN width", layer.ffn_hidden_size),
            ]
        problem = degree_problem(tp, sizes)
        if problem is None and sp == "megatron" and not layer.supports_megatron_sp:
            return "it has no Megatron sequence parallelism"
        return problem


def layer_problem(strategy: LayerStrategy, layer: LayerTypeProfile) -> str | None:
    """Whether a block type, described by its profile, runs ``strategy``'s model-parallel group."""
    return block_problem(strategy, LayerTypeFacts(layer))


@dataclass(frozen=True)
class ProfileFacts:
    """A profiled model as :class:`~lightning_galvatron.plan.rules.ModelFacts` (the profile does not record
    compilation)."""

    model: ModelProfile
    compile_options: Mapping[str, object] | None = None

    @property
    def block_lists(self) -> int:
        return self.model.block_lists

    @property
    def has_token_embedding(self) -> bool:
        return self.model.vocab.supports_tensor_parallel

    def block(self, index: int) -> LayerTypeFacts:
        return LayerTypeFacts(self.model.block_type(index))
