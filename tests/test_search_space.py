"""Candidate generation: only executable strategies and schedules, user limits respected."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_galvatron.search.space import (
    SearchOptions,
    layer_candidates,
    pipeline_configs,
    pipeline_degrees,
    vocab_candidates,
)
from tests.search_profiles import llama_profile, synthetic_layer_type


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 12, 24])
def test_layer_candidates_are_executable(n):
    layer = llama_profile().model.layer_types[0]  # 32 heads, hidden 4096, FFN 11008, sequence 2048
    for batch in (n, 2 * n, 1):
        for s in layer_candidates(layer, n, batch, stage_spans_nodes=n > 8, options=SearchOptions()):
            d = n // s.tp
            assert n % s.tp == 0 and batch % d == 0
            if s.tp > 1:
                assert layer.num_heads % s.tp == 0
                if s.sp == "ulysses":
                    assert layer.seq_length % s.tp == 0
                else:
                    assert layer.hidden_size % s.tp == 0 and layer.ffn_hidden_size % s.tp == 0
            if d == 1:
                assert s.dp_type == "ddp"
            if not 1 < s.tp < n or n <= 8:
                assert s.tp_consecutive


def test_non_power_of_two_world_sizes_use_degrees_that_divide():
    layer = synthetic_layer_type(np.random.default_rng(0))  # 12 heads, hidden 768, FFN 3072, sequence 1024
    degrees = {s.tp for s in layer_candidates(layer, 12, 12, False, SearchOptions())}
    assert degrees == {1, 2, 3, 4, 6, 12}
    ulysses = {s.tp for s in layer_candidates(layer, 12, 12, False, SearchOptions()) if s.sp == "ulysses"}
    assert ulysses == {2, 4}  # 3, 6, 12 do not divide the sequence of 1024


def test_layer_types_without_model_parallel_support_get_tp_1():
    layer = dataclasses.replace(
        synthetic_layer_type(np.random.default_rng(0)), supports_tensor_parallel=False, supports_ulysses=False
    )
    assert {s.tp for s in layer_candidates(layer, 8, 8, False, SearchOptions())} == {1}
    no_msp = dataclasses.replace(synthetic_layer_type(np.random.default_rng(0)), supports_megatron_sp=False)
    assert "megatron" not in {s.sp for s in layer_candidates(no_msp, 8, 8, False, SearchOptions())}


def test_user_limits():
    layer = llama_profile().model.layer_types[0]
    options = SearchOptions(max_tp=2, disable={"zero2", "recompute", "ulysses", "tp_without_sp"})
    found = layer_candidates(layer, 8, 8, False, options)
    assert {s.tp for s in found} == {1, 2}
    assert {s.dp_type for s in found} == {"ddp", "zero3"}
    assert not any(s.recompute for s in found)
    assert {s.sp for s in found} == {"none", "megatron"} and all(s.sp == "megatron" for s in found if s.tp > 1)
    strided = layer_candidates(layer, 16, 16, True, SearchOptions())
    assert any(not s.tp_consecutive for s in strided)
    assert all(s.tp_consecutive for s in layer_candidates(layer, 16, 16, True, SearchOptions(disable={"strided"})))
    with pytest.raises(ValueError, match="cannot disable"):
        SearchOptions(disable={"nonsense"})
    with pytest.raises(ValueError, match="leaves no way"):
        SearchOptions(disable={"ddp", "zero2", "zero3"})
    with pytest.raises(ValueError, match="schedules"):
        SearchOptions(schedules=("zero_bubble",))


def test_vocab_candidates():
    vocab = llama_profile().model.vocab
    found = vocab_candidates(vocab, 2048, 8, 8, SearchOptions())
    assert {s.tp for s in found} == {1, 2, 4, 8}
    assert not any(s.recompute for s in found)
    # Any degree: a vocabulary it does not divide is sharded unevenly (32000 over 3 and 6 here).
    assert {s.tp for s in vocab_candidates(vocab, 2048, 6, 6, SearchOptions())} == {1, 2, 3, 6}


def test_pipeline_shapes_follow_what_torch_pipelining_accepts():
    options = SearchOptions()
    assert pipeline_degrees(8, 32, options) == [1, 2, 4, 8]
    assert pipeline_degrees(12, 4, options) == [1, 2, 3, 4]  # at most one stage per block
    assert pipeline_degrees(8, 32, SearchOptions(max_pp=2)) == [1, 2]
    assert pipeline_degrees(8, 32, SearchOptions(disable={"pipeline"})) == [1]
    assert {c.schedule for c in pipeline_configs(1, 16, 32, options)} == {"1f1b"}
    for config in pipeline_configs(4, 16, 32, options):
        if config.schedule == "1f1b":
            assert config.micro_batches >= 4
        elif config.schedule == "interleaved_1f1b":
            # torch's flex interleaved schedule: m a multiple of its max(1, m // pp) rounds (so m < pp runs too)
            assert config.micro_batches % max(1, config.micro_batches // 4) == 0
            assert config.virtual_stages >= 2 and 4 * config.virtual_stages <= 32
        else:
            assert config.micro_batches < 4  # GPipe with m >= pp is dominated by 1F1B
    only_gpipe = pipeline_configs(4, 16, 32, SearchOptions(schedules=("gpipe",)))
    assert {c.micro_batches for c in only_gpipe} == {1, 2, 4, 8, 16}
    assert not [
        c for c in pipeline_configs(4, 16, 6, options) if c.schedule == "interleaved_1f1b"
    ]  # 4 x 2 chunks > 6 blocks


def test_embedding_and_head_run_on_whole_sequences():
    """The runtime refuses vocab sp != 'none' (the user's step computes the loss on whole sequences)."""
    vocab = llama_profile().model.vocab
    for n in (1, 2, 4, 8):
        assert {s.sp for s in vocab_candidates(vocab, 2048, n, n, SearchOptions())} == {"none"}
    from lightning_galvatron.search import search

    result = search(llama_profile(), 8, "36GB", global_batch_size=16)
    assert result.plan.vocab.sp == "none"
    assert all(b.estimate is None or b.estimate.plan.vocab.sp == "none" for b in result.baselines)


def test_several_block_lists_get_no_pipeline():
    """An encoder-decoder (two block lists) runs with pp=1: the runtime refuses pipelines over several lists."""
    from lightning_galvatron.search import evaluate, search

    profile = llama_profile()
    two_lists = dataclasses.replace(profile, model=dataclasses.replace(profile.model, block_lists=2))
    assert pipeline_degrees(8, 32, SearchOptions(), block_lists=2) == [1]
    one = search(profile, 8, "24GB", global_batch_size=16)
    result = search(two_lists, 8, "24GB", global_batch_size=16)
    assert result.plan.pp == 1
    assert result.shapes_considered == len(pipeline_configs(1, 16, 32, SearchOptions())) < one.shapes_considered
    assert all(b.estimate is None or b.estimate.plan.pp == 1 for b in result.baselines)
    piped = one.plan.replace(pp=2, partition=None, micro_batches=2, schedule="1f1b")
    assert any("pp=2 is not executable" in w for w in evaluate(two_lists, piped).warnings)
