"""Models nobody here wrote (issue 43): tensor parallelism guessed for the blocks users write themselves and proven
before use (plain and Megatron-SP); shared, nested and reshaping blocks; a model without blocks, or one the profiler
cannot run, under ``plan="auto"`` (the floor); a loop a pipeline cannot restart.

The matrix: nanoGPT-, minGPT- and Llama-style models written from scratch (nanoGPT's and minGPT's attention code
verbatim), ALBERT (one layer applied four times) and a model whose blocks widen, each x {auto, heterogeneous TP, 1F1B
pipeline, ZeRO-3 + recomputation} (nanoGPT and the Llama also Megatron-SP) against one process: per model one
reference and one pool call running every case on 4 processes
(``run_cases``); what the runtime cannot run exactly is refused before training, and the matrix checks the message
(:data:`REFUSED`). The models are in :mod:`tests.helpers.user_models`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_galvatron.model.discovery import BlockDiscoveryError, find_blocks
from lightning_galvatron.model.families._common import NarrowedInput
from lightning_galvatron.model.tensor_parallel_plans import block_tensor_parallel_plans, tensor_parallel_plan_or_reason
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from lightning_galvatron.profiler.model import profile_model
from lightning_galvatron.runtime.tensor_parallel import ColwiseFused
from lightning_galvatron.strategy.autoplan import AutomaticPlanFailed, SearchSettings, _agree_on_failure
from lightning_galvatron.strategy.model_setup import whole_model_plan
from tests.helpers.training import RunResult, assert_close_runs, dataset, refused_as_expected, run_cases, run_single
from tests.helpers.user_models import (
    NanoBlock,
    albert,
    carried_depth,
    carried_gate,
    conditioned,
    funnel,
    hidden_heads,
    llama_scratch,
    min_gpt,
    nano_gpt,
    swin,
    unlisted_blocks,
    widening,
)
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(600)


def _plan(model) -> object:
    structure = find_blocks(model)
    return block_tensor_parallel_plans(structure, "training_step", lambda: dataset(4)[0:1])[0]


# ---------------------------------------------------------------------------------------------- the inference
class _WidthFromAttributes(nn.Module):
    """nanoGPT's attention as some copies write it: every size from its own attributes, none from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head, self.n_embd = nn.Linear(32, 96), nn.Linear(32, 32), 4, 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_embd))


class _InputValuesToo(_WidthFromAttributes):
    """Reads its width from its input, as nanoGPT does, and also adds the input's mean to its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)) + x.mean(-1, keepdim=True)


def _with_attention(attention: nn.Module) -> nn.Module:
    block = nano_gpt().transformer.h[0]
    block.attn = attention
    return block


def test_plans_are_inferred_and_proven_for_blocks_written_from_scratch():
    """nanoGPT's and minGPT's fused ``c_attn`` is split as ``[q | k | v]`` (each rank its heads of each part), their
    ``n_head``/``n_embd`` divided by the degree, and their attention, which reads its width ``C`` from its input,
    receives this rank's part of it (``NarrowedInput``); an attention taking every size from its attributes needs
    no narrowing. Llama's ``wq``/``wk``/``wv``/``wo`` and ``w1``/``w2``/``w3`` with its grouped key/value heads --
    proven on a real call, since its blocks also take the rotary table."""
    # Without a call to take its rotary table from, Llama's guess cannot be proven (yet): tp=1, with why.
    unproven = tensor_parallel_plan_or_reason(find_blocks(llama_scratch()).blocks[0])
    assert "cannot be proven on it: its forward takes more than its hidden states" in unproven
    for factory in (nano_gpt, min_gpt):
        plan = _plan(factory())
        assert not isinstance(plan, str), plan
        styles = plan.styles(False)
        assert isinstance(styles["attn.c_attn"], ColwiseFused) and styles["attn.c_attn"].sections == (32, 32, 32)
        assert isinstance(styles["attn"], NarrowedInput) and styles["attn"].columns == ("c_attn",), factory
        assert plan.divisible["attention heads"] == 4
        assert plan.megatron_sp == (factory is nano_gpt)  # minGPT's MLP is a ModuleDict it never calls
    attributes = tensor_parallel_plan_or_reason(_with_attention(_WidthFromAttributes()))
    assert not isinstance(attributes, str) and "attn" not in attributes.styles(False)
    llama = _plan(llama_scratch())
    assert not isinstance(llama, str), llama
    assert llama.divisible["key/value heads"] == 2 and llama.unsupported(4, "none") is not None
    # Proven once, the verdict holds for every block of that kind.
    assert not isinstance(tensor_parallel_plan_or_reason(find_blocks(llama_scratch()).blocks[1]), str)


def test_a_wrong_guess_is_caught_by_the_proof():
    """A head count hidden in an attribute no rule knows (``self.groups``) would split into heads of half the width and
    train without an error; an attention that reads its width from its input but also uses the input's values would
    add a part of them only. Both are planned with tp=1 and say why."""
    hidden = _plan(hidden_heads())
    assert isinstance(hidden, str) and "is wrong for it: split 2 ways, it computes another function" in hidden
    values = tensor_parallel_plan_or_reason(_with_attention(_InputValuesToo()))
    assert isinstance(values, str) and "split 2 ways, it computes another function" in values
    assert "uses its input's values besides its projections" in values


class _MixesPositions(NanoBlock):
    """Adds the mean over the sequence to its output: outside its sub-layers, so Megatron-SP would average each rank's
    part of the sequence alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + x.mean(1, keepdim=True)


