"""``GalvatronFabricStrategy``: ``Fabric(strategy="galvatron")``, the Trainer's plans for a hand-written loop (LitGPT).
Read it as "what happens at which Fabric call"; the work is the library's, shared with the Trainer's strategy.

- ``__init__``: check every argument, before anything is launched.
- ``_configure_launcher`` (main process, before any worker starts): the precision, a given plan's world size and
  whether Fabric can run it (no pipeline, no micro-batches), the memory budget.
- ``setup_environment`` (``fabric.launch()``): the process group; the watchdog (below); a given plan is loaded, so
  that data loaders set up before the model already read its data shards. Meshes are made lazily.
- ``setup_module`` (``fabric.setup(model)``): a model built on the meta device (``fabric.init_module(empty_init=True)``)
  is materialised whole first, so that it starts from the weights DDP would give it; its blocks are found, the plan
  is resolved -- given, or with ``plan="auto"`` profiled on ``example_input`` and searched without pipelines or
  micro-batches (:func:`~lightning_galvatron.plan.rules.own_loop_problem`) -- reported, and applied by
  :func:`~lightning_galvatron.strategy.preparation.prepare`, as under the Trainer. The model's first forward compares
  its input over the ranks of each data shard (:meth:`~lightning_galvatron.strategy.data.DataShards.check_first_batch`).
- ``setup_optimizer`` / ``setup_module_and_optimizers``: optimizers made after ``fabric.setup(model)`` hold the split
  parameters; ones given with the model are pointed at them by name. Each step tells the gradient reducer.
- ``distributed_sampler_kwargs`` / ``process_dataloader`` (``fabric.setup_dataloaders``): the plan's data shards,
  each re-batched to read the samples DDP would give its ranks (:mod:`lightning_galvatron.strategy.data`).
- ``backward``: the loss scaled to the mean over all shards (gradients are summed over dp groups).
- ``no_backward_sync``: ddp layers sum their gradients once, at the accumulation window's last backward.
- ``clip_gradients_norm`` / ``clip_gradients_value``: the global norm over every mesh; by value on local shards.
- ``save_checkpoint`` / ``load_checkpoint`` (``fabric.save`` / ``fabric.load`` / ``fabric.load_raw``): sharded DCP
  checkpoints laid out as the Trainer's (:mod:`lightning_galvatron.strategy.checkpoint`), loaded into any plan; a full
  file (``save_distributed_checkpoint=False``) staged and renamed into place as they are (``checkpoint_files``).

The watchdog (:class:`~lightning_galvatron.runtime.watchdog.RankMonitor`) ends the job, naming the rank, when a rank's
heartbeat stops (a stopped or dead process) or it stays behind the others for ``setup_timeout_s``. It knows less than
under the Trainer: Fabric tells a strategy neither where a step begins (data loading and evaluation are the loop's,
so no limit is derived from step times) nor when the loop has ended or failed (it never calls ``teardown``), so a
run's watchdog watches until the next Fabric run of the process starts its own, or the process exits.

Pipelines (``pp > 1``) and micro-batches are refused: the loop calls the model and computes the loss itself, which a
schedule would have to split per micro-batch; ``Trainer(strategy="galvatron")`` runs them.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.types import _Stateful
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten

from lightning_galvatron._compat import override
from lightning_galvatron.errors import reported_by_rank_zero
from lightning_galvatron.model.discovery import ModelStructure, find_blocks
from lightning_galvatron.model.tensor_parallel_plans import block_tensor_parallel_plans
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.plan.rules import own_loop_problem
from lightning_galvatron.profiler.model import forward_step
from lightning_galvatron.runtime.apply import AppliedPlan, check_runtime_support, input_shard
from lightning_galvatron.runtime.clipping import clip_grad_norm_, clip_grad_value_
from lightning_galvatron.runtime.mesh import MeshCache
from lightning_galvatron.runtime.sync import destroy_process_group
from lightning_galvatron.runtime.watchdog import RankMonitor, WatchdogSettings
from lightning_galvatron.strategy.arguments import check_strategy_arguments
from lightning_galvatron.strategy.autoplan import (
    SearchSettings,
    check_memory_budget,
    default_memory_budget,
    plan_automatically,
)
from lightning_galvatron.strategy.checkpoint import (
    CheckpointError,
    hf_models,
    load_checkpoint,
    whole_strided_tensors,
    without_created_states,
)
from lightning_galvatron.strategy.checkpoint_files import save_file, save_sharded
from lightning_galvatron.strategy.data import DataShards, sampler_kwargs
from lightning_galvatron.strategy.display import setup_report
from lightning_galvatron.strategy.precision import check_precision, precision_flag
from lightning_galvatron.strategy.prediction import Prediction, plan_source_name, price_given_plan, searched_prediction
from lightning_galvatron.strategy.preparation import (
    count_optimizer_steps,
    explain_automatic_planning,
    load_given_plan,
    prepare,
)

_DESCRIPTION = "Hybrid parallelism with a per-layer plan searched by Galvatron (Fabric)"
#: Keys of the checkpoint layout (the Trainer's) that a Fabric state cannot use for its own entries.
_RESERVED_KEYS = ("state_dict", "optimizer_states", "galvatron")


class GalvatronFabricStrategy(ModelParallelStrategy):
    """Train a model in a hand-written Fabric loop with a per-layer hybrid-parallel plan.

    Args:
        plan: a :class:`~lightning_galvatron.plan.ParallelPlan`, a dict or a JSON file with ``pp=1`` and
            ``micro_batches=1``; or ``"auto"`` (default): profile the model on ``example_input`` when
            ``fabric.setup(model)`` runs and search the fastest such plan that fits ``memory_budget``.
        example_input: what one device passes to the model in one step of the loop: a tensor (``model(x)``), a tuple
            (``model(*x)``) or a dict (``model(**x)``); its first dimension is the per-device batch. Needed by
            ``plan="auto"`` (Fabric sets the model up before the loop has seen a batch); with a given plan it
            looks the cached profile up to print the plan's prediction.
        loss_fn: ``loss_fn(output, example_input) -> loss`` for profiling (default: the output's ``loss``, else the
            log-sum-exp of its logits, which costs what a cross-entropy costs).
        layers, memory_budget, max_tp, disable, profile_cache, calibration, search_options,
            broadcast_initial_weights: as for :class:`~lightning_galvatron.strategy.GalvatronStrategy`. The search
            never offers pipelines or micro-batches here, nor changes the batch (the loop fixes it).
        save_distributed_checkpoint, process_group_backend, timeout: as for Fabric's ``ModelParallelStrategy``.
        watchdog: end the job, naming the ranks at fault, when a rank's process stops or dies, or it stays behind
            the others (module docstring): ``True`` (default: after 5 minutes), ``False``, or
            ``{"setup_timeout_s": seconds}``.

    No measured selection (trials): it trains copies of the model with their optimizers, which Fabric creates after
    ``fabric.setup(model)``; the search's plan is trained.
    """

    strategy_name = "galvatron"

    def __init__(
        self,
        plan: ParallelPlan | Mapping[str, Any] | str | os.PathLike = "auto",
        example_input: Any = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        layers: str | Sequence[str] | None = None,
        memory_budget: int | str | None = None,
        max_tp: int | None = None,
        disable: Sequence[str] = (),
        profile_cache: bool | str | os.PathLike = True,
        calibration: Any = None,
        search_options: Mapping[str, Any] | None = None,
        broadcast_initial_weights: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        watchdog: bool | Mapping[str, float] = True,
    ) -> None:
        super().__init__(
            parallelize_fn=_applied_in_setup_module,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        with reported_by_rank_zero(rank_zero_only.rank):
            check_strategy_arguments(plan, layers, None)
            settings = SearchSettings.of(
                memory_budget, profile_cache, search_options, max_tp=max_tp, disable=disable, calibration=calibration
            )
            if settings.options.search_batch_size:
                raise ValueError(
                    "search_batch_size: under Fabric your loop fixes the batch (DataLoader batch_size x devices); "
                    "leave the search to the batch it trains"
                )
            if loss_fn is not None and not callable(loss_fn):
                raise ValueError(f"loss_fn must be a function (output, example_input) -> loss, got {loss_fn!r}")
            if isinstance(watchdog, Mapping) and set(watchdog) - {"setup_timeout_s"}:
                raise ValueError(
                    f"watchdog {sorted(set(watchdog) - {'setup_timeout_s'})}: under Fabric the watchdog has one "
                    "timeout, setup_timeout_s (the strategy does not see where your loop's steps begin)"
                )
            self._watchdog = WatchdogSettings.of(watchdog)
        options = dataclasses.replace(settings.options, max_pp=1, max_micro_batches=1)  # see rules.own_loop_problem
        self._search = dataclasses.replace(settings, options=options)
        self._plan_source = plan
        self._example_input = example_input
        self._loss_fn = loss_fn
        self._layers = layers
        self._broadcast_initial_weights = broadcast_initial_weights
        self._meshes: MeshCache | None = None
        self._module: nn.Module | None = None  # the model the plan was applied to
        self._applied: AppliedPlan | None = None
        self.plan: ParallelPlan | None = None
        self.prediction: Prediction | None = None
        self.structure: ModelStructure | None = None
        self._backward_sync_control = _DeferredGradientSums(self)
        self._monitor: RankMonitor | None = None
        self._optimizer_steps = 0

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        # Absent, or the factory registered while a module of this package was importing Lightning (_registry).
        if dict.get(strategy_registry, cls.strategy_name, {}).get("strategy") is not cls:
            strategy_registry.register(cls.strategy_name, cls, description=_DESCRIPTION, override=True)

    # ------------------------------------------------------------------ launch and environment
    @override
    def _configure_launcher(self) -> None:
        assert self.parallel_devices is not None
        with reported_by_rank_zero(rank_zero_only.rank):
            check_precision(precision_flag(self.precision))
            if self._plan_source != "auto":
                plan = load_given_plan(self._plan_source, self.num_nodes * len(self.parallel_devices), None)
                if (problem := own_loop_problem(plan)) is not None:
                    raise PlanError(problem)
            if self._search.memory_budget_bytes is not None:
                devices = len(self.parallel_devices)
                check_memory_budget(self._search.memory_budget_bytes, self.parallel_devices[0], devices)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)  # not ModelParallelStrategy's 2-D mesh: the plan makes its meshes
        initialised_here = not dist.is_initialized()
        self._setup_distributed()
        if initialised_here:
            atexit.register(destroy_process_group)
        self._meshes = MeshCache.shared(self.root_device.type)
        self._monitor = _watch(self.global_rank, self.world_size, self._watchdog)
        if self._plan_source != "auto":
            self.plan = load_given_plan(self._plan_source, self.world_size, None)

    # ------------------------------------------------------------------ fabric.setup: resolve and apply the plan
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self._module is not None:
            raise RuntimeError(
                "GalvatronFabricStrategy parallelises one model per Fabric; set up other models with another Fabric"
            )
        assert self._meshes is not None, "fabric.launch() first"
        self._progress("fabric.setup(model)")
        _materialize_distributed_module(module, self.root_device)  # meta weights made whole (DDP's), then split
        structure = find_blocks(module, self._layers)
        tp_plans = block_tensor_parallel_plans(structure)
        plan, prediction = self._resolve_plan(module, structure, tp_plans)
        rank_zero_info(setup_report(prediction, structure.block_names))
        self._applied = prepare(
            module,
            structure,
            plan,
            self._meshes,
            precision_flag(self.precision),
            self.root_device,
            tp_plans=tp_plans,
            broadcast_initial_weights=self._broadcast_initial_weights,
        )
        self.plan, self.prediction, self.structure, self._module = plan, prediction, structure, module
        self._check_first_input(module)
        self._progress("the loop, after fabric.setup(model)")
        return module

    def _check_first_input(self, module: nn.Module) -> None:
        """The ranks of a data shard compute on one input: the model's first forward compares a digest of its input
        over each shard and refuses a difference on every rank (an ``IterableDataset`` that shards itself by
        ``torch.distributed.get_rank()`` gives each rank its own samples; ``setup_dataloaders`` shards by the plan)."""
        assert self._meshes is not None
        shards = DataShards(self._require_plan(), self.global_rank, self._meshes, self.root_device)
        if not shards.shared:
            return

        @torch.compiler.disable  # eager also in a compiled model (fabric.setup re-applies the loop's torch.compile)
        def first_forward(_: nn.Module, args: tuple, kwargs: dict) -> None:
            handle.remove()
            shards.check_first_batch((args, kwargs), "input", 0, front="fabric")

        handle = module.register_forward_pre_hook(first_forward, with_kwargs=True)

    def _resolve_plan(
        self, module: nn.Module, structure: ModelStructure, tp_plans: Sequence[Any]
    ) -> tuple[ParallelPlan, Prediction]:
        """The given plan (checked, priced with a cached profile if ``example_input`` finds one), or the searched one;
        the same on every rank."""
        context: dict[str, Any] = {
            "world_size": self.world_size,
            "devices_per_node": self.num_processes,
            "device": self.root_device,
            "precision": precision_flag(self.precision),
            "settings": self._search,
            "optimizer": "adamw",  # made after setup: planned as Adam, the common worst case
        }
        example = None if self._example_input is None else move_data_to_device(self._example_input, self.root_device)
        per_device = _samples_in(example)
        if self.plan is not None:
            check_runtime_support(self.plan, structure, tp_plans)  # before the plan is priced, printed or applied
            source = plan_source_name(self._plan_source)
            if example is None:
                budget = self._search.memory_budget_bytes or default_memory_budget(self.root_device, self.num_processes)
                return self.plan, Prediction(self.plan, source, budget, missing="no example_input to price it with")
            return self.plan, price_given_plan(self.plan, source, module, structure, (example,), per_device, **context)
        if example is None or per_device is None:
            raise PlanError(
                'plan="auto" under Fabric profiles the model in fabric.setup(model), before your loop has seen a '
                "batch: pass GalvatronFabricStrategy(example_input=...) with what one device gives the model in one "
                "step (e.g. torch.randint(vocab_size, (micro_batch_size, seq_length))), or pass a plan"
            )
        explain_automatic_planning(structure, self.world_size)
        auto = plan_automatically(
            module,
            structure,
            example,
            global_batch_size=per_device * self.world_size,
            step=forward_step(self._loss_fn),
            **context,
        )
        check_runtime_support(auto.plan, structure, tp_plans)
        return auto.plan, searched_prediction(auto, optimizer=context["optimizer"], precision=context["precision"])

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, optimizer)``: the plan replaces parameters (sharded, split, materialised), so each
        optimizer made before is pointed at the new ones, by name (before its first step: it has no states)."""
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        current = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError(
                    "fabric.setup(model, optimizer) with an optimizer that has stepped: the plan replaces the model's "
                    "parameters; set up the model first and load the optimizer's state after (fabric.load)"
                )
            for group in optimizer.param_groups:
                group["params"] = [current[names[id(p)]] if id(p) in names else p for p in group["params"]]
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._applied is None or self._module is None:
            raise RuntimeError(
                "GalvatronFabricStrategy: set up the model first, then its optimizer: model = fabric.setup(model); "
                "optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))"
            )
        own = {id(p) for p in self._module.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "the optimizer holds parameters the plan has replaced: create it after fabric.setup(model), from "
                "model.parameters(), or pass it with the model: fabric.setup(model, optimizer)"
            )
        count_optimizer_steps(self._applied, [optimizer])
        return optimizer

    # ------------------------------------------------------------------ data: batch semantics
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return sampler_kwargs(self._require_plan(), self.global_rank, self.world_size, None)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Each data shard reads, per step, the samples DDP would give its ranks (its ranks share one batch)."""
        assert self._meshes is not None
        return DataShards(self._require_plan(), self.global_rank, self._meshes, self.root_device).process_dataloader(
            dataloader, None
        )

    # ------------------------------------------------------------------ backward, optimizer steps and clipping
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self._optimizer_steps += 1
        self._progress(f"the loop, after optimizer step {self._optimizer_steps}")
        return output

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        # Each data shard's loss is the mean over its own samples; gradients are summed over dp groups.
        num_shards, _ = input_shard(self._require_plan(), self.global_rank)
        super().backward(tensor / num_shards, module, *args, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The norm over every parameter, whatever mesh it lives on (the per-mesh norms combined)."""
        self.precision.unscale_gradients(optimizer)
        total = clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is {float(total)}: they were scaled by it; "
                "set error_if_nonfinite=False to go on"
            )
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """The Trainer's layout: the model as ``state_dict``, the optimizers as ``optimizer_states`` (in the order of
        ``state``), everything else as is (``state_dict()`` of stateful objects), the plan under ``galvatron``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if storage_options is not None:
            raise TypeError("GalvatronFabricStrategy.save_checkpoint(..., storage_options=...) is not supported")
        if filter is not None and self._save_distributed_checkpoint:
            raise NotImplementedError("filter= needs save_distributed_checkpoint=False (as ModelParallelStrategy)")
        module_key, module, optimizers = self._split_state(state)
        options = StateDictOptions(full_state_dict=not self._save_distributed_checkpoint, cpu_offload=True)
        model_state = get_model_state_dict(module, options=options)
        if filter is not None and module_key in filter:  # a full checkpoint only (refused above otherwise)
            model_state = {name: value for name, value in model_state.items() if filter[module_key](name, value)}
        checkpoint: dict[str, Any] = {"state_dict": model_state}
        checkpoint["optimizer_states"] = [
            self._optimizer_state(module, optimizer, options) for _, optimizer in optimizers
        ]
        checkpoint["galvatron"] = {
            "plan": self._require_plan().to_dict(),
            "hf_models": hf_models(module),
            "fabric": {"model": module_key, "optimizers": [key for key, _ in optimizers]},
        }
        for key, obj in state.items():
            if key != module_key and not isinstance(obj, Optimizer):
                checkpoint[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        path = Path(self.broadcast(path))
        self._progress(f"saving the checkpoint {path}")
        if self._save_distributed_checkpoint:  # staged, renamed into place when complete (checkpoint_files)
            save_sharded(whole_strided_tensors(checkpoint), path, self.global_rank, self.barrier)
        elif self.global_rank == 0:  # the same for the one file
            save_file(checkpoint, path)
        self._progress(f"the loop, after saving {path}")

    def _optimizer_state(self, module: nn.Module, optimizer: Optimizer, options: Any) -> dict[str, Any]:
        """Saved before the first step, an optimizer stays without states (see ``without_created_states``)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        unstepped = not optimizer.state
        saved = get_optimizer_state_dict(module, optimizer, options=options)
        return without_created_states(optimizer, saved) if unstepped else saved

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """A checkpoint of this strategy (or the Trainer's) saved under any plan and device count, into this plan;
        ``fabric.load_raw`` of a full state dict file (``torch.save(model.state_dict())``), by name."""
        path = Path(self.broadcast(path))  # every rank loads what rank 0 was given
        self._progress(f"fabric.load of {path}, or the loop after it")
        if isinstance(state, nn.Module):
            _load_raw(path, state, strict=strict, weights_only=weights_only)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError("loading an optimizer alone is not supported: fabric.load(path, state)")
        if not state:
            raise ValueError("fabric.load(path, state) needs a state with the model: {'model': model, ...}")
        module_key, module, optimizers = self._split_state(state)
        remainder = load_checkpoint(
            path, module, [optimizer for _, optimizer in optimizers], strict=strict, weights_only=weights_only
        )
        remainder.pop("galvatron", None)
        requested = [key for key in state if key != module_key and not isinstance(state[key], Optimizer)]
        _validate_keys_for_strict_loading(requested, remainder.keys(), strict=strict)
        for key in requested:
            if key in remainder:
                if isinstance(state[key], _Stateful):
                    state[key].load_state_dict(remainder.pop(key))
                else:
                    state[key] = remainder.pop(key)
        return remainder

    def _split_state(self, state: Mapping[str, Any]) -> tuple[str, nn.Module, list[tuple[str, Optimizer]]]:
        """The set-up model's key and the optimizers (in order) of a ``fabric.save``/``fabric.load`` state."""
        modules = [key for key, obj in state.items() if isinstance(obj, nn.Module)]
        if len(modules) != 1 or state[modules[0]] is not self._module:
            raise ValueError(
                "the state must hold the model set up with this Fabric, once, and no other module "
                f"(found modules under {modules or 'no key'}): {{'model': model, 'optimizer': optimizer, ...}}"
            )
        reserved = [key for key in state if key in _RESERVED_KEYS]
        if reserved:
            raise ValueError(
                f"the state uses the key(s) {reserved}, which the checkpoint keeps for itself: rename them"
            )
        optimizers = [(key, obj) for key, obj in state.items() if isinstance(obj, Optimizer)]
        return modules[0], state[modules[0]], optimizers

    # ------------------------------------------------------------------ helpers
    @property
    def applied(self) -> AppliedPlan | None:
        """The plan as the runtime applied it to the model (``None`` before ``fabric.setup``)."""
        return self._applied

    def _progress(self, where: str) -> None:
        if self._monitor is not None:
            self._monitor.mark(where)

    def _require_plan(self) -> ParallelPlan:
        if self.plan is None:
            raise RuntimeError(
                'with plan="auto" the plan is made in fabric.setup(model), and it decides which ranks share samples: '
                "set up the model before fabric.setup_dataloaders(...) and before the first backward"
            )
        return self.plan


