"""The CUDA and NCCL paths without a GPU: ``dry_run(device="cuda")`` on 8 simulated GPUs over 2 nodes.

Every rank holds fake tensors on its own simulated GPU (``cuda:rank % 4``) and talks through a simulated NCCL whose
rules are checked (``dryrun.nccl_rules``): collective tensors on the rank's own GPU, object collectives on the
current device, the same shapes and dtypes across a group (the order proof), host synchronisations counted per
step. A check that cannot fail is no check: planted faults (a CPU tensor sent to a collective, an ``.item()`` in
the step) are reported, with where they were made. The faults are planted in this process: the simulated ranks are
forked from it and run the patched code.
"""

from __future__ import annotations

import pytest
import torch

from lightning_galvatron.dryrun import ModelSource, check_order, dry_run
from lightning_galvatron.dryrun.nccl_rules import NcclRules
from lightning_galvatron.dryrun.trace import Event
from lightning_galvatron.plan import LayerStrategy as S
from lightning_galvatron.plan import ParallelPlan

TINY_GPT = "examples.gpt.GPTModule"
GPT_ARGS = {"vocab_size": 32, "seq_length": 8, "n_layer": 4, "n_head": 4, "n_embd": 32}
NODE = 4  # GPUs per node: 8 GPUs are 2 nodes


def gpt() -> ModelSource:
    return ModelSource.from_class(TINY_GPT, GPT_ARGS)


def simulate(plan: ParallelPlan, ranks="all", phases=("train", "validate", "checkpoint"), **kwargs):
    return dry_run(gpt(), plan, ranks=ranks, device="cuda", devices_per_node=NODE, workers=2, phases=phases, **kwargs)


def passed(report) -> None:
    errors = [f"rank {r.rank}:\n{r.error}" for r in report.ranks if r.error]
    assert not errors, errors[0]
    broken = [v for r in report.ranks for v in r.violations]
    assert not broken, report.describe()
    assert report.order is None or report.order.ok, report.order.describe()
    assert report.ok


def train_syncs(report) -> set[tuple[str, str]]:
    """Where the training steps synchronised the host: (what, the innermost line outside torch)."""
    return {(s["what"], s["site"]) for r in report.ranks for s in r.host_syncs if s["phase"] == "train"}


# ---------------------------------------------------------------------------------------------- the rules themselves
def test_object_collectives_need_the_current_device_and_a_collective_its_own_gpu() -> None:
    current = {"index": 0}
    rules = NcclRules(torch.device("cuda", 1), lambda: current["index"], lambda: "train")
    rules.object_collective("all_gather_object")  # current device 0: torch.cuda.set_device(1) was never called
    rules.object_collective("broadcast_object_list", device=torch.device("cpu"))
    current["index"] = 1
    rules.object_collective("all_gather_object")  # fine now
    rules.collective("all_reduce", "3", [torch.empty(2, device="meta")])
    assert [v.rule for v in rules.violations] == [
        "object collective without the current device set",
        "object collective on another device",
        "tensor not on the rank's own GPU",
    ]
    assert "torch.cuda.set_device(1)" in rules.violations[0].message
    assert any("test_dry_run_cuda.py" in frame for frame in rules.violations[0].stack)  # names the call site
    # each object collective is a host synchronisation (pickled on the host, sizes read back)
    assert sum(s.count for s in rules.host_syncs("train")) == 3


def test_a_checkpoint_loads_into_tensors_on_the_own_gpu() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    rules = NcclRules(torch.device("cuda", 1), lambda: 1, lambda: "load")
    with FakeTensorMode():
        own, other = torch.empty(2, device="cuda:1"), torch.empty(2, device="cuda:0")
    rules.checkpoint_load({"a": own, "b": own, "step": torch.tensor(3.0)})  # Adam's step stays on the host
    assert not rules.violations
    rules.checkpoint_load({"a": own, "b": torch.empty(2), "c": other})
    (violation,) = rules.violations
    assert violation.rule == "checkpoint loaded off the rank's own GPU"
    assert "2 of the 3 tensors" in violation.message and "b on cpu, c on cuda:0" in violation.message


def test_order_check_names_a_dtype_or_shape_that_differs_within_a_group() -> None:
    create = Event("setup", "new_group", "1", (0, 1))

    def ev(dtype: str, shape: tuple[int, ...]) -> Event:
        return Event("train", "all_reduce", "1", (0, 1), (shape,), (dtype,))

    dtypes = check_order({0: [create, ev("float32", (4,))], 1: [create, ev("bfloat16", (4,))]}, 2)
    assert dtypes.divergences[0].reason == "dtypes differ (float32 vs bfloat16)"
    assert "dtypes differ" in dtypes.describe()
    shapes = check_order({0: [create, ev("float32", (4,))], 1: [create, ev("float32", (8,))]}, 2)
    assert shapes.divergences[0].reason == "shapes differ"


