"""The model-family matrix (issue 12): every family trains, validates, tests and predicts as one process does.

Families: Hugging Face GPT-2, GPT-NeoX, Llama, Qwen3, OPT, Falcon, BLOOM, GPT-J, Phi, GPTBigCode and Phi-3
(decoder-only: multi-head, grouped-query and multi-query attention; fused and separate q/k/v; norms over each
head's queries and keys; parallel and sequential residuals; learned, rotary and ALiBi positions), BERT and ELECTRA
(encoder-only, with a padding mask; ELECTRA's embeddings narrower than its blocks), ViT (images: patches through a
convolution, no token table, a class token), T5 and BART (encoder-decoder), LitGPT's ``GPT`` and
``nn.TransformerEncoder`` (:data:`tests.helpers.model_families.FAMILY_MODELS`), built from small configs at their
defaults (KV cache and attention implementation included; dropout 0). :data:`MORE_FAMILIES` (Gemma, Qwen2,
Mistral, Gemma-3, OLMo-2, Cohere, Mixtral, Granite, Helium, SmolLM3, Starcoder2, Gemma-2, RoBERTa, DistilBERT,
DeiT, StableLM, Qwen2-MoE, MPT, CodeGen, GLM, LitGPT with per-head and with OLMo-2 query/key norms, OLMoE,
Whisper, GPT-Neo) run with ``GALVATRON_ALL_FAMILIES=1``.

Per family, one single-process reference (``fit`` with validation, ``test``, ``predict``) and one pool call
running every case of :func:`cases` on 4 processes: automatic plans with an ample budget and with one
where pure DDP does not fit, a heterogeneous tensor-parallel plan (with ZeRO-3 and recomputation in it),
sequence parallelism (Megatron-SP and Ulysses where the attention allows them), pp=2 with 1F1B on an
uneven partition and with interleaved 1F1B, and uniform ZeRO-3 with recomputation. Each must match the
reference: per-step losses and parameters (``FP32_TOL``), first-step gradients, validation and test losses,
and the prediction for every held-out sample. What the runtime cannot run exactly must be refused before
training, and the matrix checks the message (:data:`REFUSED`).
"""

from __future__ import annotations

import os

import pytest
import transformers
from torch import nn

from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.tensor_parallel_plans import tensor_parallel_plan
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan
from tests.helpers.model_families import FAMILY_MODELS, family
from tests.helpers.training import (
    RunResult,
    assert_close_runs,
    assert_same_evaluation,
    refused_as_expected,
    run_cases,
    run_single,
)
from tests.test_parity_data_parallel import FP32_TOL

pytestmark = pytest.mark.timeout(900)

#: Families whose plan and computation another family of the matrix already runs at these sizes (Llama's plan on
#: the same layers, with other norms (Gemma), biases (Qwen2) or per-head norms (Gemma-3, as Qwen3); DeiT is ViT's;
#: Mistral's sliding window is wider than the sequence; Cohere's parallel residual is Phi's and Falcon's), refusals
#: (StableLM's is unit-tested), Mixtral (its experts stay whole) and Gemma-2: the suite runs them with
#: GALVATRON_ALL_FAMILIES=1 (the suite's time on 2 cores). So do ELECTRA (BERT's layers), OPT (BART's decoder
#: layers, the same plan module), GPT-J (rotary with a parallel residual, as GPT-NeoX and Phi) and GPT-BigCode
#: (multi-query attention, as Falcon). The mixtures of experts (Mixtral, Qwen2-MoE, OLMoE),
#: OLMo-2, Whisper and GPT-Neo have registered plans proven on their blocks in tests/test_family_proofs.py.
MORE_FAMILIES = (
    "gemma",
    "qwen2",
    "mistral",
    "gemma3",
    "olmo2",
    "cohere",
    "mixtral",
    "granite",
    "helium",
    "smollm3",
    "starcoder2",
    "gemma2",
    "roberta",
    "distilbert",
    "deit",
    "stablelm",
    "qwen2_moe",
    "gpt_oss",
    "mpt",
    "codegen",
    "glm",
    "glm4",
    "litgpt_norm_qk",
    "litgpt_norm_qk_olmo2",
    "olmo",
    "mt5",
    "mbart",
    "olmoe",
    "whisper",
    "gpt_neo",
    "electra",
    "opt",
    "gptj",
    "gpt_bigcode",
)
FAMILIES = [
    *(f for f in FAMILY_MODELS if f not in MORE_FAMILIES or os.environ.get("GALVATRON_ALL_FAMILIES") == "1"),
    "torch_encoder",
]
#: nn.TransformerEncoder's causal mask is [SEQ, SEQ] = [8, 8]: no data shard may hold 8 samples (see the README).
BATCH = {"torch_encoder": 12}
ENCODER_DECODER = {"t5", "bart", "mt5", "mbart", "whisper"}
#: Predictions (logits after 3 AdamW steps) agree to rounding: parameters agree to ~1e-6 of their movement.
PREDICTION_TOL = 1e-4
#: Gemma-2's predictions move by 1e-3 in one process when its initial weights move by 1e-7 (Llama's by 5e-7), OLMo-2's
#: by 1.1e-4: the rounding of any other summation order shows at 2-4e-4, where their losses and gradients agree as
#: every family's.
PREDICTION_TOL_OF = {"gemma2": 1e-3, "olmo2": 1e-3}
#: What an inferred plan says of Ulysses where a block takes more than its hidden states.
_INFERRED_NO_SP = r"the plan inferred for \w+ from its nn\.Linear layers runs it only on blocks whose forward takes"
_TENSOR_CASES = ("tensor", "sequence", "ulysses", "pp_1f1b")

