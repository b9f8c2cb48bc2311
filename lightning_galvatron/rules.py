"""What the runtime can execute: one predicate per rule, each returning why a choice cannot run, or None.

These are the rules of executability, written once. The search offers a candidate if and only if no
rule objects (:mod:`lightning_galvatron.search.space`); :func:`~lightning_galvatron.search.evaluate`
turns objections into warnings (it still prices the plan, as a what-if); the runtime raises them as
errors before anything is changed (:func:`~lightning_galvatron.runtime.apply.check_runtime_support`),
adding only what depends on the model's code -- which sizes a block's tensor-parallel plan splits and
whether it has the style at all -- and calling :func:`degree_problem` for the arithmetic.

Reasons are phrases without the location (``layers[3]``, ``vocab``): each caller says where. Only plan
validity (degrees that divide the stage, batch divisibility, chunks per block) is not here: a
:class:`~lightning_galvatron.plan.ParallelPlan` cannot be built without it.

Torch-free, like :mod:`lightning_galvatron.plan`: the search runs offline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_galvatron.plan import LayerStrategy, ParallelPlan
from lightning_galvatron.profiles import LayerTypeProfile, ModelProfile

__all__ = [
    "degree_problem",
    "interleaved_rounds",
    "layer_problem",
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
    samples (:mod:`lightning_galvatron.token_means`): a data shard reads the samples of ``pp x vocab tp`` DDP ranks
    (its stages and the embedding's tensor-parallel ranks share it), so it needs that many micro-batches."""
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


def layer_problem(strategy: LayerStrategy, layer: LayerTypeProfile) -> str | None:
    """Whether a block type, described by its profile, runs ``strategy``'s model-parallel group.

    Megatron TP splits what the block's tensor-parallel plan splits (the profile's ``tensor_parallel_divisors``:
    heads, key/value heads, widths; heads, hidden and FFN for profiles without them); Ulysses splits the
    (query) heads (``ulysses_divisors``, else ``num_heads``) and keeps whole weights; both sequence-parallel
    kinds split the sequence between blocks. Which styles a block type has at all is the profile's
    ``supports_*`` (from its tensor-parallel plan).
    """
    g, sp = strategy.tp, strategy.sp
    if g == 1:
        return None
    if sp == "ulysses":
        if not layer.supports_ulysses:
            return f"{layer.name} cannot run Ulysses sequence parallelism"
        heads = [("attention heads", size) for size in layer.ulysses_divisors or (layer.num_heads,)]
        problem = degree_problem(g, heads) or sequence_problem(g, sp, layer.seq_length)
        return None if problem is None else f"Ulysses degree {g} is not executable for {layer.name}: {problem}"
    if not layer.supports_tensor_parallel:
        return f"TP degree {g} is not executable for {layer.name}: it has no tensor-parallel plan"
    if layer.tensor_parallel_divisors:
        sizes = [("(a size its tensor-parallel plan splits)", size) for size in layer.tensor_parallel_divisors]
    else:
        sizes = [
            ("attention heads", layer.num_heads),
            ("hidden size", layer.hidden_size),
            ("FFN width", layer.ffn_hidden_size),
        ]
    problem = degree_problem(g, sizes) or sequence_problem(g, sp, layer.seq_length)
    if problem is not None:
        return f"TP degree {g} is not executable for {layer.name}: {problem}"
    if sp == "megatron" and not layer.supports_megatron_sp:
        return f"{layer.name} has no Megatron sequence parallelism"
    return None


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


# ---------------------------------------------------------------------------------------------- a whole plan
def plan_problems(plan: ParallelPlan, model: ModelProfile) -> list[str]:
    """Every rule ``plan`` breaks for the profiled ``model``, each prefixed by where (empty: executable)."""
    out = []
    problem = schedule_problem(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)
    if problem is not None:
        out.append(problem)
    problem = pipeline_problem(plan.pp, model.block_lists)
    if problem is not None:
        out.append(problem)
    problem = vocab_problem(plan.vocab, model.vocab.supports_tensor_parallel)
    if problem is not None:
        out.append(f"vocab: {problem}")
    for i, strategy in enumerate(plan.layers):
        problem = layer_problem(strategy, model.block_type(i))
        if problem is not None:
            out.append(f"layers[{i}]: {problem}")
    return out
