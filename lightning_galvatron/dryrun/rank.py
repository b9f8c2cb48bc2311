"""One simulated rank: the plan applied as training applies it, and one step of each phase on fake tensors.

Runs in a process of its own (the process group is global state): the fake backend
(``dist.init_process_group("fake", ...)``) makes this process rank ``r`` of ``world_size``; its
collectives return at once without data. What runs is what :class:`~lightning_galvatron.GalvatronStrategy`
runs, in its order:

1. setup: blocks found, precision applied to the module, the weights made fake tensors
   (``FakeTensorMode``: shapes and dtypes, no storage; or for small models real zero-filled CPU tensors,
   ``real_tensors``, several times faster -- values are placeholders either way), rank 0's weights
   broadcast, then the real :func:`~lightning_galvatron.runtime.apply.apply_plan` -- meshes, relocation
   hooks, tensor/sequence parallelism, recomputation, FSDP2 and DDP gradient buckets, the pipeline stage,
   vocabulary parallelism;
2. the optimizer from the module's ``configure_optimizers``;
3. ``train``: one optimizer step as the strategy drives it (:mod:`lightning_galvatron.runtime.step`, the step
   training and the trials run too) -- with micro-batches or a pipeline, the
   runtime's runner and the real ``torch.distributed.pipelining`` schedule (its sends and receives
   return at once), the deferred DDP gradient reduction, the loss handed from the last stage; without,
   the user's ``training_step`` and backward with the loss scaled to the global-batch mean. Optional
   clipping by the global norm; then the optimizer step;
4. ``validate``: one validation step (forward only, the schedule's ``eval``);
5. ``checkpoint``: the sharded model and optimizer state dicts collected as a distributed checkpoint
   save collects them, and this rank's part of the save planned (nothing is written, :mod:`.checkpoint`);
6. with ``RankJob.load_index`` (another plan's save): that checkpoint loaded as the strategy loads one,
   each read planned against its index (nothing is read). After the other phases: what a load asks for
   does not depend on them.

When memory is measured, the optimizer's states are created before the measured step (a step on zero
gradients, outside the recording), so the peak is that of a step in steady training, not of the first.
"""

from __future__ import annotations

import logging
import time
import traceback
import warnings
from collections.abc import Collection
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_galvatron.dryrun.checkpoint import plan_load, plan_save
from lightning_galvatron.dryrun.cuda import FakeCudaFactories, fake_parameter_moves, simulated_gpu
from lightning_galvatron.dryrun.memory import StepMemoryTracker
from lightning_galvatron.dryrun.nccl_rules import register_simulated_nccl
from lightning_galvatron.dryrun.trace import Recording
from lightning_galvatron.model.discovery import find_blocks
from lightning_galvatron.model.outside_layers import trace_outside_layers
from lightning_galvatron.model.tensor_parallel_plans import block_tensor_parallel_plans
from lightning_galvatron.runtime.apply import AppliedPlan
from lightning_galvatron.runtime.mesh import Layout, MeshCache, local_tensor
from lightning_galvatron.runtime.step import NormScope, from_last_stage, mean_loss, run_batch, train_step
from lightning_galvatron.strategy.precision import GlobalNormClipping, precision_plugin_for
from lightning_galvatron.strategy.preparation import overridden_step_methods, prepare


@dataclass
class RankJob:
    """What every simulated rank of one dry run shares (inherited by the forked processes)."""

    module: nn.Module  # the LightningModule on the meta device; each process changes its own copy
    plan: Any  # ParallelPlan
    precision: str
    seq_length: int
    make_batch: Any  # (local_batch, seq_length) -> batch
    layers: Any = None
    phases: tuple[str, ...] = ("train", "validate")
    measure_memory: bool = True
    keep_stacks: bool = True
    gradient_clip_val: float | None = None
    real_tensors: bool = False  # zero-filled CPU tensors instead of fake ones: faster for small models
    device: str = "cpu"  # "cuda": fake tensors on a simulated GPU per rank, NCCL's rules checked (dryrun.cuda)
    devices_per_node: int = 8  # with device="cuda": rank r holds cuda:(r % devices_per_node)
    device_memory: int | None = None  # with device="cuda": what the simulated GPU reports (default 80 GB)
    load_index: Any = None  # DCP's index (Metadata) of another plan's save: loaded after the phases