# ---------------------------------------------------------------------------------------------- the matrix
MATRIX = {
    # DDP, ZeRO-2, ZeRO-3 with recomputation, tensor parallelism; a vocabulary-parallel embedding and head
    "data-parallel kinds, recompute, vocabulary parallel": ParallelPlan(
        world_size=8,
        layers=(S(), S(dp_type="zero2"), S(dp_type="zero3", recompute=True), S(tp=2, dp_type="zero3")),
        vocab=S(tp=2),
        global_batch_size=8,
    ),
    # tensor parallelism with Megatron-SP and Ulysses, strided ranks, 1F1B over two stages (one per node)
    "tp + megatron-sp + ulysses, 1f1b": ParallelPlan(
        world_size=8,
        layers=(S(tp=2, sp="megatron"), S(tp=4, sp="ulysses"), S(tp=2, recompute=True, tp_consecutive=False), S()),
        vocab=S(tp=2, dp_type="zero3"),
        pp=2,
        schedule="1f1b",
        micro_batches=2,
        global_batch_size=8,
    ),
    "interleaved 1f1b": ParallelPlan(
        world_size=8,
        layers=(S(tp=2), S(dp_type="zero3"), S(tp=2, sp="megatron"), S(recompute=True)),
        vocab=S(),
        pp=2,
        partition=(1, 1, 1, 1),
        schedule="interleaved_1f1b",
        virtual_stages=2,
        micro_batches=2,
        global_batch_size=8,
    ),
    "gpipe": ParallelPlan(
        world_size=8,
        layers=(S(dp_type="zero2"), S(tp=2), S(), S(dp_type="zero3")),
        vocab=S(),
        pp=4,
        schedule="gpipe",
        micro_batches=4,
        global_batch_size=8,
    ),
}


# Each plan's checkpoint is loaded into the next plan: no pipeline into 1F1B's two stages, 1F1B into interleaved
# stages, interleaved into GPipe's four stages, four stages into none; data parallel into tensor parallel and back.
LOADS_INTO = dict(zip(MATRIX, [*list(MATRIX)[1:], next(iter(MATRIX))]))


@pytest.mark.parametrize("name", list(MATRIX))
def test_every_plan_kind_steps_on_8_simulated_gpus_over_2_nodes(name: str) -> None:
    """Setup, a training step, a validation step and a checkpoint save on every rank, bf16-mixed as on a GPU, and
    that checkpoint loaded into another plan: no rule broken, the order (with shapes and dtypes) proven, the host
    synchronisations of a step named."""
    report = simulate(MATRIX[name], measure_memory=False)  # memory is measured as on the CPU: not what is checked
    passed(report)
    # the save's index, as DCP's coordinator makes it (refusing shards that overlap or leave part of a tensor out)
    index = report.checkpoint_index()
    assert {"state_dict.model.lm_head.weight", "optimizer_0.state.model.lm_head.weight.exp_avg"} <= set(
        index.state_dict_metadata
    )
    # resumed into another plan as Trainer.fit(ckpt_path=...) loads it, on its last rank (a pipeline's last stage)
    other = MATRIX[LOADS_INTO[name]]
    resumed = simulate(other, ranks=[other.world_size - 1], phases=(), load_from=report, measure_memory=False)
    passed(resumed)
    assert all(r.load_reads > 0 for r in resumed.ranks)
    assert report.order is not None and report.order.complete
    for r in report.ranks:
        devices = {p["device"] for b in r.blocks for p in b["parameters"]} if r.blocks else set()
        assert devices <= {f"cuda:{r.rank % NODE}"}, (r.rank, devices)
    # the only host synchronisations of a step are the known ones, each named by its line
    functions = {site.rsplit(" ", 1)[-1] for _, site in train_syncs(report)}
    assert functions <= KNOWN_SYNCS, train_syncs(report)


KNOWN_SYNCS = {
    "reduce_over_ranks",  # relocation: the ranks agree on which per-sample inputs they exchange (every step)
    "_run_schedule",  # torch.distributed.pipelining's warm-up vote, on a schedule's first step only
    "broadcast_from_last_stage",  # pipelines: the last stage's loss to every stage (an object collective)
    "<listcomp>",  # pipelines: the micro-batches' losses read for logging, as the strategy reads them
}


def test_the_automatic_plan_says_its_trials_are_skipped() -> None:
    from pathlib import Path

    a100 = str(Path(__file__).parents[1] / "benchmarks" / "data" / "llama2-7b-a100-8gpu.json")
    report = simulate(
        "auto", ranks=[0, 7], phases=("train",), world_size=8, hardware=a100, memory_per_device="1GB", seq_length=8
    )
    passed(report)
    assert any("measured selection" in note and "skipped" in note for note in report.notes)


