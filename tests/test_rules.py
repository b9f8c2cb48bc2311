"""One source for what is executable: the search's space, ``evaluate``'s verdict and the runtime's check agree.

Hypothesis draws small models -- real modules on the meta device: a decoder whose FFN need not be a multiple
of its heads, with or without a token embedding; an encoder-decoder in two block lists; blocks no
tensor-parallel plan knows -- and valid plans for them. The profile is made from the modules as ``estimate``
and ``dry-run`` make one (block shapes, then an analytic profile). For every plan:

- ``evaluate`` warns exactly the rules' problems;
- the runtime's pure check (:func:`~lightning_galvatron.runtime.apply.runtime_problems`, from the modules and the
  tensor-parallel plans the glue resolves for them) objects at the same places (plan, vocab, which layers): both are
  :func:`~lightning_galvatron.plan.rules.plan_problems`, over a profile's facts and over the live model's;
- the search's space offers the plan (under options that do not prune it as unable to win) iff there is no
  problem.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from examples.gpt import GPT, GPTConfig
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.shapes import architecture_of_module
from lightning_galvatron.model.tensor_parallel_plans import block_tensor_parallel_plans
from lightning_galvatron.plan import DP_TYPES, SCHEDULES, SP_KINDS, LayerStrategy, ParallelPlan, divisors
from lightning_galvatron.plan.rules import interleaved_rounds, plan_problems, schedule_problem
from lightning_galvatron.producers.analytic import analytic_profile
from lightning_galvatron.runtime.apply import runtime_problems
from lightning_galvatron.search import evaluate
from lightning_galvatron.search.pipeline import in_flight_micro_batches, pipeline_step_time
from lightning_galvatron.search.profile_facts import ProfileFacts
from lightning_galvatron.search.space import (
    PipelineConfig,
    SearchOptions,
    layer_candidates,
    pipeline_configs,
    pipeline_degrees,
    vocab_candidates,
)
from tests.helpers.model_families import PlainBlocksLM, TorchSeq2Seq
from tests.search_profiles import synthetic_hardware, synthetic_profile


# ---------------------------------------------------------------------------------------------- models
class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # run by the proof of the inferred tensor-parallel plan
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, ffn)
        self.down_proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.gelu(self.up_proj(x)))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.norm_1, self.attn = nn.LayerNorm(hidden), _Attention(hidden, heads)
        self.norm_2, self.mlp = nn.LayerNorm(hidden), _MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class _Decoder(nn.Module):
    def __init__(self, blocks: int, hidden: int, heads: int, ffn: int, embedding: bool) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(16, hidden) if embedding else nn.Linear(4, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads, ffn) for _ in range(blocks))
        self.head = nn.Linear(hidden, 16)


MODELS = st.one_of(
    # blocks, heads, head width, FFN width beyond the hidden size, a token embedding
    st.tuples(
        st.just("decoder"),
        st.integers(2, 4),
        st.sampled_from([1, 2, 3, 4, 6]),
        st.integers(1, 2),
        st.sampled_from([0, 1, 3]),
        st.booleans(),
    ),
    st.tuples(st.just("gpt"), st.integers(2, 4), st.sampled_from([1, 2, 4])),
    st.just(("seq2seq",)),
    st.just(("plain",)),
)


@functools.cache
def model(key: tuple):
    with torch.device("meta"):
        if key[0] == "decoder":
            _, blocks, heads, head_dim, extra, embedding = key
            hidden = heads * head_dim
            module = _Decoder(blocks, hidden, heads, hidden + extra, embedding)  # FFN >= hidden, any multiple
        elif key[0] == "gpt":
            module = GPT(GPTConfig(vocab_size=16, seq_length=8, n_layer=key[1], n_head=key[2], n_embd=2 * key[2]))
        else:
            module = TorchSeq2Seq() if key[0] == "seq2seq" else PlainBlocksLM()
    structure = find_blocks(module)
    return structure, architecture_of_module(module), block_tensor_parallel_plans(structure)


@functools.cache
def profile(key: tuple, seq: int, per_node: int):
    rng = np.random.default_rng(0)
    reference = synthetic_profile(rng, 4)
    return analytic_profile(model(key)[1], reference, seq, synthetic_hardware(rng, devices_per_node=per_node))[0]


# ---------------------------------------------------------------------------------------------- plans
@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple, int, int, ParallelPlan]:
    key = draw(MODELS)
    structure = model(key)[0]
    num_blocks = structure.num_blocks
    seq, world, per_node = draw(st.integers(1, 12)), draw(st.integers(1, 8)), draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([p for p in divisors(world) if p <= num_blocks]))
    n = world // pp
    schedule, virtual = "1f1b", 1
    if pp > 1:
        schedule = draw(st.sampled_from(SCHEDULES))
        chunks = [v for v in (2, 3) if pp * v <= num_blocks]
        if schedule == "interleaved_1f1b":
            if chunks:
                virtual = draw(st.sampled_from(chunks))
            else:
                schedule = "1f1b"
    micro_batches = draw(st.integers(1, 8))

    def strategy(vocab: bool) -> LayerStrategy:
        g = draw(st.sampled_from(divisors(n)))
        return LayerStrategy(
            tp=g,
            sp="none" if g == 1 else draw(st.sampled_from(SP_KINDS)),
            dp_type="ddp" if g == n else draw(st.sampled_from(DP_TYPES)),  # ZeRO at dp = 1 is pruned (it is DDP)
            recompute=not vocab and draw(st.booleans()),
            # Strided layouts are offered only where they change costs: a group inside a stage that spans nodes.
            tp_consecutive=vocab or not (1 < g < n and n > per_node) or draw(st.booleans()),
        )

    layers = tuple(strategy(False) for _ in range(num_blocks))
    vocab = strategy(True)
    granularity = math.lcm(*(n // s.tp * micro_batches for s in (*layers, vocab)))
    plan = ParallelPlan(
        world_size=world,
        layers=layers,
        vocab=vocab,
        pp=pp,
        schedule=schedule,
        micro_batches=micro_batches,
        virtual_stages=virtual,
        global_batch_size=granularity * draw(st.integers(1, 2)),
    )
    return key, seq, per_node, plan


def offered(plan: ParallelPlan, model_profile, per_node: int) -> bool:
    """Whether the search's space holds every choice of ``plan``, under options that prune none of them."""
    pp, m, v, B, L = plan.pp, plan.micro_batches, plan.virtual_stages, plan.global_batch_size, plan.num_layers
    dominated_gpipe = plan.schedule == "gpipe" and m >= pp  # GPipe at m >= pp is left out when 1F1B is allowed
    options = SearchOptions(
        schedules=("gpipe", "interleaved_1f1b") if dominated_gpipe else SCHEDULES, virtual_stages=(max(v, 2),)
    )
    if pp not in pipeline_degrees(plan.world_size, L, options, model_profile.block_lists):
        return False
    if PipelineConfig(pp, plan.schedule, m, v) not in pipeline_configs(pp, B, L, options):
        return False
    n, per_micro = plan.devices_per_stage, B // m
    layers = all(
        s in layer_candidates(model_profile.block_type(i), n, per_micro, n > per_node, options)
        for i, s in enumerate(plan.layers)
    )
    vocab = vocab_candidates(model_profile.vocab, model_profile.seq_length, n, per_micro, options)
    return layers and plan.vocab in vocab