@dataclass
class RankResult:
    """What one rank reports (plain data: it crosses processes)."""

    rank: int
    stage: int
    seconds: float = 0.0
    blocks: list[dict[str, Any]] = field(default_factory=list)
    outside_blocks: list[dict[str, Any]] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    memory: dict[str, int] | None = None
    operations: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> kind -> count
    events: list[Any] | None = None  # trace.Event, when recorded
    placeholders: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)  # NCCL's rules broken (nccl_rules.Violation)
    host_syncs: list[dict[str, Any]] = field(default_factory=list)  # nccl_rules.HostSync, on a simulated GPU
    save_plan: Any = None  # with the checkpoint phase: this rank's DCP SavePlan (see dryrun.checkpoint.saved_index)
    load_reads: int = 0  # with RankJob.load_index: the reads of the load planned on this rank
    error: str | None = None

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        out = {
            "rank": self.rank,
            "stage": self.stage,
            "seconds": self.seconds,
            "blocks": self.blocks,
            "outside_blocks": self.outside_blocks,
            "groups": self.groups,
            "memory": self.memory,
            "operations": self.operations,
            "placeholder_reads": self.placeholders,
            "violations": self.violations,
            "host_syncs": self.host_syncs,
            "load_reads": self.load_reads,
            "error": self.error,
        }
        if events and self.events is not None:
            out["events"] = [e.to_dict() for e in self.events]
        return out


def simulate_rank(job: RankJob, rank: int) -> RankResult:
    """Be ``rank`` of ``job.plan.world_size`` (see the module docstring). Errors are reported, not raised."""
    plan = job.plan
    result = RankResult(rank, rank // plan.devices_per_stage)
    started = time.perf_counter()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's "self.log() without a Trainer" and friends, once per rank
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # DTensor's advice, once per rank
    recording = Recording(rank, plan.world_size, keep_stacks=job.keep_stacks)
    simulation = (
        simulated_gpu(rank, job.devices_per_node, job.device_memory, recording)
        if job.device == "cuda"
        else fake_parameter_moves()
    )
    try:
        with simulation:
            if dist.is_initialized():  # inherited from the parent (a Trainer ran there): this process is another rank
                dist.destroy_process_group()
            backend = register_simulated_nccl() if job.device == "cuda" else "fake"
            dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=plan.world_size)
            _run(job, rank, recording, result)
    except Exception:  # noqa: BLE001 - reported per rank
        result.error = traceback.format_exc()
    finally:
        if recording.rules is not None:
            result.violations = [v.to_dict() for v in recording.rules.violations]
            result.host_syncs = [s.to_dict() for s in recording.rules.host_syncs()]
        result.events = recording.events
        result.placeholders = recording.placeholders
        result.seconds = time.perf_counter() - started
        counts: dict[str, dict[str, int]] = {}
        for e in recording.events:
            counts.setdefault(e.phase, {}).setdefault(e.kind, 0)
            counts[e.phase][e.kind] += 1
        result.operations = counts
        if dist.is_initialized():
            dist.destroy_process_group()
    return result