def test_the_megatron_sp_variant_of_a_guess_is_proven_too():
    """nanoGPT's guessed Megatron-SP variant (norms on sequence shards, the sub-layers gathering the sequence, the
    output projections reduce-scattering it) computes what the block computes; a block that mixes positions outside
    its sub-layers keeps plain tensor parallelism and is refused Megatron-SP, with why."""
    assert tensor_parallel_plan_or_reason(nano_gpt().transformer.h[0]).megatron_sp
    plan = tensor_parallel_plan_or_reason(_MixesPositions())
    assert not isinstance(plan, str) and plan.unsupported(2, "none") is None
    why = plan.unsupported(2, "megatron")
    assert "the Megatron-SP variant of the plan inferred for _MixesPositions is wrong for it" in why
    assert "with Megatron-SP, it computes another function than the whole block" in why


def test_layers_of_the_block_itself_and_fused_head_by_head_layouts():
    """Whisper's ``fc1``/``fc2`` sit on the layer itself (a dotless name has no parent sub-layer); a fused projection
    laid out head by head (each head's q, k, v together) takes the other layout the proof tries."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out_proj, self.num_heads = nn.Linear(32, 96), nn.Linear(32, 32), 4

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, -1, 3, 8).permute(3, 0, 2, 1, 4)  # head by head
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.norm = Attention(), nn.LayerNorm(32)
            self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attn(self.norm(x))
            return x + self.fc2(torch.relu(self.fc1(x)))

    plan = tensor_parallel_plan_or_reason(Layer())
    assert not isinstance(plan, str), plan
    styles = plan.styles(False)
    assert type(styles["self_attn.qkv"]).__name__ == "ColwiseParallel"  # whole heads on each rank
    assert {"fc1", "fc2"} <= styles.keys()


# ---------------------------------------------------------------------------------------------- the matrix
#: model -> (factory, global batch). Llama's rotary table is [SEQ, head_dim / 2] = [8, 4] and Funnel's pooled
#: position tables have 4 rows: no data shard may hold 8 or 4 samples (the runtime would take their first dimension
#: for samples and move them with them).
MODELS = {
    "nano_gpt": (nano_gpt, 8),
    "min_gpt": (min_gpt, 8),
    "llama_scratch": (llama_scratch, 12),
    "albert": (albert, 8),  # one layer group applied 4 times: one block
    "widening": (widening, 8),  # blocks of widths 32, 32 -> 48, 48, 48
}
#: Models also run under Megatron-SP on their guessed plan.
_SEQUENCE = ("nano_gpt", "llama_scratch")
_HETEROGENEOUS = (
    S(tp=2, dp_type="zero3"),
    S(tp=4, recompute=True),
    S(dp_type="zero2"),
    S(tp=2, tp_consecutive=False, dp_type="zero3", recompute=True),
)


def cases(name: str) -> dict[str, dict]:
    """auto (no trials: the search's plan), heterogeneous tensor parallelism, an uneven 1F1B pipeline over ddp,
    ZeRO-3, tensor-parallel and recomputed blocks, and uniform ZeRO-3 with recomputation -- sized to the model."""
    factory, _ = MODELS[name]
    blocks = len(find_blocks(factory()).blocks)
    layers = _HETEROGENEOUS[:blocks]
    if name == "llama_scratch":  # two key/value heads
        layers = tuple(S(tp=2, recompute=s.recompute, dp_type=s.dp_type) if s.tp == 4 else s for s in layers)
    out = {
        "auto": dict(strategy_kwargs=dict(trials=False, save_plan=False)),
        "tensor": dict(plan=ParallelPlan(world_size=4, layers=layers)),
        "pp_1f1b": dict(
            plan=ParallelPlan(
                world_size=4,
                layers=(S(), S(dp_type="zero3"), S(tp=2), S(recompute=True))[:blocks],
                pp=2,
                partition=(1, blocks - 1) if blocks > 1 else None,
                schedule="1f1b",
                micro_batches=2,
            )
            if blocks > 1
            else {"world_size": 4, "layers": [{}], "pp": 2}
        ),
        "zero3_recompute": dict(
            plan=ParallelPlan.uniform(4, blocks, S(dp_type="zero3", recompute=True), vocab=S(dp_type="zero3"))
        ),
    }
    if name in _SEQUENCE:  # Megatron-SP on the guessed plan, proven (Llama's on a real call: it takes its rotary table)
        sequence = tuple(S(tp=s.tp, sp="megatron" if s.tp > 1 else "none", dp_type=s.dp_type) for s in layers)
        out["sequence"] = dict(plan=ParallelPlan(world_size=4, layers=sequence))
    return out


CASES = ["auto", "tensor", "pp_1f1b", "zero3_recompute"]
#: (model, case) -> what the refusal says.
REFUSED: dict[tuple[str, str], str] = {
    ("albert", "tensor"): r"AlbertLayerGroup has no tensor-parallel plan, so tp=2 cannot run",
    ("albert", "pp_1f1b"): r"2 pipeline chunks \(pp=2 x virtual_stages=1\) for only 1 blocks",
}
_RESULTS: dict[str, tuple[RunResult, dict[str, RunResult | str]]] = {}


def _matrix(pools, cache: str, name: str) -> tuple[RunResult, dict[str, RunResult | str]]:
    """The model's reference and every case, computed once (the first test of the model pays for all)."""
    if name not in _RESULTS:
        factory, batch = MODELS[name]
        expected = run_single(model=factory, global_batch=batch)
        runs = cases(name)
        runs["auto"]["strategy_kwargs"]["profile_cache"] = cache
        results = pools(4).run(run_cases, runs, factory, batch, cache, timeout=500)[0]
        if any(isinstance(r, str) and not r.startswith("PlanError") for r in results.values()):
            pools(4).shutdown()  # a failed case may leave ranks out of step: the next model gets a fresh pool
        _RESULTS[name] = expected, results
    return _RESULTS[name]


@pytest.fixture(scope="module")
def user_profiles(tmp_path_factory, linked_profile_cache) -> str:
    """One profile cache for the module: each model is profiled once, the cluster once for the session."""
    return str(linked_profile_cache(tmp_path_factory.mktemp("user-profiles")))


@pytest.mark.parametrize(
    "name, case",
    [pytest.param(n, c, id=f"{n}-{c}") for n in MODELS for c in (*CASES, "sequence") if c in CASES or n in _SEQUENCE],
)
def test_user_model_matches_one_process(pools, user_profiles, name, case):
    expected, results = _matrix(pools, user_profiles, name)
    outcome = results[case]
    if refused_as_expected(outcome, REFUSED.get((name, case))):
        return
    assert_close_runs(outcome, expected, **FP32_TOL)
    if case == "tensor":  # the guessed plans ran: blocks split as asked
        assert any(s.tp > 1 for s in outcome.plan.layers)


# ---------------------------------------------------------------------------------------------- other structures
def _auto(profile_cache: str) -> dict:
    return dict(strategy_kwargs=dict(trials=False, save_plan=False, profile_cache=profile_cache))


def test_nested_and_reshaping_stages_train_under_auto(pools, profile_cache):
    """Funnel's encoder keeps its blocks in a list of lists (found as the lists inside: a list of lists is never
    called, so no hook on it would run), the sequence pooled between them; Swin's stages merge patches (4x fewer
    positions, twice the width): the profiler probes no pipeline of them and the search plans none. Both train under
    ``plan="auto"`` as one process does."""
    funnel_lists = [bl.path for bl in find_blocks(funnel()).block_lists]
    assert funnel_lists == [
        "model.funnel.encoder.blocks.0",
        "model.funnel.encoder.blocks.1",
        "model.funnel.decoder.layers",
    ]
    with pytest.raises(BlockDiscoveryError, match=r"holds ModuleLists, which the model never calls"):
        find_blocks(funnel(), "model.funnel.encoder.blocks")
    for factory, batch in ((funnel, 12), (swin, 8)):
        result = pools(4).run(run_cases, {"auto": _auto(str(profile_cache))}, factory, batch, str(profile_cache))[0]
        outcome = result["auto"]
        assert not isinstance(outcome, str), outcome
        assert outcome.plan.pp == 1
        assert_close_runs(outcome, run_single(model=factory, global_batch=batch), **FP32_TOL)


def test_a_loop_carrying_state_besides_the_hidden_states_is_refused_a_pipeline(pools):
    """A pipeline stage restarts the model's loop at its first block. A depth this loop counts (a Python int, as Swin's
    stage sizes) would restart at 0, and a gate tensor it hands on at its first value: both train something else
    without an error. Refused before training, with why (the tensor by the trace of what a block's inputs are computed
    from, the count by restarting the loop at each block)."""
    plan = ParallelPlan(world_size=4, layers=(S(),) * 4, pp=2, schedule="1f1b", micro_batches=2)
    depth = pools(4).run(run_cases, {"pp": dict(plan=plan)}, carried_depth, 8, "")[0]["pp"]
    assert isinstance(depth, str) and depth.startswith("PlanError:"), depth
    assert "its loop over transformer.h hands block 1 argument 1 = 1, but 0 when restarted there" in depth
    assert "the loop carries state from block to block besides the hidden states" in depth
    gate = pools(4).run(run_cases, {"pp": dict(plan=plan)}, carried_gate, 8, "")[0]["pp"]
    assert isinstance(gate, str) and gate.startswith("PlanError:"), gate
    assert "transformer.h.1 receives an input (argument 1) computed from" in gate


def test_a_model_without_blocks_trains_whole_under_auto(pools, profile_cache):
    """No list holds this model's blocks: ``plan="auto"`` trains it as one unit, under DDP where that fits and ZeRO-2
    where only that does, and says why; a given plan keeps the refusal."""
    parameters = sum(p.numel() for p in unlisted_blocks().parameters())
    tight = int(parameters * 7.5)  # AdamW in fp32: DDP holds 16 bytes per parameter, ZeRO-2 on 4 ranks 7
    runs = {
        "ample": _auto(str(profile_cache)),
        "tight": dict(strategy_kwargs={**_auto(str(profile_cache))["strategy_kwargs"], "memory_budget": tight}),
        "given": dict(plan=ParallelPlan.uniform(4, 2, S())),
    }
    results = pools(4).run(run_cases, runs, unlisted_blocks, 8, str(profile_cache))[0]
    expected = run_single(model=unlisted_blocks, global_batch=8)
    for name, dp_type in (("ample", "ddp"), ("tight", "zero2")):
        outcome = results[name]
        assert not isinstance(outcome, str), outcome
        assert outcome.plan.layers == () and outcome.plan.vocab.dp_type == dp_type
        assert_close_runs(outcome, expected, **FP32_TOL)
    assert "could not find the Transformer blocks of UnlistedBlocksLM" in results["given"]


def test_a_model_the_profiler_cannot_run_trains_under_the_floor(pools, profile_cache):
    """Its blocks read per-sample state their model sets on them, so the profiler, which runs a block alone at other
    batch sizes than the step's, fails: ``plan="auto"`` trains it under DDP over every block and the rest (the floor)
    as one process does, instead of ending the user's setup."""
    model = conditioned()
    samples = dataset(2)
    batch = (samples.inputs, samples.targets)  # what one rank's step sees
    with pytest.raises(RuntimeError, match=r"shape '\[1, 1, 1\]' is invalid for input of size 4"):
        profile_model(model, find_blocks(model), batch)  # what plan="auto" meets on every rank
    outcome = pools(4).run(run_cases, {"auto": _auto(str(profile_cache))}, conditioned, 8, str(profile_cache))[0]
    outcome = outcome["auto"]
    assert not isinstance(outcome, str), outcome
    assert outcome.plan == ParallelPlan.uniform(4, 4, S(), global_batch_size=8)
    assert_close_runs(outcome, run_single(model=conditioned, global_batch=8), **FP32_TOL)


def _fails_on_rank(rank: int) -> str:
    try:
        failure = "RuntimeError: rank-only trouble" if dist.get_rank() == rank else None
        _agree_on_failure(failure, "profiling the model")
    except AutomaticPlanFailed as failed:
        return str(failed)
    return "no failure"


def test_a_failure_on_one_rank_is_reported_on_every_rank_and_the_floor_says_why(pools):
    """Profiling that fails on one rank stops every rank alike with that rank's error (rank 0's report names it), and
    the floor's plan says it in the setup report: data parallelism over every block, the reason given."""
    why = "profiling the model failed on rank 2: RuntimeError: rank-only trouble"
    assert pools(4).run(_fails_on_rank, 2) == [why] * 4
    model = conditioned()
    context = dict(devices_per_node=4, device=torch.device("cpu"), precision="32-true", optimizer="adamw")
    plan, prediction = whole_model_plan(
        model, find_blocks(model), 8, world_size=4, settings=SearchSettings(memory_budget="1GB"), why=why, **context
    )
    assert plan == ParallelPlan.uniform(4, 4, S(), global_batch_size=8)
    assert "trains every block and the rest of the model under ddp" in prediction.missing
    assert prediction.missing.endswith(f"since it could not do more: {why}")
    tight = SearchSettings(memory_budget=sum(p.numel() for p in model.parameters()) * 8)  # DDP needs 16 B each
    plan, _ = whole_model_plan(model, find_blocks(model), 8, world_size=4, settings=tight, why=why, **context)
    assert plan == ParallelPlan.uniform(4, 4, S(dp_type="zero2"), global_batch_size=8)


def _automatic_plan_without_pipelines(cache: str) -> tuple:
    from lightning_galvatron.strategy.autoplan import plan_automatically
    from tests.helpers.training import tiny_gpt

    model, samples = tiny_gpt(), dataset(4)
    settings = SearchSettings.of(None, cache, max_pp=1)
    auto = plan_automatically(
        model,
        find_blocks(model),
        (samples.inputs[:2], samples.targets[:2]),
        world_size=2,
        devices_per_node=2,
        precision="32-true",
        global_batch_size=4,
        device=torch.device("cpu"),
        settings=settings,
    )
    return auto.plan.pp, auto.profile.overheads.pipelines


def test_no_pipeline_is_probed_where_none_can_be_chosen(pools, profile_cache):
    """With ``max_pp=1`` the profiler runs no pipeline schedule (Swin's crashed there before; it costs time anyway)."""
    for pp, pipelines in pools(2).run(_automatic_plan_without_pipelines, str(profile_cache)):
        assert pp == 1 and pipelines == ()
