"""Dry runs at scale: plans applied and stepped as ranks of 16, 64 and 1,024 devices, and the collective-order proof.

The full-world proofs run every rank of the world, each in its own process, on a narrow copy of the model
(same block structure, heads and plan; small widths) with real zero-filled tensors (``real_tensors``), and on
:func:`~lightning_galvatron.dryrun.shortened_plan` (each run of equal consecutive block strategies cut to one
block): what is proven is that for this plan structure every member of every group issues the same operations
in the same order with the same shapes, and every send meets its receive. The order of collectives does not
depend on tensor sizes or values (values read back are placeholders on every rank alike).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_galvatron.dryrun import ModelSource, check_order, dry_run, sample_ranks, shortened_plan
from lightning_galvatron.dryrun.trace import Event
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan

DATA = Path(__file__).parent / "data"
LLAMA_CONFIG = json.loads((DATA / "llama2-7b-config.json").read_text())
A100 = str(Path(__file__).parents[1] / "benchmarks" / "data" / "llama2-7b-a100-8gpu.json")
# Llama-2-7B's structure (32 heads, no GQA, SwiGLU, untied head) at small widths.
NARROW_LLAMA = {
    **LLAMA_CONFIG,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
TINY_GPT = "examples.gpt.GPTModule"


def llama_64_plan() -> ParallelPlan:
    """Llama-2-7B (32 blocks) on 64 devices: 4 stages of 16, 1F1B, mixed tp 8/4/2/1 (consecutive and strided
    ranks, so activations are relocated between blocks and stages), ZeRO-2/ZeRO-3/DDP, recomputation on some
    blocks, a vocabulary-parallel embedding and head."""
    runs = [
        S(tp=8, dp_type="zero3"),
        S(tp=4, recompute=True),  # stage 0
        S(tp=2, dp_type="zero2"),
        S(tp=1, dp_type="zero3", recompute=True),  # stage 1
        S(tp=4, dp_type="zero3", tp_consecutive=False),
        S(tp=2, recompute=True, tp_consecutive=False),  # stage 2
        S(tp=8, dp_type="zero2", recompute=True),
        S(tp=1),  # stage 3
    ]
    layers = tuple(s for s in runs for _ in range(4))
    return ParallelPlan(
        world_size=64,
        layers=layers,
        vocab=S(tp=8, dp_type="zero3"),
        pp=4,
        schedule="1f1b",
        micro_batches=4,
        global_batch_size=64,
    )


def narrow_llama(num_layers: int) -> ModelSource:
    return ModelSource.from_hf_config({**NARROW_LLAMA, "num_hidden_layers": num_layers}, layers="model.model.layers")


def prove(source: ModelSource, plan: ParallelPlan, **kwargs):
    report = dry_run(source, plan, ranks="all", real_tensors=True, measure_memory=False, workers=2, **kwargs)
    errors = [f"rank {r.rank}:\n{r.error}" for r in report.ranks if r.error]
    assert not errors, errors[0]
    assert report.order is not None and report.order.complete
    assert report.order.ok, report.order.describe()
    return report


# ---------------------------------------------------------------------------------------------- the check itself
def _ev(kind: str, group: str = "1", members=(0, 1), shapes=((4,),), root=None, phase="train") -> Event:
    return Event(phase, kind, group, tuple(members), tuple(shapes), ("float32",) * len(shapes), root)


def test_order_check_passes_agreeing_ranks_and_reports_each_kind_of_divergence() -> None:
    create = _ev("new_group", "1", (0, 1), ())
    agree = {0: [create, _ev("all_reduce"), _ev("send", root=1)], 1: [create, _ev("all_reduce"), _ev("recv", root=0)]}
    assert check_order(agree, 2).ok and check_order(agree, 2).complete

    # one rank issues an extra collective
    extra = {0: [create, _ev("all_reduce"), _ev("all_gather")], 1: [create, _ev("all_reduce")]}
    found = check_order(extra, 2).divergences[0]
    assert (found.group, found.index, found.ranks) == ("1", 1, (0, 1)) and found.events[1] is None

    # same kind, other shape
    shapes = {0: [create, _ev("all_reduce", shapes=((4,),))], 1: [create, _ev("all_reduce", shapes=((8,),))]}
    assert check_order(shapes, 2).divergences[0].events[0].shapes == ((4,),)

    # groups created in another order: reported first (it renames every later group)
    other = _ev("new_group", "1", (0,), ())
    creation = {0: [create, other, _ev("all_reduce", "9")], 1: [other, create, _ev("all_reduce", "9", shapes=((2,),))]}
    assert check_order(creation, 2).divergences[0].what == "group creation order"

    # a send that no receive matches
    p2p = {0: [create, _ev("send", root=1, shapes=((4,),))], 1: [create, _ev("recv", root=0, shapes=((5,),))]}
    assert check_order(p2p, 2).divergences[0].what == "point-to-point 0 -> 1"

    # only one member simulated: nothing can be proven about the group
    partial = check_order({0: agree[0]}, 2)
    assert partial.ok and not partial.complete and partial.groups_unchecked == 1


def test_broken_runtimes_are_caught_with_both_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that cannot fail is no check: a runtime that skips one gradient reduction on one rank, and one
    that creates its meshes in another order on one rank, are both reported (the ranks are forked from here,
    so they run the patched runtime)."""
    from lightning_galvatron.runtime import gradient_sync
    from lightning_galvatron.runtime.mesh import Layout, MeshCache

    model = ModelSource.from_class(
        TINY_GPT, {"vocab_size": 16, "seq_length": 8, "n_layer": 2, "n_head": 4, "n_embd": 32}
    )
    plan = ParallelPlan(world_size=4, layers=(S(), S(tp=2, dp_type="zero3")), vocab=S(), global_batch_size=8)

    launch = gradient_sync._Bucket.launch

    def skip_on_rank_2(self) -> None:
        if dist.get_rank() == 2:
            self.launched = True  # "reduced" without the collective
            return
        launch(self)

    monkeypatch.setattr(gradient_sync._Bucket, "launch", skip_on_rank_2)
    report = dry_run(model, plan, ranks="all", real_tensors=True, measure_memory=False, phases=("train",), workers=2)
    assert not report.order.ok and not report.ok
    first = report.order.divergences[0]
    assert 2 in first.ranks and first.events[0].kind == "all_reduce" and first.events[0].phase == "train"
    text = report.order.describe()
    # where the others sum a bucket, rank 2 already agrees on the bucket order that ends the first backward
    assert "gradient_sync.py" in text and "(all_reduce vs broadcast)" in text
    monkeypatch.undo()

    mesh = MeshCache.mesh

    def other_order_on_rank_1(self, layout):
        if dist.get_rank() == 1 and not self._meshes:
            mesh(self, Layout(layout.world_size, layout.pp, 2))  # creates the tp=2 layout's groups first
        return mesh(self, layout)

    monkeypatch.setattr(MeshCache, "mesh", other_order_on_rank_1)
    report = dry_run(model, plan, ranks="all", real_tensors=True, measure_memory=False, phases=("train",), workers=2)
    first = report.order.divergences[0]
    assert first.what == "group creation order" and first.ranks == (0, 1)
    assert "mesh.py" in "\n".join(first.events[1].stack)


