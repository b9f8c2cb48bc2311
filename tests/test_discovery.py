"""Finding the Transformer blocks of a model."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_galvatron.model.discovery import BlockDiscoveryError, find_blocks
from tests.helpers.training import tiny_gpt


def test_finds_the_example_gpt_blocks():
    module = tiny_gpt()
    structure = find_blocks(module)
    assert structure.block_names == [f"model.blocks.{i}" for i in range(4)]
    assert structure.blocks[0] is module.model.blocks[0]
    vocab = {name for name, _ in structure.vocab_parameters()}
    assert vocab == {
        "model.tok_emb.weight",
        "model.pos_emb.weight",
        "model.ln_f.weight",
        "model.ln_f.bias",
        "model.lm_head.weight",
    }


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class BlockWithHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(Head() for _ in range(2))  # a same-class list, but smaller
        self.mlp = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 4))


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.encoder = nn.Module()
        self.encoder.layer = nn.Sequential(*(BlockWithHeads() for _ in range(3)))


def test_prefers_the_list_with_most_parameters():
    structure = find_blocks(Nested())
    assert [bl.path for bl in structure.block_lists] == ["encoder.layer"]
    assert structure.num_blocks == 3


def test_explicit_paths_including_two_block_types():
    model = nn.Module()
    model.encoder = nn.ModuleList(BlockWithHeads() for _ in range(2))
    model.decoder = nn.ModuleList(Nested() for _ in range(3))
    structure = find_blocks(model, ["encoder", "decoder"])
    assert structure.num_blocks == 5
    assert [bl.block_type for bl in structure.block_lists] == ["BlockWithHeads", "Nested"]


def test_model_without_blocks_says_what_to_pass():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(BlockDiscoveryError, match=r"GalvatronStrategy\(layers='path.to.blocks'\)"):
        find_blocks(model)


def test_bad_explicit_paths():
    with pytest.raises(
        BlockDiscoveryError, match="has no submodule at that path; containers that hold several blocks: 'encoder.layer'"
    ):
        find_blocks(Nested(), "encoder.layers")
    with pytest.raises(BlockDiscoveryError, match="is a Embedding, not a non-empty nn.ModuleList"):
        find_blocks(Nested(), "embed")
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([BlockWithHeads(), Head()])
    with pytest.raises(BlockDiscoveryError, match="mixes block classes"):
        find_blocks(mixed, "layers")