def _run(job: RankJob, rank: int, recording: Any, result: RankResult) -> None:
    plan, module = job.plan, job.module
    fake = nullcontext() if job.real_tensors else FakeTensorMode(allow_non_fake_inputs=True)
    factories = FakeCudaFactories(fake) if job.device == "cuda" else nullcontext()  # CUDA tensors made outside `fake`
    with recording.active(), factories:
        structure = find_blocks(module, job.layers)
        blocks, names = structure.blocks, structure.block_names  # a pipeline stage removes other stages' blocks
        plugin = precision_plugin_for(job.precision, job.device)
        assert isinstance(plugin, GlobalNormClipping)  # every plugin the strategy uses clips over the plan
        module = plugin.convert_module(module)
        with fake:
            _materialize(module, job.real_tensors)
            # Which layers outside the blocks run before them and which after, as the strategy traces it.
            outside = (
                trace_outside_layers(module, structure, "training_step", job.make_batch(1, job.seq_length))
                if plan.pp > 1
                else None
            )
        # The plan is applied outside the fake mode (ops on the fake weights stay fake): DeviceMesh and
        # DTensor compute rank layouts from index tensors they make themselves, which must hold real values.
        # As the strategy applies it: rank 0's weights broadcast, the plan applied, the model placed on the device.
        device = torch.device(job.device, torch.cuda.current_device()) if job.device == "cuda" else torch.device("cpu")
        meshes = MeshCache(job.device)
        applied = prepare(
            module,
            structure,
            plan,
            meshes,
            job.precision,
            device,
            entry_methods=overridden_step_methods(module),
            outside_layers=outside,
            tp_plans=block_tensor_parallel_plans(structure),
        )
    result.blocks, result.outside_blocks = _holdings(module, blocks, names, plan, applied)
    result.groups = _groups(recording, meshes, plan, rank)

    with fake, recording.active():
        recording.read_placeholders = True
        optimizer = first_optimizer(module)
        optimizer.register_step_post_hook(lambda *_: applied.gradients.optimizer_stepped())
        plugin.norm_scope = NormScope.of(applied)  # as the strategy sets up clipping
        if job.measure_memory:
            recording.phase = "warm-up"
            _create_optimizer_states(optimizer)
            recording.events = [e for e in recording.events if e.phase != "warm-up"]

        local_batch = plan.global_batch_size // applied.input_shards
        batch = move_data_to_device(job.make_batch(local_batch, job.seq_length), device)  # batch_to_device
        if "train" in job.phases:
            recording.phase = "train"
            tracker = StepMemoryTracker(module, optimizer) if job.measure_memory else None
            with tracker if tracker is not None else nullcontext():
                _train_step(module, applied, optimizer, batch, plugin, job.gradient_clip_val)
            if tracker is not None:
                result.memory = tracker.peak()
        if "validate" in job.phases:
            recording.phase = "validate"
            _validation_step(module, applied, batch, plugin)
    if "checkpoint" in job.phases:
        # Outside the fake mode too, for the shard offsets DTensor computes.
        with recording.active(), factories:
            recording.phase, recording.read_placeholders = "checkpoint", False
            result.save_plan = plan_save(module, optimizer)
    if job.load_index is not None:
        with recording.active(), factories:
            recording.phase, recording.read_placeholders = "load", False
            result.load_reads = plan_load(module, optimizer, job.load_index, recording.rules)


# ---------------------------------------------------------------------------------------------- setup
def _materialize(module: nn.Module, real: bool = False) -> None:
    """Give the meta model fake (or ``real``, zero-filled) CPU tensors, before the plan is applied (as a model
    built on the CPU has them); made from shapes alone, so the fake mode keeps no reference to the meta ones."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if real:
            return torch.zeros(t.size(), dtype=t.dtype, device="cpu")
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")

    module._apply(empty)
    fake_mode = torch._guards.detect_fake_mode()
    if fake_mode is not None:
        # Its memo of converted tensors refers to them weakly, and a weakly referenced fake parameter cannot be
        # moved to a (simulated) GPU, which swaps it: a plain dict (a rank's process is short-lived).
        # ignore: torch declares the memo a WeakValueDictionary; a plain dict is the point here.
        fake_mode.fake_tensor_converter.meta_converter.tensor_memo = {}  # type: ignore[assignment]


def first_optimizer(module: Any) -> torch.optim.Optimizer:
    """The (first) optimizer of the module's ``configure_optimizers``, read as Lightning reads it."""
    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    if not optimizers:
        raise ValueError(f"{type(module).__name__}.configure_optimizers returned no optimizer")
    first: torch.optim.Optimizer = optimizers[0]
    return first