def test_a_memory_size_with_its_unit_sizes_the_simulated_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory_per_device="36GB"`` from Python (the command converts its flag itself) is the GPUs' size in bytes."""
    import lightning_galvatron.dryrun.run as run

    jobs = []

    def capture(job, chosen, workers):
        jobs.append(job)
        raise KeyboardInterrupt  # stop before any rank runs

    monkeypatch.setattr(run, "run_ranks", capture)
    with pytest.raises(KeyboardInterrupt):
        simulate(ParallelPlan.uniform(8, 4, S()), ranks=[0], phases=("train",), memory_per_device="36GB")
    assert jobs[0].device_memory == 36 * 10**9


def test_the_relocation_agrees_once_per_forward_not_per_block() -> None:
    """Four tensor-parallel blocks gather the samples of the embedding's two data shards: the ranks agree that they
    hold the same inputs once per micro-batch's forward (a host synchronisation each), not once per block."""
    plan = ParallelPlan(world_size=2, layers=(S(tp=2),) * 4, vocab=S(), micro_batches=2, global_batch_size=4)
    report = simulate(plan, ranks=[0], phases=("train",), measure_memory=False)
    passed(report)
    (rank,) = report.ranks
    agreements = [s["count"] for s in rank.host_syncs if any("_agree_on_per_sample" in f for f in s["stack"])]
    assert sum(agreements) == plan.micro_batches, rank.host_syncs


# ---------------------------------------------------------------------------------------------- the rules bite
def test_planted_faults_fail_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime change that sends a CPU tensor to a collective, and an ``.item()`` added to the training step, are
    each reported with the line that made them; the same plan passes without them."""
    import examples.gpt as example
    from lightning_galvatron.runtime import mesh

    plan = ParallelPlan(
        world_size=4, layers=(S(), S(tp=2, dp_type="zero3"), S(), S(dp_type="zero2")), vocab=S(), global_batch_size=8
    )
    clean = simulate(plan, ranks=[1], phases=("train",))
    passed(clean)

    # 1. the runtime's small host values reduced as CPU tensors (what gloo takes, NCCL refuses)
    monkeypatch.setattr(mesh, "collective_device", lambda group=None: torch.device("cpu"))
    report = simulate(plan, ranks=[1], phases=("train",))
    assert not report.ok
    broken = [v for r in report.ranks for v in r.violations]
    assert broken and all(v["rule"] == "tensor not on the rank's own GPU" for v in broken)
    assert "got tensors on cpu" in broken[0]["message"] and any("mesh.py" in f for f in broken[0]["stack"])
    assert "NCCL's rules" in report.describe()
    monkeypatch.undo()

    # 2. a host synchronisation added to the training step
    step = example.GPTModule.training_step

    def training_step_reading_the_loss(self, batch, batch_idx):
        loss = step(self, batch, batch_idx)
        loss.item()
        return loss

    monkeypatch.setattr(example.GPTModule, "training_step", training_step_reading_the_loss)
    report = simulate(plan, ranks=[1], phases=("train",))
    planted = train_syncs(report) - train_syncs(clean)
    assert planted and all("training_step_reading_the_loss" in site for _, site in planted), planted
    clean_counts, counts = clean.host_syncs_per_step(), report.host_syncs_per_step()
    assert all(counts[r] == clean_counts[r] + 1 for r in counts)


# ---------------------------------------------------------------------------------------------- the command's limit
def test_the_command_fails_a_step_over_max_host_syncs_naming_where(
    tmp_path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dry-run --max-host-syncs N`` passes a step that synchronises the host N times and fails one more, naming
    the line that made it (an ``.item()`` planted in the training step)."""
    import json

    import examples.gpt as example
    from lightning_galvatron.cli.app import main

    # tensor-parallel blocks gather the samples of the embedding's two data shards: the ranks agree on it per forward
    plan = ParallelPlan(world_size=2, layers=(S(tp=2),) * 4, vocab=S(), global_batch_size=4)
    plan.save(tmp_path / "plan.json")

    def dry_run_command(limit: int, *extra: str) -> tuple[int, str]:
        model = ["--model", TINY_GPT, "--model-args", json.dumps(GPT_ARGS), "--plan", str(tmp_path / "plan.json")]
        code = main(
            ["dry-run", *model, "--device", "cuda", "--devices-per-node", "2", "--ranks", "all", "--phases", "train"]
            + ["--no-memory", "--workers", "2", "--max-host-syncs", str(limit), *extra]
        )
        return code, capsys.readouterr().out

    code, out = dry_run_command(1000, "--json")
    assert code == 0, out
    limit = max(json.loads(out)["host_syncs_per_step"].values())
    assert limit > 0

    step = example.GPTModule.training_step

    def training_step_reading_the_loss(self, batch, batch_idx):
        loss = step(self, batch, batch_idx)
        loss.item()
        return loss

    monkeypatch.setattr(example.GPTModule, "training_step", training_step_reading_the_loss)
    code, out = dry_run_command(limit)
    assert code == 1
    said = out[out.index(f"--max-host-syncs {limit}: ") :]
    assert f"rank 0: {limit + 1}, rank 1: {limit + 1}" in said, said
    assert "training_step_reading_the_loss" in said, said
