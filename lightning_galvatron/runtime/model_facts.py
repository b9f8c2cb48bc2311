"""The live model as the rules see it: :class:`~lightning_galvatron.plan.rules.ModelFacts` from the modules.

What a profile records, the modules answer directly: the block lists by path, whether a token embedding is there to
split by vocabulary, and each block's tensor-parallel plan (or why it has none), whose
:meth:`~lightning_galvatron.runtime.tensor_parallel.BlockTensorParallelPlan.unsupported` is the block's half of the
rules. :func:`~lightning_galvatron.plan.rules.plan_problems` checks a plan against these facts as it checks a profile's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_galvatron.plan import PlanError
from lightning_galvatron.runtime.structure import ModelStructure, model_class
from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan
from lightning_galvatron.runtime.vocab_parallel import find_vocabulary_layers


@dataclass(frozen=True)
class LiveBlockFacts:
    """One block of the live model, by its tensor-parallel plan (or why it has none)."""

    name: str
    seq_length: int | None
    tp_plan: BlockTensorParallelPlan | str

    @property
    def why_no_tensor_parallel_plan(self) -> str | None:
        return self.tp_plan if isinstance(self.tp_plan, str) else None

    def unsupported(self, tp: int, sp: str) -> str | None:
        return None if isinstance(self.tp_plan, str) else self.tp_plan.unsupported(tp, sp)


@dataclass(frozen=True)
class LiveModelFacts:
    """The modules of a model, the tensor-parallel plan of each block (``tp_plans``, resolved by the caller: see
    :func:`~lightning_galvatron.model.tensor_parallel_plans.block_tensor_parallel_plans`), and, when known, the
    sequence length and the ``torch.compile`` arguments. Pure: nothing is changed or communicated."""

    structure: ModelStructure
    tp_plans: Sequence[BlockTensorParallelPlan | str]
    seq_length: int | None = None
    compile_options: Mapping[str, object] | None = None

    @property
    def block_lists(self) -> list[str]:
        return [block_list.path for block_list in self.structure.block_lists]

    @property
    def has_token_embedding(self) -> bool:
        try:
            find_vocabulary_layers(self.structure)
        except PlanError:
            return False
        return True

    def block(self, index: int) -> LiveBlockFacts:
        name = model_class(self.structure.blocks[index]).__name__
        return LiveBlockFacts(name, self.seq_length, self.tp_plans[index])