def _where(problem: str) -> str:
    if problem.startswith("layers["):
        return problem[: problem.index("]") + 1]
    return "vocab" if problem.startswith("vocab") else "plan"


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_search_evaluate_and_runtime_agree_on_what_is_executable(case):
    key, seq, per_node, plan = case
    structure, _, tp_plans = model(key)
    prof = profile(key, seq, per_node)
    problems = plan_problems(plan, ProfileFacts(prof.model))
    event("executable" if not problems else "refused for " + ", ".join(sorted({_where(p) for p in problems})))
    assert list(evaluate(prof, plan).warnings) == problems
    refused = runtime_problems(plan, structure, tp_plans, seq_length=seq)
    assert {_where(p) for p in refused} == {_where(p) for p in problems}, (refused, problems)
    assert offered(plan, prof.model, per_node) == (not problems), problems


def test_a_profile_and_the_live_model_break_the_same_rules_in_the_same_words():
    """One check over two sources of facts: a plan breaking a rule of every kind (schedule, vocabulary, a block's
    sizes, the sequence under Ulysses and Megatron-SP, compilation with recomputation) is refused for the profile made
    from the modules and for the modules themselves with the same messages; only the sizes a degree must divide are
    named by the live model's tensor-parallel plan, which a profile records as numbers."""
    key, seq, options = ("gpt", 4, 2), 3, {"dynamic": None}
    structure, _, tp_plans = model(key)
    plan = ParallelPlan(
        world_size=8,
        pp=2,
        schedule="1f1b",
        micro_batches=1,  # 1F1B needs micro_batches >= pp
        vocab=LayerStrategy(tp=2, sp="ulysses"),  # the embedding and head run on whole sequences
        layers=(
            LayerStrategy(tp=2, sp="ulysses"),  # 2 does not divide 3 positions
            LayerStrategy(tp=4),  # 4 does not divide the 2 heads
            LayerStrategy(),
            LayerStrategy(tp=2, sp="megatron", recompute=True),  # 3 positions; recomputed under dynamic shapes
        ),
        global_batch_size=4,
    )
    profiled = plan_problems(plan, ProfileFacts(profile(key, seq, 4).model, compile_options=options))
    live = runtime_problems(plan, structure, tp_plans, seq_length=seq, compile_options=options)
    assert [_where(p) for p in live] == ["plan", "vocab", "layers[0]", "layers[1]", "layers[3]", "plan"], live
    sizes = "layers[1]: Block cannot run tp=4, sp='none': degree 4 does not divide the 2 "
    assert live[3].startswith(sizes) and profiled[3].startswith(sizes), (live[3], profiled[3])
    assert live[:3] + live[4:] == profiled[:3] + profiled[4:]
    assert live[1].startswith("vocab: sp='ulysses'") and "3 sequence positions" in live[2]


