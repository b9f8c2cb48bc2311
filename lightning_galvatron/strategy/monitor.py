"""What ran next to what was predicted, in the user's loggers: :class:`GalvatronMonitor`.

``GalvatronStrategy`` adds this callback unless one is given or ``monitor=False``. At the start of
fitting it logs, to every logger, the plan that runs (not ``plan: auto``), its predicted step time and
peak memory, the memory budget and a summary of the profile, as hyperparameters under ``galvatron``
(``hparams.yaml`` of ``CSVLogger``/``TensorBoardLogger``; flattened to ``galvatron/plan/...`` by
loggers that flatten), and uploads the plan and profile files where a logger can take files
(:func:`log_files`). During training it logs, at each optimizer step and at the loggers' cadence:

* ``galvatron/step_time_s``: wall time from the first batch of the step to the end of the optimizer
  step (``time.perf_counter``; data loading between steps and validation are not counted), with
  ``galvatron/predicted_step_time_s``;
* ``galvatron/samples_per_s`` (the global batch over that time), with ``galvatron/predicted_samples_per_s``;
* ``galvatron/peak_memory_bytes``, the peak so far: on CUDA ``torch.cuda.max_memory_allocated`` (tensors, as
  predicted); on CPU the process's peak resident memory (which also counts the interpreter and libraries), with
  ``galvatron/predicted_peak_memory_bytes`` of this rank's pipeline stage. Loggers write rank 0's values.

It is cheap: host-side clocks and counters only, logged as CPU tensors (no copy to the device, so no
synchronisation beyond Lightning's own).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_galvatron._compat import override
from lightning_galvatron.search.report import plan_summary
from lightning_galvatron.strategy.prediction import Prediction


class GalvatronMonitor(Callback):
    """Logs the plan as hyperparameters and measured step time, throughput and peak memory next to the predictions."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._step_at_start = 0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Before Lightning logs and saves hyperparameters.
        self._started = None
        prediction: Prediction | None = getattr(trainer.strategy, "prediction", None)
        if prediction is None or not trainer.loggers:
            return
        for logger in trainer.loggers:
            logger.log_hyperparams({"galvatron": hyperparameters(prediction)})
        if trainer.is_global_zero:
            log_files(trainer.loggers, getattr(trainer.strategy, "plan_files", ()))

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None:  # the first batch of an optimizer step (of an accumulation window)
            self._started = time.perf_counter()
            self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._started is None or trainer.global_step == self._step_at_start:
            return  # still accumulating gradients
        seconds, self._started = time.perf_counter() - self._started, None
        if not trainer.loggers or not _loggers_write_now(trainer):
            return  # what Lightning would not write costs ~0.5 ms per value and step in its result collection
        prediction: Prediction | None = getattr(trainer.strategy, "prediction", None)
        metrics = {"step_time_s": seconds, "peak_memory_bytes": peak_memory_bytes(trainer.strategy.root_device)}
        if prediction is not None:
            steps = trainer.accumulate_grad_batches  # an optimizer step spans this many of the plan's steps
            if prediction.plan.global_batch_size:
                metrics["samples_per_s"] = steps * prediction.plan.global_batch_size / seconds
            if prediction.estimate is not None:
                metrics["predicted_step_time_s"] = steps * prediction.estimate.step_time_s
                metrics["predicted_samples_per_s"] = prediction.estimate.throughput_samples_per_s
                metrics["predicted_peak_memory_bytes"] = prediction.stage_peak_memory_bytes(trainer.global_rank)
        for name, value in metrics.items():
            if value is not None:  # a CPU tensor: Lightning keeps it on the CPU
                value = torch.tensor(float(value), dtype=torch.float64)
                pl_module.log(f"galvatron/{name}", value, on_step=True, on_epoch=False, batch_size=1)