# ---------------------------------------------------------------------------------------------- plans at scale
def test_llama2_7b_heterogeneous_plan_order_is_proven_for_all_64_ranks() -> None:
    plan = llama_64_plan()
    short = shortened_plan(plan)
    assert short.num_layers == 8 and short.partition == (2, 2, 2, 2)
    report = prove(
        narrow_llama(short.num_layers), short, seq_length=16, gradient_clip_val=1.0, phases=("train", "validate")
    )
    order = report.order
    assert order.groups_checked > 50 and order.pairs_checked > 0
    # every phase talked: pipeline p2p, tensor-parallel and ZeRO collectives, the loss handed from the last stage
    kinds = {k for r in report.ranks for ops in r.operations.values() for k in ops}
    assert {"send", "recv", "all_reduce", "all_gather", "reduce_scatter", "broadcast_object"} <= kinds
    assert all("validate" in r.operations for r in report.ranks)


def test_llama2_7b_sampled_ranks_apply_step_and_measure_memory_at_64() -> None:
    """The real config (fake tensors): one rank of each stage applies the 32-block plan and runs a training step,
    a validation step and a checkpoint's state dicts; measured memory is reported next to the cost model's."""
    plan = ParallelPlan.load(Path(__file__).parents[1] / "configs" / "llama2_7b_64gpu_plan.json")  # the README's
    assert plan == llama_64_plan()
    ranks = [0, 21, 42, 63]
    report = dry_run(
        ModelSource.from_hf_config(DATA / "llama2-7b-config.json"),
        plan,
        ranks=ranks,
        seq_length=2048,
        hardware=A100,
        workers=2,
    )
    assert [r.rank for r in report.ranks] == ranks
    for r in report.ranks:
        assert r.error is None, r.error
        stage = r.rank // 16
        assert [b["index"] for b in r.blocks] == plan.stage_layers(stage)
        assert r.memory is not None and r.memory["total"] > r.memory["parameters"] > 0
        assert report.predicted_memory(r.rank)["total"] > 0
    # local shapes: a tp=8 ZeRO-3 block's q_proj on rank 0 is split 8 ways by tensor parallelism, then 2 by FSDP
    q_proj = next(p for p in report.ranks[0].blocks[0]["parameters"] if p["name"].endswith("q_proj.weight"))
    assert q_proj["global_shape"] == [4096, 4096] and q_proj["local_shape"] == [256, 4096]
    # groups: rank 63 (last stage, last position) talks to the first stage's rank 15 through the pipeline group
    pipeline = [g for g in report.ranks[-1].groups if "pipeline" in g["used_for"]]
    assert pipeline and [15, 31, 47, 63] in [g["members"] for g in pipeline]