#: (family, case) -> what the refusal says, for what the runtime cannot run exactly.
REFUSED = {
    **{
        (name, case): r"pipeline parallelism over several block lists"
        for name in ENCODER_DECODER
        for case in ("pp_1f1b", "pp_interleaved")
    },
    ("bloom", "ulysses"): r"BLOOM's attention computes its scores itself \(baddbmm with ALiBi\)",
    ("mpt", "ulysses"): r"MPT's attention computes its scores itself \(matmul with an ALiBi bias\)",
    ("codegen", "ulysses"): r"CodeGen's attention computes its scores itself \(matmul in float32\)",
    # GPT-J's attention calls F.scaled_dot_product_attention in the transformers releases that support it for GPT-J.
    **(
        {}
        if getattr(transformers.GPTJPreTrainedModel, "_supports_sdpa", False)
        else {
            ("gptj", "ulysses"): r"its attention implementation is 'eager': Ulysses needs one that calls "
            r"F.scaled_dot_product_attention"
        }
    ),
    **{(name, "ulysses"): r"T5's attention computes its scores itself" for name in ("t5", "mt5")},
    ("torch_encoder", "sequence"): r"nn.MultiheadAttention checks its masks against the sequence it receives",
    ("torch_encoder", "ulysses"): r"nn.MultiheadAttention checks its masks against the sequence it receives",
    # A norm over all heads between the projections tensor parallelism splits (LitGPT's plan has no GatherWidth).
    **{("litgpt_norm_qk_olmo2", c): r"attn\.norm_q \(RMSNorm\) holds weights of shape \(32,\)" for c in _TENSOR_CASES},
    # StableLM's attention reshapes with its head counts: divided by the degree, the split proven (issue 43).
    **{(name, "ulysses"): _INFERRED_NO_SP for name in ("starcoder2", "gpt_oss", "stablelm")},
    ("gpt_neo", "ulysses"): r"GPT-Neo's attention computes its scores itself",
}


#: pp=2 with 1F1B on an uneven partition, over ddp, ZeRO-3, tensor-parallel and recomputed blocks.
PP_1F1B_MIXED = ParallelPlan(
    world_size=4,
    layers=(S(), S(dp_type="zero3"), S(tp=2), S(recompute=True)),
    pp=2,
    partition=(1, 3),
    schedule="1f1b",
    micro_batches=2,
)


def _widest_degree(blocks: list, sp: str) -> int:
    """4 where every block's plan runs it, else 2 (grouped-query attention with 2 key/value heads)."""
    plans = [tensor_parallel_plan(b) for b in blocks]
    return 4 if all(p is not None and p.unsupported(4, sp) is None for p in plans) else 2


