"""What the runtime can execute: one predicate per rule, each returning why a choice cannot run, or None.

These are the rules of executability, written once. The search offers a candidate if and only if no
rule objects (:mod:`lightning_galvatron.search.space`); :func:`~lightning_galvatron.search.evaluate`
turns objections into warnings (it still prices the plan, as a what-if); the runtime raises them as
errors before anything is changed (:func:`~lightning_galvatron.runtime.apply.check_runtime_support`).

A whole plan is checked once, by :func:`plan_problems`, over the :class:`ModelFacts` a model gives: a profile
(:class:`~lightning_galvatron.search.profile_facts.ProfileFacts`) or the live modules
(:class:`~lightning_galvatron.runtime.model_facts.LiveModelFacts`, whose blocks answer from their tensor-parallel
plans). Both sides therefore object to the same plans at the same places, in one message format; where the live model
knows more (the names of the sizes a plan splits, why a block has no style), its reasons say more.

Reasons are phrases without the location (``layers[3]``, ``vocab``): :func:`plan_problems` says where. Only plan
validity (degrees that divide the stage, batch divisibility, chunks per block) is not here: a
:class:`~lightning_galvatron.plan.ParallelPlan` cannot be built without it.

Torch-free, like :mod:`lightning_galvatron.plan`: the search runs offline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from lightning_galvatron.plan import LayerStrategy, ParallelPlan

__all__ = [
    "PLAN_RULES",
    "BlockFacts",
    "ModelFacts",
    "block_problem",
    "compile_problem",
    "degree_problem",
    "interleaved_rounds",
    "manual_optimization_problem",
    "pipeline_problem",
    "plan_problems",
    "schedule_problem",
    "sequence_problem",
    "token_mean_problem",
    "vocab_problem",
]


# ---------------------------------------------------------------------------------------------- pipeline
def interleaved_rounds(pp: int, micro_batches: int) -> int:
    """Rounds of ``ScheduleInterleaved1F1B``: ``max(1, m // pp)``; each runs ``m / rounds`` micro-batches
    through every local chunk before the next chunk starts."""
    return max(1, micro_batches // pp)


def schedule_problem(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> str | None:
    """Micro-batch counts ``torch.distributed.pipelining`` accepts for a schedule (``pp > 1``).

    GPipe: any. 1F1B: ``m >= pp``. Interleaved 1F1B (torch's "flex" variant): ``m`` a multiple of its
    rounds (:func:`interleaved_rounds`), so ``m < pp`` and e.g. ``m = 6, pp = 4`` run too.
    ``virtual_stages`` does not restrict ``m``. Without a pipeline the schedule is moot.
    """
    if pp == 1:
        return None
    m = micro_batches
    if schedule == "1f1b" and m < pp:
        return (
            f"schedule '1f1b' needs micro_batches >= pp in torch.distributed.pipelining (micro_batches={m}, pp={pp}): "
            f"use at least {pp} micro-batches, or schedule 'gpipe' or 'interleaved_1f1b'"
        )
    if schedule == "interleaved_1f1b":
        rounds = interleaved_rounds(pp, m)
        if m % rounds:
            return (
                f"schedule 'interleaved_1f1b' with pp={pp} runs {rounds} rounds of micro-batches in "
                f"torch.distributed.pipelining; micro_batches={m} is not a multiple of that: use a multiple of "
                f"{pp} or fewer than {2 * pp} micro-batches"
            )
    return None


def pipeline_problem(pp: int, block_lists: int | Sequence[str]) -> str | None:
    """Pipelines cut one block list: a decoder's stages would need the encoder's output.

    ``block_lists``: how many lists hold the blocks, or their paths (for the message).
    """
    count = block_lists if isinstance(block_lists, int) else len(block_lists)
    if pp == 1 or count <= 1:
        return None
    lists = (
        f"{count} block lists (encoder and decoder)"
        if isinstance(block_lists, int)
        else (f"several block lists ({', '.join(block_lists)})")
    )
    return (
        f"pp={pp} is not executable: pipeline parallelism over {lists} is not supported: the decoder's stages would "
        "need the encoder's output; use pp=1 (every other kind of parallelism works per block)"
    )


def manual_optimization_problem(plan: ParallelPlan) -> str | None:
    """Pipelines and micro-batches run the backward pass inside the strategy, between the micro-batches; a
    ``training_step`` with manual optimization runs its own backward and optimizer steps on the whole batch."""
    if plan.pp == 1 and plan.micro_batches == 1:
        return None
    return (
        f"manual optimization (automatic_optimization = False) cannot run under this plan's pp={plan.pp} and "
        f"micro_batches={plan.micro_batches}: pipelines and micro-batches run the backward pass inside the strategy; "
        'use a plan with pp=1 and micro_batches=1, or plan="auto" (it then leaves pipelines and micro-batches out)'
    )


def own_loop_problem(plan: ParallelPlan) -> str | None:
    """A loop of the user's own (Lightning Fabric: ``loss = loss_fn(model(x), y); fabric.backward(loss)``) runs the
    forward, the loss and the backward itself, once per step: a pipeline schedule or micro-batches would have to
    split the step into per-micro-batch forward, loss and backward, which only the Trainer's strategy can."""
    if plan.pp == 1 and plan.micro_batches == 1:
        return None
    return (
        f"Fabric cannot run this plan's pp={plan.pp} and micro_batches={plan.micro_batches}: your loop calls the model "
        "and computes the loss itself, which a pipeline schedule or micro-batches would have to split per "
        'micro-batch; use a plan with pp=1 and micro_batches=1 (plan="auto" under Fabric searches only those), or '
        'train a LightningModule with Trainer(strategy="galvatron"), whose strategy runs the step per micro-batch'
    )


def token_mean_problem(pp: int, micro_batches: int, vocab_tp: int) -> str | None:
    """A loss averaged over tokens (labels ``-100``) trains as under DDP only where each loss holds one DDP rank's
    samples (:mod:`lightning_galvatron.strategy.token_means`): a data shard reads the samples of ``pp x vocab tp``
    DDP ranks (its stages and the embedding's tensor-parallel ranks share it), so it needs that many micro-batches."""
    ranks = pp * vocab_tp
    if micro_batches == ranks:
        return None
    return (
        f"micro_batches={micro_batches}: a loss averaged over tokens trains as under DDP only on one DDP rank's "
        f"samples per micro-batch, and each data shard of pp={pp} x vocab tp={vocab_tp} holds the samples of {ranks} "
        f"DDP ranks: use micro_batches={ranks}"
    )


# ---------------------------------------------------------------------------------------------- degrees
def degree_problem(degree: int, sizes: Mapping[str, int] | Sequence[tuple[str, int]]) -> str | None:
    """A group of ``degree`` ranks splits each named size (heads, widths, positions) in equal parts."""
    items = sizes.items() if isinstance(sizes, Mapping) else sizes
    bad = [f"{size} {what}" for what, size in items if size % degree]
    return f"degree {degree} does not divide the {', '.join(bad)}" if bad else None


def sequence_problem(degree: int, sp: str, seq_length: int) -> str | None:
    """Sequence parallelism (Megatron-SP, Ulysses) hands activations between blocks split in equal parts of the
    sequence; Ulysses leaves each rank at least two positions (attention code tells a causal pass from a
    one-token decoding step by the length it sees)."""
    if sp == "none" or degree == 1:
        return None
    problem = degree_problem(degree, {"sequence positions": seq_length})
    if problem is None and sp == "ulysses" and seq_length // degree < 2:
        problem = f"Ulysses of degree {degree} leaves {seq_length // degree} of the {seq_length} positions per rank"
    return problem


def vocab_problem(strategy: LayerStrategy, vocab_parallel: bool) -> str | None:
    """The embedding and head: whole sequences (the user's step computes the loss on them); any
    vocabulary-parallel degree where the model has a token table to split (uneven shards are fine)."""
    if strategy.sp != "none":
        return (
            f"sp={strategy.sp!r}: the embedding and head run on whole sequences (your training_step computes the loss "
            "on them); use vocab sp='none' (vocabulary tensor parallelism is fine)"
        )
    if strategy.tp > 1 and not vocab_parallel:
        return (
            f"tp={strategy.tp}: the model has no token embedding (an nn.Embedding outside the blocks) to split by "
            "vocabulary; use vocab tp=1"
        )
    return None


# ---------------------------------------------------------------------------------------------- blocks
class BlockFacts(Protocol):
    """What the rules read of one block: a profile's block type (:class:`LayerTypeFacts`) or a live block."""

    @property
    def name(self) -> str:
        """The block's class or type, for messages."""
        ...

    @property
    def seq_length(self) -> int | None:
        """The sequence positions a sequence-parallel degree must divide (``None``: not known yet)."""
        ...

    @property
    def why_no_tensor_parallel_plan(self) -> str | None:
        """Why the block has no tensor-parallel plan at all, or ``None`` where it has one."""
        ...

    def unsupported(self, tp: int, sp: str) -> str | None:
        """The block's own half of the rules: why ``(tp, sp)`` cannot run on it (which styles it has, which sizes
        they split), or ``None``; called only where it has a plan and ``tp > 1``."""
        ...


def block_problem(strategy: LayerStrategy, block: BlockFacts) -> str | None:
    """Whether ``block`` runs ``strategy``'s model-parallel group: it needs a tensor-parallel plan, its own half
    of the rules (:meth:`BlockFacts.unsupported`) and, for sequence parallelism, a sequence split in equal parts."""
    tp, sp = strategy.tp, strategy.sp
    if tp == 1:
        return None
    missing = block.why_no_tensor_parallel_plan
    if missing is not None:
        # Without a plan nothing says which sizes a degree must divide, nor (for Ulysses) that the block takes only
        # per-position inputs.
        kind = f"tp={tp}" if sp != "ulysses" else f"Ulysses of degree {tp}"
        return (
            f"{block.name} has no tensor-parallel plan, so {kind} cannot run ({missing}); use tp=1 for it or register "
            "a plan with lightning_galvatron.register_tensor_parallel_plan"
        )
    reason = block.unsupported(tp, sp)
    if reason is None and block.seq_length is not None:
        reason = sequence_problem(tp, sp, block.seq_length)
    return None if reason is None else f"{block.name} cannot run tp={tp}, sp={sp!r}: {reason}"


def compile_problem(plan: ParallelPlan, options: Mapping[str, object] | None) -> str | None:
    """Blocks compiled with dynamic shapes cannot be recomputed exactly: the recomputation could take another
    compiled graph than the forward pass (see :mod:`lightning_galvatron.runtime.compile`)."""
    recomputed = [i for i, s in enumerate(plan.layers) if s.recompute]
    if options is None or not recomputed or options.get("dynamic") is False:
        return None
    return (
        f"compile={{'dynamic': {options.get('dynamic')!r}}} with recomputation (layers {recomputed}): a block's "
        "recomputation could take another compiled graph than its forward pass and compute wrong gradients "
        "(pytorch/pytorch#166926); leave 'dynamic' out (static shapes), or use a plan without recompute"
    )


# ---------------------------------------------------------------------------------------------- a whole plan
class ModelFacts(Protocol):
    """What the whole-plan rules read of a model and how it runs: a profile
    (:class:`~lightning_galvatron.search.profile_facts.ProfileFacts`) and the live
    modules (:class:`~lightning_galvatron.runtime.model_facts.LiveModelFacts`) both give it."""

    @property
    def block_lists(self) -> int | Sequence[str]:
        """The containers holding the blocks: how many, or their paths (for messages)."""
        ...

    @property
    def has_token_embedding(self) -> bool:
        """Whether there is a token table (an ``nn.Embedding`` outside the blocks) to split by vocabulary."""
        ...

    @property
    def compile_options(self) -> Mapping[str, object] | None:
        """The ``torch.compile`` arguments the blocks are compiled with (``None``: not compiled, or not known)."""
        ...

    def block(self, index: int) -> BlockFacts:
        """Block ``index`` (in the plan's order)."""
        ...


def _at(where: str, problem: str | None) -> Iterator[str]:
    """The one message format: ``where: problem`` (no location for the whole plan)."""
    if problem is not None:
        yield f"{where}: {problem}" if where else problem


def _schedule_rule(plan: ParallelPlan, model: ModelFacts) -> Iterator[str]:
    return _at("", schedule_problem(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages))


def _pipeline_rule(plan: ParallelPlan, model: ModelFacts) -> Iterator[str]:
    return _at("", pipeline_problem(plan.pp, model.block_lists))


def _vocabulary_rule(plan: ParallelPlan, model: ModelFacts) -> Iterator[str]:
    return _at("vocab", vocab_problem(plan.vocab, plan.vocab.tp == 1 or model.has_token_embedding))


def _block_rule(plan: ParallelPlan, model: ModelFacts) -> Iterator[str]:
    for index, strategy in enumerate(plan.layers):
        if strategy.tp > 1:
            yield from _at(f"layers[{index}]", block_problem(strategy, model.block(index)))


def _compile_rule(plan: ParallelPlan, model: ModelFacts) -> Iterator[str]:
    return _at("", compile_problem(plan, model.compile_options))


#: Every whole-plan rule, in the order its problems are reported: a new kind of parallelism adds its rule here
#: (per block: to :func:`block_problem` and :meth:`BlockFacts.unsupported`).
PLAN_RULES: tuple[Callable[[ParallelPlan, ModelFacts], Iterator[str]], ...] = (
    _schedule_rule,
    _pipeline_rule,
    _vocabulary_rule,
    _block_rule,
    _compile_rule,
)


def plan_problems(plan: ParallelPlan, model: ModelFacts) -> list[str]:
    """Every rule ``plan`` breaks for ``model``, each prefixed by where (empty: executable). The plan has one strategy
    per block of the model (checked by the callers, which say what each model has)."""
    return [problem for rule in PLAN_RULES for problem in rule(plan, model)]
