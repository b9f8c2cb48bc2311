"""``GalvatronStrategy``: the Lightning glue. Read it as "what happens at which Lightning hook".

- ``__init__``: check every argument (:mod:`lightning_galvatron.strategy.arguments`), before anything is launched.
- ``_configure_launcher`` (main process, before any worker starts): check the precision, the plan's
  world size and the memory budget against the devices, and install the plugin that clips by the
  global norm across meshes.
- ``setup_environment`` (every worker): initialise the process group and start the rank monitor
  (:mod:`lightning_galvatron.runtime.watchdog`); meshes are made lazily.
- ``setup``: find the model's blocks, get the plan (given, or with ``plan="auto"`` profiled, searched and tried:
  the recipe :func:`lightning_galvatron.strategy.auto_setup.resolve_automatic_plan`) and its prediction,
  report them, broadcast rank 0's weights, apply the plan (the runtime does the work), create the optimizers,
  add the callback that logs plan and measurements (:mod:`lightning_galvatron.strategy.monitor`).
- ``distributed_sampler_kwargs`` / ``process_dataloader`` / ``batch_to_device``: give each data shard the samples DDP
  would train on, check its ranks got the same, test and predict as DDP lays them out (:mod:`.data`).
- ``training_step`` / ``validation_step`` / ...: with one micro-batch and no pipeline, Lightning's own
  path; otherwise the runtime's runner drives the micro-batches (and the pipeline schedule) through
  the user's step, backward included -- Lightning's ``zero_grad``/``backward`` are switched off for
  this (``fit_loop._skip_backward``, as Lightning's SWA callback does), because Lightning would zero
  the gradients between the step and its backward. Logs are recorded per micro-batch, handed from
  the last stage to all ranks and replayed (:mod:`lightning_galvatron.strategy.step_logs`).
- ``backward``: scale the loss to the global-batch mean (gradients are summed over dp groups).
- ``training_step`` / ``optimizer_step``: also tell the rank monitor where this rank is (an assignment).
- ``save_checkpoint`` / ``remove_checkpoint``: sharded DCP checkpoints, written aside and renamed into place once whole
  (:mod:`.checkpoint_files`); loaded into any plan (:mod:`.checkpoint`).
- ``on_exception`` / ``teardown``: one rank prints the error (or names the rank that died); stop the monitor.

No parallelism maths lives here: plans in :mod:`lightning_galvatron.plan`, execution in
:mod:`lightning_galvatron.runtime`.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_galvatron._compat import override
from lightning_galvatron.errors import leave_to_reporting_rank, note_cause, reported_by_rank_zero
from lightning_galvatron.model.discovery import ModelStructure
from lightning_galvatron.model.outside_layers import OutsideLayers
from lightning_galvatron.plan import ParallelPlan, PlanError
from lightning_galvatron.plan.rules import manual_optimization_problem
from lightning_galvatron.runtime.apply import AppliedPlan, input_shard
from lightning_galvatron.runtime.compile import compile_options
from lightning_galvatron.runtime.mesh import MeshCache
from lightning_galvatron.runtime.pipeline import PipelineRunner
from lightning_galvatron.runtime.step import NormScope
from lightning_galvatron.runtime.sync import destroy_process_group
from lightning_galvatron.runtime.vocab_parallel import parallel_cross_entropy
from lightning_galvatron.runtime.watchdog import RankMonitor, WatchdogSettings
from lightning_galvatron.selection import TrialSettings
from lightning_galvatron.strategy.arguments import check_strategy_arguments
from lightning_galvatron.strategy.auto_setup import PlanningContext, resolve_automatic_plan
from lightning_galvatron.strategy.autoplan import SearchSettings, check_memory_budget
from lightning_galvatron.strategy.checkpoint import (
    hf_models,
    load_checkpoint,
    whole_strided_tensors,
    without_created_states,
)
from lightning_galvatron.strategy.checkpoint_files import remove_checkpoint, save_sharded
from lightning_galvatron.strategy.data import (
    DataShards,
    batch_index,
    first_dataloader,
    loader_batch_size,
    sampler_kwargs,
    shard_batch_step,
)
from lightning_galvatron.strategy.display import setup_report
from lightning_galvatron.strategy.metrics import metric_states_kept, sync_metrics_over_data_shards
from lightning_galvatron.strategy.micro_batches import run_micro_batches, step_args_for_token_means
from lightning_galvatron.strategy.model_setup import block_plans, find_structure, traced_outside_layers
from lightning_galvatron.strategy.monitor import GalvatronMonitor, output_dir, save_plan_files
from lightning_galvatron.strategy.precision import check_precision_first, precision_flag, precision_plugin_for
from lightning_galvatron.strategy.prediction import Prediction, plan_source_name, price_given_plan
from lightning_galvatron.strategy.preparation import (
    count_optimizer_steps,
    load_given_plan,
    overridden_step_methods,
    place_restored,
    prepare,
)
from lightning_galvatron.strategy.replan import Replanning, check_replan
from lightning_galvatron.strategy.setup_steps import configured_optimizers, configured_optimizers_in_place

if TYPE_CHECKING:
    import lightning.pytorch as pl

_DESCRIPTION = "Hybrid parallelism with a per-layer plan searched by Galvatron"
_STEP_OF = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


class GalvatronStrategy(ModelParallelStrategy):
    """Train a LightningModule with a per-layer hybrid-parallel plan.

    Args:
        plan: ``"auto"`` (default) profiles the model and the cluster in ``setup`` and searches the fastest plan
            that fits ``memory_budget``; or the plan to execute: a :class:`~lightning_galvatron.plan.ParallelPlan`,
            a dict, or a path to a JSON file, in this package's format or the reference system's (Hetu-Galvatron).
        memory_budget: bytes (or ``"24GB"``) per device the automatic plan may use. Default: the GPU's memory
            less 5%; on CPU, 80% of the machine's memory divided by the processes per node.
        max_tp, max_pp, disable, schedules: limits of the automatic search (largest tensor-/pipeline-parallel
            degree; strategies to leave out, e.g. ``["zero3", "ulysses"]``; pipeline schedules to consider).
        search_batch_size: let the automatic search change the global batch size for throughput (up to
            ``max_global_batch_size``); off by default, so training matches DDP's.
        profile_cache: ``True`` for the default profile cache, a directory, or ``False`` to always profile.
        calibration, search_options: price plans with the cost model calibrated on this machine (a Calibration or
            its JSON file, see ``lightning-galvatron calibrate``); every knob of the search, a dict of the fields of
            :class:`~lightning_galvatron.search.options.SearchOptions` (or one; the arguments above win over it).
        trials: measured selection with ``plan="auto"`` (README): ``True`` (default, 20 s), ``False`` (the search's
            plan), a budget in seconds or a dict of :class:`~lightning_galvatron.selection.TrialSettings` fields.
        save_plan: write the plan (and, when searched, the profile) next to the logger's files.
        layers: dotted path(s) of the container(s) holding the Transformer blocks, relative to the
            LightningModule (e.g. ``"model.blocks"``); detected when omitted.
        global_batch_size: samples per optimizer step. Default: the plan's, else what DDP would train
            (the DataLoader's ``batch_size`` x number of devices).
        broadcast_initial_weights: start every rank from rank 0's weights, as DDP does.
        vocab_parallel_loss: with vocabulary parallelism (vocab ``tp`` > 1), keep the logits split by vocabulary
            and compute ``F.cross_entropy`` on the shards (less memory and communication). Only for steps that
            pass the logits straight to ``F.cross_entropy``; by default the logits are gathered.
        save_distributed_checkpoint: save sharded (DCP) checkpoints; ``False`` gathers one full file on rank 0.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; by default chosen from the device.
        timeout: timeout of collective operations.
        watchdog: end the job, naming the ranks at fault, when a rank makes no progress (a stopped process, a
            data loader that never returns): ``True`` (default: 5 minutes in setup, then 10x the longest training
            step but at least a minute), ``False``, or a dict of
            :class:`~lightning_galvatron.runtime.watchdog.WatchdogSettings` fields, e.g. ``{"setup_timeout_s": 600}``.
        compile: ``torch.compile`` each block's forward: ``True``, or a dict of ``torch.compile`` arguments (e.g.
            ``{"mode": "max-autotune"}``); static shapes unless ``dynamic`` is given (see
            :mod:`lightning_galvatron.runtime.compile`). Pass the model itself uncompiled.
        monitor: log the plan and its predicted time and memory as hyperparameters, and measured step time,
            samples/s and peak memory as metrics (:class:`~lightning_galvatron.strategy.monitor.GalvatronMonitor`).
        replan: with ``plan="auto"``, move training in memory to the selection's runner-up when the plan trains
            measurably slower than the runner-up measured, and keep it if it trains faster
            (:mod:`lightning_galvatron.strategy.replan`).

    Every argument is checked here, before any process is launched; errors name the argument.
    """

    strategy_name = "galvatron"

    def __init__(
        self,
        plan: ParallelPlan | Mapping[str, Any] | str | os.PathLike = "auto",
        layers: str | Sequence[str] | None = None,
        global_batch_size: int | None = None,
        memory_budget: int | str | None = None,
        max_tp: int | None = None,
        max_pp: int | None = None,
        disable: Sequence[str] = (),
        schedules: Sequence[str] | None = None,
        search_batch_size: bool = False,
        max_global_batch_size: int | None = None,
        profile_cache: bool | str | os.PathLike = True,
        calibration: Any = None,
        trials: bool | float | Mapping[str, Any] | TrialSettings = True,
        save_plan: bool = True,
        broadcast_initial_weights: bool = True,
        vocab_parallel_loss: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        watchdog: bool | Mapping[str, float] | WatchdogSettings = True,
        compile: bool | Mapping[str, Any] = False,
        monitor: bool = True,
        search_options: Mapping[str, Any] | None = None,
        replan: bool = True,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        with reported_by_rank_zero(rank_zero_only.rank):  # under torchrun every process makes the strategy
            check_strategy_arguments(plan, layers, global_batch_size)
            knobs = dict(
                max_tp=max_tp,
                max_pp=max_pp,
                disable=disable,
                schedules=schedules,
                calibration=calibration,
                search_batch_size=search_batch_size,
                max_global_batch_size=max_global_batch_size,
            )
            self._search = SearchSettings.of(memory_budget, profile_cache, search_options, **knobs)
            self._watchdog = WatchdogSettings.of(watchdog)
            self._compile = compile_options(compile)
            self._trials, self.selection = TrialSettings.of(trials), None  # selection: what the trials decided
            self._replan, self.replanning = check_replan(replan), None  # replanning: what it did, while fitting
        self._monitor: RankMonitor | None = None
        self._add_monitor = monitor
        self._plan_source = plan
        self._save_plan = save_plan
        self._layers = layers
        self._global_batch_size = global_batch_size
        self._broadcast_initial_weights = broadcast_initial_weights
        self._vocab_parallel_loss = vocab_parallel_loss
        self.plan: ParallelPlan | None = None
        self.prediction: Prediction | None = None  # the plan that runs and its predicted time and memory
        self.plan_files: list[Path] = []  # written to the logger's directory (save_plan)
        self.structure: ModelStructure | None = None
        self._meshes: MeshCache | None = None
        self._parallelised: torch.nn.Module | None = None  # the model the plan was applied to
        self._applied: AppliedPlan | None = None
        self._step_hooks: list[Any] = []  # count_optimizer_steps' (re-planning moves them to the new plan)
        self.data_shards: DataShards = None  # type: ignore[assignment]  # what loaders read: made with the plan in setup

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``strategy="galvatron"``; the Trainer then checks the precision with our message before Lightning's."""
        # Absent, or the factory registered while a module of this package was importing Lightning (_registry).
        if dict.get(strategy_registry, cls.strategy_name, {}).get("strategy") is not cls:
            strategy_registry.register(cls.strategy_name, cls, description=_DESCRIPTION, override=True)
        check_precision_first(_AcceleratorConnector, cls)

    # ------------------------------------------------------------------ launch and environment
    @override
    def _configure_launcher(self) -> None:
        """Before any worker starts: what depends on the devices (precision, the plan's world size, the budget)."""
        assert self.parallel_devices is not None
        device = self.parallel_devices[0]
        with reported_by_rank_zero(rank_zero_only.rank):
            self.precision_plugin = precision_plugin_for(precision_flag(self.precision_plugin), device.type)
            if self._plan_source != "auto":
                load_given_plan(self._plan_source, self.num_nodes * len(self.parallel_devices), self._global_batch_size)
            if self._search.memory_budget_bytes is not None:
                check_memory_budget(self._search.memory_budget_bytes, device, len(self.parallel_devices))
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        initialised_here = not dist.is_initialized()
        self._setup_distributed()
        if initialised_here:
            atexit.register(destroy_process_group)
        self._meshes = MeshCache.shared(self.root_device.type)
        self._monitor = RankMonitor.connect(self.global_rank, self.world_size, self._watchdog)

    # ------------------------------------------------------------------ setup: resolve and apply the plan
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._add_monitor and not any(isinstance(c, GalvatronMonitor) for c in trainer.callbacks):
            trainer.callbacks.insert(0, GalvatronMonitor())  # first: its step ends before other callbacks' work
        if self._parallelised is not self.model:  # validate/test after fit reuse the parallel model, on its device
            with metric_states_kept(self.lightning_module), configured_optimizers_in_place(self, trainer):
                self._parallelise(trainer)  # places the model on the device too (see model_to_device)
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            assert self._applied is not None
            self._step_hooks = count_optimizer_steps(self._applied, self.optimizers)
            if self._runner is not None:  # never with manual optimization (refused in _parallelise)
                trainer.fit_loop._skip_backward = True  # the runner does zero_grad and backward itself
        self.data_shards = DataShards(self.plan, self.global_rank, self._meshes, self.root_device)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        """The plan's application placed the model (``preparation.place_on_device``); moving it again would drop its
        gradient hooks."""

    def _parallelise(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self._meshes is not None
        module = self.lightning_module
        started = time.perf_counter()
        self.structure = find_structure(module, self._layers, self._plan_source)  # auto: found or the whole
        self._tp_plans = block_plans(self.structure, _STEP_OF[trainer.state.fn], trainer)  # guesses proven first
        self._progress("setup: resolving the plan")
        planning = self._planning_context(trainer, self.structure)
        self.plan, self.prediction = self._resolve_plan(planning)
        manual = trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization
        if manual and (problem := manual_optimization_problem(self.plan)):  # before a pipeline's trace runs the step
            raise PlanError(problem)
        rank_zero_info(setup_report(self.prediction, self.structure.block_names))
        outside = self._trace_outside_layers(trainer) if self.plan.pp > 1 else None
        self._progress("setup: applying the plan")
        if self.plan.pp > 1 and not self._save_distributed_checkpoint:
            raise PlanError(
                f"save_distributed_checkpoint=False gathers the model on rank 0, which holds only pipeline stage 0 of "
                f"this pp={self.plan.pp} plan: use sharded checkpoints (the default; `lightning-galvatron consolidate` "
                "makes one file of them) or a plan with pp=1"
            )
        if self._save_plan:  # collective (Lightning broadcasts the log directory)
            self.plan_files = save_plan_files(
                output_dir(trainer), self.plan, self.prediction.profile, self.global_rank == 0
            )

        self.model = self.precision_plugin.convert_module(self.model)
        replan = self._replan and self._plan_source == "auto"  # started before any plan is applied
        self.replanning = Replanning.start(self, planning, outside) if replan else None
        self._applied = self._apply_plan(outside, broadcast_initial_weights=self._broadcast_initial_weights)
        self._parallelised = self.model
        sync_metrics_over_data_shards(module, self.plan)  # torchmetrics: one state per data shard, as under DDP
        rank_zero_info(f"Galvatron: setup took {time.perf_counter() - started:.2f} s")
        self._use_applied()

    def _apply_plan(self, outside: OutsideLayers | None, **options: Any) -> AppliedPlan:
        """The runtime applies ``self.plan`` to the model (in setup; again where re-planning moves training)."""
        with self.replanning.blueprint.tracking(self.model) if self.replanning is not None else nullcontext():
            return prepare(
                self.model,
                self.structure,
                self.plan,
                self._meshes,
                precision_flag(self.precision_plugin),
                self.root_device,
                tp_plans=self._tp_plans,
                entry_methods=overridden_step_methods(self.lightning_module),
                parallel_loss=self._uses_parallel_loss,
                outside_layers=outside,
                compile_options=self._compile,
                **options,
            )

    @property
    def applied(self) -> AppliedPlan | None:
        """The plan as the runtime applied it to the model (``None`` before ``setup``)."""
        return self._applied

    def release_plan(self) -> None:
        """Re-planning: remove the applied plan's gradient hooks and optimizer-step counters, before the model is
        restored as it was before any plan (:meth:`~lightning_galvatron.strategy.replan.Replanning.switch`)."""
        assert self._applied is not None
        self._applied.gradients.remove()
        for handle in self._step_hooks:
            handle.remove()

    def reapply_plan(self, plan: ParallelPlan, outside: OutsideLayers | None) -> AppliedPlan:
        """Re-planning: apply ``plan`` to the restored model in place of the released one (placed, not broadcast:
        the whole training state is loaded into the new parameters next)."""
        self.structure = find_structure(self.lightning_module, self._layers, self._plan_source)
        self.plan = plan
        self._applied = self._apply_plan(outside, broadcast_initial_weights=False, place=place_restored)
        self._use_applied()
        self._step_hooks = count_optimizer_steps(self._applied, self.optimizers)
        return self._applied

    def _use_applied(self) -> None:
        assert self._applied is not None
        self.precision_plugin.norm_scope = NormScope.of(self._applied)  # clipping over this plan's meshes and stages

    def _trace_outside_layers(self, trainer: pl.Trainer) -> OutsideLayers:
        assert self.structure is not None
        self._progress("setup: tracing the step for the pipeline")
        return traced_outside_layers(self.lightning_module, self.structure, _STEP_OF[trainer.state.fn], trainer)

    def _planning_context(self, trainer: pl.Trainer, structure: ModelStructure) -> PlanningContext:
        """What planning needs from the strategy, handed over instead of the strategy itself."""
        module = self.lightning_module
        assert self._meshes is not None
        return PlanningContext(
            module=module,
            trainer=trainer,
            structure=structure,
            tp_plans=self._tp_plans,
            layers=self._layers,
            meshes=self._meshes,
            precision_plugin=self.precision_plugin,
            device=self.root_device,
            world_size=self.world_size,
            devices_per_node=self.num_processes,
            global_rank=self.global_rank,
            search=self._search,
            trials=self._trials,
            optimizers=list(self.optimizers) or configured_optimizers(module),  # in place while fitting
            global_batch_size=self._global_batch_size,
            vocab_parallel_loss=self._vocab_parallel_loss,
            sharded_checkpoints=self._save_distributed_checkpoint,
            trace_outside_layers=lambda: self._trace_outside_layers(trainer),
            progress=self._progress,
        )

    def _resolve_plan(self, planning: PlanningContext) -> tuple[ParallelPlan, Prediction]:
        """The plan -- given, or with ``plan="auto"`` profiled, searched and tried (:func:`.resolve_automatic_plan`),
        the same everywhere -- and what the cost model predicts for it (a given plan: with a cached profile, if any)."""
        if self._plan_source == "auto":
            plan, prediction, self.selection = resolve_automatic_plan(planning)
            return plan, prediction
        plan = load_given_plan(self._plan_source, self.world_size, self._global_batch_size)
        planning.check(plan)  # before the plan is priced, printed or applied
        loader = first_dataloader(planning.trainer)
        name, module, per_device = plan_source_name(self._plan_source), planning.module, loader_batch_size(loader)
        arguments = planning.cost_model_arguments()
        return plan, price_given_plan(plan, name, module, planning.structure, loader, per_device, **arguments)

    # ------------------------------------------------------------------ data: batch semantics
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        stage = self.lightning_module.trainer.state.stage
        return sampler_kwargs(self.plan, self.global_rank, self.world_size, stage)  # DDP's until there is a plan

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.data_shards.process_dataloader(dataloader, self.lightning_module.trainer.state.stage)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self.replanning is not None:  # loaders made for an earlier plan: the samples regrouped
            batch = self.replanning.regroup(batch, self.lightning_module.trainer.state.stage)
        self.data_shards.check_first_batch(batch, self.lightning_module.trainer.state.stage, dataloader_idx)
        return super().batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------ steps
    @property
    def _uses_parallel_loss(self) -> bool:
        return self._vocab_parallel_loss and self.plan is not None and self.plan.vocab.tp > 1

    def _step_context(self) -> AbstractContextManager:
        return parallel_cross_entropy() if self._uses_parallel_loss else nullcontext()

    @property
    def _runner(self) -> PipelineRunner | None:
        return self._applied.runner if self._applied is not None else None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._monitor is not None:
            self._monitor.step_started(self.lightning_module.trainer.global_step)
        if self._runner is None:
            with self._step_context():
                return super().training_step(*step_args_for_token_means(args, self._applied), **kwargs)
        return self._run_micro_batches("training_step", self.precision_plugin.train_step_context, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._monitor is not None:
            self._monitor.evaluation_step("validation", batch_index(args, kwargs))
        if self._runner is None:
            with self._step_context():
                return super().validation_step(*step_args_for_token_means(args, self._applied), **kwargs)
        return self._run_micro_batches("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    @shard_batch_step  # DDP's samples on every rank: the step runs on the data shard's (see DataShards)
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._monitor is not None:
            self._monitor.evaluation_step("test", batch_index(args, kwargs))
        if self._runner is None:
            with self._step_context():
                return super().test_step(*step_args_for_token_means(args, self._applied), **kwargs)
        return self._run_micro_batches("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    @shard_batch_step
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._monitor is not None:
            self._monitor.evaluation_step("predict", batch_index(args, kwargs))
        if self._runner is None:
            with self._step_context():
                return super().predict_step(*args, **kwargs)
        return self._run_micro_batches("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _run_micro_batches(
        self, hook: str, precision_context: Callable[[], AbstractContextManager], args: tuple, kwargs: dict
    ) -> Any:
        assert self._applied is not None
        return run_micro_batches(
            self._applied,
            self.lightning_module,
            hook,
            args,
            kwargs,
            optimizers=self.optimizers,
            device=self.root_device,
            precision_context=precision_context,
            loss_context=self._step_context,
        )

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator:
        """Lightning accumulates gradients (``accumulate_grad_batches``): the ddp layers sum theirs once, at the
        window's last backward, as ``DistributedDataParallel.no_sync`` does."""
        with self._applied.gradients.deferred() if self._applied is not None else nullcontext():
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # Each data shard returns the mean over its own samples; gradients are summed over dp groups,
        # so the shard loss is scaled to its share of the global-batch mean.
        num_shards, _ = input_shard(self._require_plan(), self.global_rank)
        with self._step_context():  # loss_parallel's backward rules apply in backward too
            return super().backward(closure_loss / num_shards, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)  # runs the step (the closure) in automatic optimization
        if self._monitor is not None:
            self._monitor.step_finished(self.lightning_module.trainer.global_step)
        return output

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.plan is not None:  # hf_models: what `lightning-galvatron consolidate --hf` rebuilds
            checkpoint["galvatron"] = {"plan": self.plan.to_dict(), "hf_models": hf_models(self.lightning_module)}
        self._progress(f"saving the checkpoint {filepath}")
        if self._save_distributed_checkpoint and storage_options is None:  # staged, renamed into place when complete
            save_sharded(whole_strided_tensors(checkpoint), self.broadcast(filepath), self.global_rank, self.barrier)
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        self._progress(f"saved the checkpoint {filepath}")

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # renamed away first: a deletion killed midway leaves no half checkpoint
            remove_checkpoint(filepath)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Saved before the first step, an optimizer stays without states (see ``without_created_states``)."""
        unstepped = not optimizer.state
        state = super().optimizer_state(optimizer)
        return without_created_states(optimizer, state) if unstepped else state

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning's loader needs a DTensor parameter (a plan of plain DDP blocks has none) and restores the
        # optimizer's hyper-parameters only where the saving rank held the same parameters; ours loads any plan.
        assert self.model is not None and self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))  # every rank loads what rank 0 was given
        self._progress(f"loading the checkpoint {path}")
        loaded = load_checkpoint(
            path, self.model, self.optimizers, strict=self.lightning_module.strict_loading, weights_only=weights_only
        )
        self._progress(f"loaded the checkpoint {path}")
        return loaded

    # ------------------------------------------------------------------ failures and the end
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Every rank calls this when its run fails: one rank prints the error (or names the rank that died)."""
        super().on_exception(exception)
        monitor, self._monitor = self._monitor, None
        if monitor is None:  # one process, or no side channel: rank 0 reports
            if self.global_rank != 0:
                leave_to_reporting_rank(exception)
            return
        death = monitor.failure_report(exception)  # a rank died: the others' errors are only its echo
        first = monitor.claim_first_failure()
        if death is None and not first:  # likely an echo ("connection closed"): say of which rank's error
            note_cause(exception, monitor.failed_elsewhere())
        monitor.stop(failure=exception)
        if death is not None:
            if first:
                print(death, file=sys.stderr, flush=True)
            leave_to_reporting_rank(exception)
        elif not first:
            leave_to_reporting_rank(exception)

    @override
    def teardown(self) -> None:
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        super().teardown()

    # ------------------------------------------------------------------ helpers
    def _progress(self, where: str) -> None:
        if self._monitor is not None:
            self._monitor.mark(where)

    def _require_plan(self) -> ParallelPlan:
        if self.plan is None:
            raise RuntimeError("the Galvatron plan is resolved in setup(); it is not available yet")
        return self.plan


GalvatronStrategy.register_strategies(StrategyRegistry)  # also called by _registry once Lightning is imported