def _loggers_write_now(trainer: L.Trainer) -> bool:
    """Whether Lightning writes this step's logged values to the loggers (every ``log_every_n_steps`` steps)."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def hyperparameters(prediction: Prediction) -> dict[str, Any]:
    """The plan that runs, where it came from, its prediction and the profile behind it, as nested plain data."""
    out: dict[str, Any] = {
        "plan": prediction.plan.to_dict(),
        "plan_source": prediction.source,
        "plan_summary": plan_summary(prediction.plan),
        "memory_budget_bytes": prediction.memory_budget_bytes,
    }
    estimate = prediction.estimate
    if estimate is None:
        out["predicted"] = {"missing": prediction.missing}
    else:
        out["predicted"] = {
            "step_time_s": estimate.step_time_s,
            "samples_per_s": estimate.throughput_samples_per_s,
            "peak_memory_bytes": estimate.peak_memory_bytes,
            "peak_memory_bytes_per_stage": list(estimate.peak_memory_bytes_per_stage),
            "fits": estimate.peak_memory_bytes <= prediction.memory_budget_bytes,
        }
    if prediction.profile is not None:
        model, hardware = prediction.profile.model, prediction.profile.hardware
        out["profile"] = {
            "source": prediction.profile.source,
            "note": prediction.profile_note,
            "model": model.name,
            "blocks": model.num_blocks,
            "block_types": [t.name for t in model.layer_types],
            "seq_length": model.seq_length,
            "hidden_size": model.hidden_size,
            "hardware": hardware.name,
            "devices_per_node": hardware.devices_per_node,
            "collective_fits": len(hardware.collectives),
            "overlap_coefficient": hardware.overlap_coefficient,
            "memory_overhead_bytes": hardware.memory_overhead_bytes,
        }
    return out


def log_files(loggers: Iterable[Any], paths: Iterable[Path]) -> None:
    """Upload ``paths`` with every logger that takes files, recognised by its API (no import of its package):
    LitLogger (``log_file``), MLflow (``experiment.log_artifact(run_id, path)``), Comet (``experiment.log_asset``),
    Weights & Biases (``experiment.log_artifact(path, name=, type=)``). Loggers that write
    to a directory (CSV, TensorBoard) already have them: the strategy saves them in ``trainer.log_dir``."""
    for logger in loggers:
        for path in paths:
            try:
                _log_file(logger, Path(path))
            except Exception as error:  # noqa: BLE001 - an upload that fails must not stop training
                rank_zero_warn(f"Galvatron: {type(logger).__name__} could not take {path}: {error!r}")


def _log_file(logger: Any, path: Path) -> None:
    if callable(getattr(logger, "log_file", None)):
        logger.log_file(str(path))
        return
    experiment = logger.experiment
    if getattr(logger, "run_id", None) is not None and callable(getattr(experiment, "log_artifact", None)):
        experiment.log_artifact(logger.run_id, str(path))  # MLflow's client
    elif callable(getattr(experiment, "log_asset", None)):
        experiment.log_asset(str(path))  # Comet (whose log_artifact takes an Artifact object)
    elif callable(getattr(experiment, "log_artifact", None)):
        experiment.log_artifact(str(path), name=path.stem, type="galvatron")  # a W&B run


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak memory of this process so far: CUDA tensors on a GPU, else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def save_plan_files(directory: Path, plan: Any, profile: Any, write: bool) -> list[Path]:
    """``galvatron_plan.json`` and, when a profile priced or chose the plan, ``galvatron_profile.json`` in
    ``directory`` (written where ``write``, i.e. on rank 0); their paths on every rank."""
    files = [directory / "galvatron_plan.json", directory / "galvatron_profile.json"][: 1 if profile is None else 2]
    if write:
        plan.save(files[0])
        if profile is not None:
            profile.save(files[1])
    return files


def output_dir(trainer: L.Trainer) -> Path:
    """Where the plan and profile are saved: the logger's directory. Call on every rank (it broadcasts)."""
    path = Path(trainer.log_dir or trainer.default_root_dir)
    if trainer.global_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    return path