def test_sequence_parallel_ulysses_interleaved_uneven_plan_order_on_16_ranks() -> None:
    """Megatron-SP and Ulysses blocks, tp/dp mixes, strided layouts, an uneven partition, interleaved 1F1B with two
    chunks per stage and a vocabulary-parallel head, tied to the embedding across the first and last stage."""
    model = ModelSource.from_class(
        TINY_GPT, {"vocab_size": 16, "seq_length": 16, "n_layer": 8, "n_head": 8, "n_embd": 64, "tie_weights": True}
    )
    layers = (
        S(tp=4, sp="megatron", dp_type="zero3"),
        S(tp=2, sp="ulysses"),
        S(tp=8, sp="megatron", recompute=True),  # chunk 0
        S(tp=2, dp_type="zero2", tp_consecutive=False),  # chunk 1
        S(tp=4, sp="ulysses", dp_type="zero3", recompute=True),
        S(),  # chunk 2
        S(tp=2, sp="megatron", tp_consecutive=False),
        S(tp=4),  # chunk 3
    )
    plan = ParallelPlan(
        world_size=16,
        layers=layers,
        vocab=S(tp=2, dp_type="zero3"),
        pp=2,
        partition=(3, 1, 2, 2),
        schedule="interleaved_1f1b",
        virtual_stages=2,
        micro_batches=2,
        global_batch_size=16,
    )
    report = prove(model, plan, gradient_clip_val=1.0, phases=("train", "validate"))
    kinds = {k for r in report.ranks for ops in r.operations.values() for k in ops}
    assert {"all_to_all", "reduce_scatter", "all_gather", "send", "recv"} <= kinds