class _DeferredGradientSums(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=is_accumulating)``: backward passes inside only accumulate; the ddp
    layers sum their gradients once, in the window's last backward, as ``DistributedDataParallel.no_sync`` does.
    ZeRO layers reduce-scatter every backward (their gradients stay sharded), as under the Trainer."""

    def __init__(self, strategy: GalvatronFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        applied = self._strategy.applied
        return applied.gradients.deferred() if enabled and applied is not None else nullcontext()


#: This process's Fabric watchdog: one at a time (Fabric never says when a run has ended).
_WATCHING: list[RankMonitor] = []


def _watch(rank: int, world_size: int, settings: WatchdogSettings | None) -> RankMonitor | None:
    """A started watchdog for this run, in place of the previous run's; stopped at exit (the others see this rank
    finished, not missing)."""
    _stop_watching()
    monitor = RankMonitor.connect(rank, world_size, settings)
    if monitor is not None:
        _WATCHING.append(monitor)
    return monitor


@atexit.register
def _stop_watching() -> None:
    while _WATCHING:
        _WATCHING.pop().stop()


def _applied_in_setup_module(module: nn.Module, _: Any) -> nn.Module:
    """Fabric's ``ModelParallelStrategy`` takes a ``parallelize_fn``; this strategy applies its plan in setup_module."""
    return module


def _samples_in(example: Any) -> int | None:
    """The per-device batch of an example input: the first dimension of its first tensor."""
    leaves, _ = tree_flatten(example)
    return next((leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim()), None)


def _load_raw(path: Path, module: nn.Module, strict: bool, weights_only: bool | None) -> None:
    """A full state dict file into the split model: every rank reads it (memory-mapped) and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if not path.is_file():
        raise CheckpointError(
            f"fabric.load_raw needs a file holding a full state dict, but {str(path)!r} is not a file"
        )
    full = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    own = get_model_state_dict(module)
    missing, unexpected = sorted(set(own) - set(full)), sorted(set(full) - set(own))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{str(path)!r} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]}): load it "
            "into the model it was saved from, or pass strict=False"
        )
    local = {name: full[name] for name in own if name in full}
    set_model_state_dict(module, local, options=StateDictOptions(full_state_dict=True, strict=False))


GalvatronFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # also called by _registry once Lightning is imported