def _create_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients: the optimizer's states exist from then on, as in every step but the first."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- phases
def _train_step(
    module: Any, applied: AppliedPlan, optimizer: torch.optim.Optimizer, batch: Any, plugin: Any, clip: float | None
) -> None:
    """One optimizer step as ``GalvatronStrategy`` trains it (the runtime's step), clipped by the global norm as the
    strategy's precision plugin clips under ``Trainer(gradient_clip_val=clip)``."""

    def step(micro_batch: Any) -> Any:
        with plugin.train_step_context():
            return module.training_step(micro_batch, 0)

    def clip_by_norm(stepped: torch.optim.Optimizer) -> None:
        plugin.clip_gradients(stepped, clip, GradClipAlgorithmType.NORM)  # where LightningModule.clip_gradients ends

    train_step(applied, [optimizer], batch, step, clip=clip_by_norm if clip is not None else None)


def _validation_step(module: Any, applied: AppliedPlan, batch: Any, plugin: Any) -> None:
    """One validation step as the strategy runs it: forward only, the mean loss handed from the last stage."""

    def step(micro_batch: Any) -> Any:
        with plugin.val_step_context():
            return module.validation_step(micro_batch, 0)

    module.eval()
    try:
        with torch.no_grad():
            outputs = run_batch(applied, batch, step, train=False)
            if applied.runner is not None:  # as the strategy's micro-batches report the loss
                from_last_stage(applied, mean_loss(outputs))
    finally:
        module.train()


# ---------------------------------------------------------------------------------------------- the report
def _holdings(
    module: nn.Module, blocks: list[nn.Module], names: list[str], plan: Any, applied: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The blocks this rank holds (strategy, parameters with local and global shapes) and the layers outside them."""

    def params(owner: nn.Module, ids_to_skip: Collection[int] = frozenset()) -> list[dict[str, Any]]:
        out = []
        for name, p in owner.named_parameters():
            if id(p) in ids_to_skip:
                continue
            local = local_tensor(p)
            out.append(
                {
                    "name": name,
                    "local_shape": list(local.shape),
                    "global_shape": list(p.shape),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "device": str(local.device),
                    "placements": _placements(p),
                }
            )
        return out

    local_blocks = applied.partition.local_blocks if applied.partition is not None else range(plan.num_layers)
    held = []
    block_param_ids: set[int] = set()
    for index in local_blocks:
        listed = params(blocks[index])
        block_param_ids.update(id(p) for p in blocks[index].parameters())
        held.append(
            {
                "index": index,
                "name": names[index],
                "strategy": plan.layers[index].short(),
                "parameters": listed,
                "local_elements": sum(_numel(p["local_shape"]) for p in listed),
            }
        )
    return held, params(module, block_param_ids)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _placements(p: torch.Tensor) -> str:
    if not isinstance(p, DTensor):
        return "whole"
    return ", ".join(f"{name}:{placement}" for name, placement in zip(p.device_mesh.mesh_dim_names or (), p.placements))


def _groups(recording: Any, meshes: Any, plan: Any, rank: int) -> list[dict[str, Any]]:
    """The process groups this rank belongs to, named by what the plan uses them for."""
    purposes: dict[str, list[str]] = {}
    stage = Layout.stage(plan)
    layouts = {stage: "stage"}
    for s in [plan.vocab, *plan.layers]:
        layouts.setdefault(
            Layout.of(plan, s), f"tp={s.tp} {'consecutive' if Layout.of(plan, s).consecutive else 'strided'}"
        )
    for layout, label in layouts.items():
        mesh = meshes.mesh(layout)  # cached: nothing is created here
        for dim in mesh.mesh_dim_names:
            if mesh.size(mesh.mesh_dim_names.index(dim)) == 1:
                continue
            group = mesh.get_group(dim)
            what = (
                "pipeline"
                if dim == "pp"
                else f"{dim} of layout {label}"
                if layout != stage
                else "stage (all ranks of it)"
            )
            purposes.setdefault(group.group_name, []).append(what)
    out = []
    for name, members in recording.members.items():
        if rank in members and len(members) > 1:
            out.append(
                {
                    "name": name,
                    "members": list(members),
                    "used_for": purposes.get(name, ["world" if len(members) == plan.world_size else "other"]),
                }
            )
    return out