# ---------------------------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_schedule_rules_are_torchs(pp):
    """1F1B needs m >= pp; torch's interleaved 1F1B runs m micro-batches in max(1, m // pp) rounds of equal size
    (so m < pp runs, and m = 6 at pp = 4: one round of 6)."""
    for m in range(1, 4 * pp):
        assert (schedule_problem("1f1b", pp, m) is None) == (m >= pp)
        assert schedule_problem("gpipe", pp, m) is None
        assert (schedule_problem("interleaved_1f1b", pp, m, 2) is None) == (m % max(1, m // pp) == 0)
    assert schedule_problem("1f1b", 1, 1) is None and interleaved_rounds(4, 10) == 2


def test_interleaved_with_fewer_micro_batches_than_stages_is_priced_as_it_runs():
    """With m < pp a rank waits for each micro-batch to come round the ring before its next chunk: one
    micro-batch crosses all pp x v chunks, the others follow one chunk apart (torch's order, uniform stages)."""
    stage = np.full(4, 6.0)  # v = 2 chunks of forward 1 + backward 2 per micro-batch
    assert pipeline_step_time(stage, 1, 2) == pytest.approx(24.0)  # 8 chunks x 3
    assert pipeline_step_time(stage, 3, 2) == pytest.approx(24.0 + 2 * 3.0)
    assert pipeline_step_time(stage, 4, 2) == pytest.approx(4 * 6.0 / 2 + (4 - 0.5) * 6.0)  # m = pp: both forms agree
    # Warm-up of torch's schedule: (v - 1) x micro-batches per round + 2 (pp - 1 - stage), capped at m v.
    assert in_flight_micro_batches("interleaved_1f1b", 4, 2, 0, 2) == pytest.approx(4 / 2)
    assert in_flight_micro_batches("interleaved_1f1b", 4, 6, 3, 2) == pytest.approx((6 + 1) / 2)
