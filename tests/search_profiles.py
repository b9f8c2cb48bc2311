"""Profiles for the search tests: the imported Llama-2-7B/A100 one and random small synthetic ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_galvatron.profiles import (
    CollectiveFit,
    DegreeTable,
    HardwareProfile,
    LayerTypeProfile,
    LinearFit,
    ModelProfile,
    Profile,
    VocabProfile,
)

DATA = Path(__file__).parent / "data"
GALVATRON_DIR = DATA / "galvatron-profiles"
REFERENCE_PLAN = GALVATRON_DIR / "galvatron_config_llama2-7b_1nodes_8gpus_per_node_36GB_bf16.json"
A100_PROFILE = Path(__file__).parent.parent / "benchmarks" / "data" / "llama2-7b-a100-8gpu.json"


def llama_profile() -> Profile:
    return Profile.load(A100_PROFILE)


def synthetic_layer_type(rng: np.random.Generator, name: str = "block", **overrides) -> LayerTypeProfile:
    base = float(rng.uniform(5e7, 3e8))
    fields = dict(
        name=name,
        parameters=int(rng.uniform(5e6, 6e7)),
        hidden_size=768,
        num_heads=12,  # Megatron degrees 1, 2, 3, 4, 6, 12; Ulysses also needs seq 1024: 1, 2, 4
        ffn_hidden_size=3072,
        seq_length=1024,
        forward_time=LinearFit(float(rng.uniform(0, 1e-3)), float(rng.uniform(1e-3, 1e-2))),
        activation_bytes_per_sample=DegreeTable(
            tuple((g, base / g * float(rng.uniform(1.0, 1.1))) for g in (1, 2, 4, 8))
        ),
        recompute_activation_bytes_per_sample=float(rng.uniform(2e6, 8e6)),
        replicated_activation_bytes_per_sample=float(rng.uniform(2e6, 2e7)),
        backward_to_forward=float(rng.uniform(1.5, 2.5)),
    )
    fields.update(overrides)
    return LayerTypeProfile(**fields)


def synthetic_hardware(rng: np.random.Generator, devices_per_node: int = 8) -> HardwareProfile:
    entries = []
    for g in (2, 4, 8):
        entries.append(
            CollectiveFit("all_reduce", g, g, float(rng.uniform(1e-5, 1e-4)), float(rng.uniform(5e10, 2e11)))
        )
    for g, k in ((2, 1), (8, 4), (16, 8)):
        entries.append(CollectiveFit("all_reduce", g, k, float(rng.uniform(1e-5, 1e-4)), float(rng.uniform(5e9, 3e10))))
    for g in (2, 8):
        entries.append(
            CollectiveFit("all_to_all", g, g, float(rng.uniform(1e-5, 1e-4)), float(rng.uniform(5e10, 2e11)))
        )
    entries.append(CollectiveFit("p2p", 2, 2, 2e-5, float(rng.uniform(5e10, 2e11))))
    entries.append(CollectiveFit("p2p", 4, 1, 2e-5, float(rng.uniform(5e9, 2e10))))
    return HardwareProfile(
        name="synthetic",
        devices_per_node=devices_per_node,
        overlap_coefficient=float(rng.uniform(1.0, 1.3)),
        collectives=tuple(entries),
        memory_overhead_bytes=int(rng.uniform(0, 5e8)),
    )


def synthetic_profile(
    rng: np.random.Generator, num_blocks: int, num_types: int = 1, devices_per_node: int = 8
) -> Profile:
    types = tuple(synthetic_layer_type(rng, f"type{i}") for i in range(num_types))
    blocks = tuple(int(i * num_types // num_blocks) for i in range(num_blocks))
    vocab = VocabProfile(
        vocab_size=24576,
        embedding_parameters=int(rng.uniform(1e6, 3e7)),
        head_parameters=int(rng.uniform(1e6, 3e7)),
        embedding_forward_time=LinearFit(0.0, float(rng.uniform(0, 1e-4))),
        head_forward_time=LinearFit(float(rng.uniform(0, 5e-4)), float(rng.uniform(1e-4, 3e-3))),
        embedding_activation_bytes_per_sample=DegreeTable(tuple((g, 1e7 / g) for g in (1, 2, 4, 8))),
        head_activation_bytes_per_sample=DegreeTable(
            tuple((g, float(rng.uniform(5e7, 2e8)) / g) for g in (1, 2, 4, 8))
        ),
    )
    model = ModelProfile("synthetic", types, blocks, vocab, hidden_size=768, seq_length=1024)
    return Profile(model, synthetic_hardware(rng, devices_per_node), source="synthetic test profile")