def test_1024_rank_plan_applies_on_sampled_ranks() -> None:
    layers = (
        S(tp=8, dp_type="zero3"),
        S(tp=4, recompute=True),
        S(tp=2, dp_type="zero2"),
        S(dp_type="zero3"),
        S(tp=8, tp_consecutive=False),
        S(tp=1, recompute=True),
        S(tp=2),
        S(tp=4, dp_type="zero3"),
    )
    plan = ParallelPlan(
        world_size=1024, layers=layers, vocab=S(tp=8), pp=8, schedule="1f1b", micro_batches=8, global_batch_size=1024
    )
    ranks = [0, 517, 1023]
    report = dry_run(
        narrow_llama(8),
        plan,
        ranks=ranks,
        seq_length=16,
        real_tensors=True,
        measure_memory=False,
        phases=("train",),
        workers=2,
    )
    for r in report.ranks:
        assert r.error is None, r.error
        assert [b["index"] for b in r.blocks] == [r.rank // 128]
    assert len(sample_ranks(plan)) == 24  # first, middle, last of each of the 8 stages


def test_plans_the_search_emits_for_64_devices_are_proven() -> None:
    """The search's plans for Llama-2-7B on 64 A100s over a matrix of budgets and limits, each proven on every rank."""
    from lightning_galvatron.model.sources import architecture_from_config_file
    from lightning_galvatron.search.cluster_estimate import estimate_cluster

    architecture = architecture_from_config_file(DATA / "llama2-7b-config.json")
    matrix = [("16GB", {}), ("12GB", {"disable": ["zero3"]})]
    proven = set()
    for budget, options in matrix:
        found = estimate_cluster(
            architecture, 64, budget, hardware=A100, seq_length=2048, global_batch_size=128, **options
        )
        short = shortened_plan(found.result.plan)
        if short in proven:
            continue
        prove(narrow_llama(short.num_layers), short, seq_length=16, phases=("train",))
        proven.add(short)
    assert len(proven) == len(matrix)


# ---------------------------------------------------------------------------------------------- the command
def test_dry_run_command_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_galvatron.cli.app import main

    plan = ParallelPlan(
        world_size=8,
        layers=(S(tp=2, dp_type="zero3"), S(recompute=True)),
        vocab=S(tp=2),
        pp=2,
        micro_batches=2,
        global_batch_size=8,
    )
    plan.save(tmp_path / "plan.json")
    args = {"vocab_size": 16, "seq_length": 8, "n_layer": 2, "n_head": 4, "n_embd": 32}
    code = main(
        [
            "dry-run",
            "--model",
            TINY_GPT,
            "--model-args",
            json.dumps(args),
            "--plan",
            str(tmp_path / "plan.json"),
            "--ranks",
            "0,7",
            "--precision",
            "32-true",
            "--json",
            "--workers",
            "2",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] and out["world_size"] == 8
    first, last = out["ranks"]
    assert (first["rank"], first["stage"], last["stage"]) == (0, 0, 1)
    assert first["memory"]["total"] > 0 and first["groups"] and first["blocks"][0]["strategy"] == "tp2-zero3"
    assert {"train", "validate"} <= set(first["operations"])


def test_dry_run_command_searches_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_galvatron.cli.app import main

    config = tmp_path / "narrow-llama.json"
    config.write_text(json.dumps({**NARROW_LLAMA, "num_hidden_layers": 4}))
    code = main(
        [
            "dry-run",
            "--hf-config",
            str(config),
            "--plan",
            "auto",
            "--world-size",
            "16",
            "--memory-per-device",
            "1GB",
            "--hardware",
            A100,
            "--seq-length",
            "16",
            "--global-batch-size",
            "16",
            "--ranks",
            "3",
            "--phases",
            "train",
            "--real-tensors",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "on 16 ranks (1 simulated)" in text and "measured peak" in text


def test_the_model_profiler_counts_fake_tensors_like_real_ones() -> None:
    """Saved tensors are told apart by storage, not data pointer: the profiler counts a model on fake tensors (a 7B
    model without its memory, as ``benchmarks/dry_run_memory.py`` does) exactly as on real ones."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_galvatron.dryrun.models import token_batch
    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler.model import profile_model

    source = narrow_llama(2)
    torch.manual_seed(0)
    real = source.build()
    with torch.device("meta"):
        fake = source.build()
    counted = profile_model(
        real, find_blocks(real, source.layers), token_batch(2, 16), batch_sizes=(1, 2), degrees=(1, 2)
    )
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu"))
        fake_counted = profile_model(
            fake, find_blocks(fake, source.layers), token_batch(2, 16), batch_sizes=(1, 2), degrees=(1, 2)
        )
    assert fake_counted.layer_types[0].activation_bytes_per_sample == counted.layer_types[0].activation_bytes_per_sample
    assert fake_counted.vocab.head_activation_bytes_per_sample == counted.vocab.head_activation_bytes_per_sample
    assert not fake_counted.vocab.tied and counted.layer_types[0].activation_bytes_per_sample.at(1) > 0