def cases(name: str) -> dict[str, dict]:
    model = family(name)()
    blocks = find_blocks(model).blocks
    tp, megatron = _widest_degree(blocks, "none"), _widest_degree(blocks, "megatron")
    # Vocabulary parallelism where there is a token table (vision transformers read patches through a convolution).
    vocab = S(tp=2) if any(isinstance(m, nn.Embedding) for m in model.modules()) else S()
    return {
        "auto_ample": dict(auto="ample"),
        "auto_tight": dict(auto="tight"),
        "tensor": dict(
            plan=ParallelPlan(
                world_size=4,
                layers=(
                    S(tp=2, dp_type="zero3"),
                    S(tp=tp, recompute=True),
                    S(dp_type="zero2"),
                    S(tp=2, tp_consecutive=False, dp_type="zero3", recompute=True),
                ),
                vocab=vocab,
            )
        ),
        "sequence": dict(
            plan=ParallelPlan(
                world_size=4,
                layers=(
                    S(tp=2, sp="megatron", dp_type="zero3"),
                    S(tp=megatron, sp="megatron", recompute=True),
                    S(),
                    S(tp=2, sp="megatron", tp_consecutive=False, dp_type="zero2"),
                ),
                vocab=vocab,
            )
        ),
        "ulysses": dict(
            plan=ParallelPlan(
                world_size=4,
                layers=(
                    S(tp=2, sp="ulysses", dp_type="zero3"),
                    S(tp=4, sp="ulysses", recompute=True),
                    S(tp=2, sp="megatron"),
                    S(tp=2, sp="ulysses", tp_consecutive=False, dp_type="zero2"),
                ),
                vocab=vocab,
            )
        ),
        "pp_1f1b": dict(plan=PP_1F1B_MIXED),
        "pp_interleaved": dict(
            plan=ParallelPlan.uniform(
                4,
                4,
                S(dp_type="zero2"),
                pp=2,
                schedule="interleaved_1f1b",
                virtual_stages=2,
                micro_batches=2,
            )
        ),
        "zero3_recompute": dict(
            plan=ParallelPlan.uniform(4, 4, S(dp_type="zero3", recompute=True), vocab=S(dp_type="zero3"))
        ),
    }


CASES = list(cases("gpt2"))
_RESULTS: dict[str, tuple[RunResult, dict[str, RunResult | str]]] = {}


def _matrix(pools, cache_dir: str, name: str) -> tuple[RunResult, dict[str, RunResult | str]]:
    """The family's reference and every case, computed once (the first test of the family pays for all)."""
    if name not in _RESULTS:
        batch = BATCH.get(name, 8)
        expected = run_single(model=family(name), global_batch=batch, evaluate=True)
        results = pools(4).run(run_cases, cases(name), family(name), batch, cache_dir, evaluate=True, timeout=600)[0]
        if any(isinstance(r, str) and not r.startswith("PlanError") for r in results.values()):
            pools(4).shutdown()  # a failed case may leave ranks out of step: the next family gets a fresh pool
        _RESULTS[name] = expected, results
    return _RESULTS[name]


@pytest.fixture(scope="module")
def family_profiles(tmp_path_factory, linked_profile_cache) -> str:
    """One profile cache for the module: each model is profiled once (both automatic plans), the cluster once for
    the session (the shared cluster measurements)."""
    return str(linked_profile_cache(tmp_path_factory.mktemp("profiles")))


@pytest.mark.parametrize("name, case", [pytest.param(n, c, id=f"{n}-{c}") for n in FAMILIES for c in CASES])
def test_family_matches_one_process(pools, family_profiles, name, case):
    expected, results = _matrix(pools, family_profiles, name)
    outcome = results[case]
    if refused_as_expected(outcome, REFUSED.get((name, case))):
        return
    assert_close_runs(outcome, expected, **FP32_TOL)
    assert_same_evaluation(outcome, expected, FP32_TOL["loss_tol"], PREDICTION_TOL_OF.get(name, PREDICTION_TOL))
    if case == "auto_tight":  # pure DDP does not fit the budget
        assert outcome.plan != ParallelPlan.uniform(
            4, outcome.plan.num_layers, S(), global_batch_size=outcome.plan.global_batch_size
        )
