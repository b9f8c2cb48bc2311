"""``lightning-galvatron profile``: the profilers as a standalone command.

Every rank runs the command: under ``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``)
it joins the process group the launcher describes; with ``--devices N`` Lightning's own launcher
starts the other processes, as ``Trainer(devices=N)`` would. The model and datamodule are built
from their classes (or a LightningCLI YAML), one training batch is drawn, and
:func:`lightning_galvatron.profiler.profile` measures; rank 0 writes the profile file and prints
what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def run_profile(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler import ProfileCache, profile
    from lightning_galvatron.profiler.model import _PrecisionConfig

    model_cls, model_args, data_cls, data_args, precision = _resolve_inputs(args)
    _PrecisionConfig.of(precision)  # refuse an unsupported precision before launching anything
    initialised_here = _join_process_group(args)
    try:
        started = time.perf_counter()
        module = model_cls(**model_args)
        if hasattr(module, "configure_model"):
            module.configure_model()
        structure = find_blocks(module, args.layers)
        batch = _example_batch(data_cls(**data_args))
        cache = None if args.no_cache else ProfileCache(args.cache_dir)
        result = profile(
            module, structure, batch, precision=precision, cache=cache, batch_sizes=args.batch_sizes, hardware_budget_s=args.budget
        )
        if dist.get_rank() == 0:
            result.save(args.output)
            print(_summary(result, args.output, precision, dist.get_world_size(), time.perf_counter() - started))
        dist.barrier()
    finally:
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    """``lightning-galvatron calibrate``: :func:`~lightning_galvatron.calibrate.calibrate` on every rank; rank 0
    writes the calibration."""
    import torch.distributed as dist

    from lightning_galvatron.calibrate import calibrate

    model_cls, model_args, data_cls, data_args, precision = _resolve_inputs(args)
    datamodule = data_cls(**data_args)
    world = int(os.environ.get("WORLD_SIZE") or args.devices or 0)
    hparams = getattr(datamodule, "hparams", None)
    per_device = getattr(datamodule, "batch_size", None) or getattr(hparams, "batch_size", None)
    batch = args.global_batch_size or (per_device or 0) * world
    if not batch:
        raise ValueError("say how many samples a step trains on: --global-batch-size (no batch_size in the datamodule)")
    started = time.perf_counter()
    calibration = calibrate(
        args.profile, lambda: model_cls(**model_args), datamodule, global_batch_size=batch, layers=args.layers,
        warmup_steps=args.warmup_steps, timed_steps=args.timed_steps, precision=precision,
        accelerator=args.accelerator, devices=args.devices,
    )
    if dist.get_rank() == 0:
        calibration.save(args.output)
        print(f"Calibrated in {time.perf_counter() - started:.1f} s: {calibration.describe()}")
        print(f"Wrote {args.output} (for GalvatronStrategy(calibration=...) and `search --calibration`)")
    return 0


# ---------------------------------------------------------------------------------------------- inputs
def _resolve_inputs(args: argparse.Namespace) -> tuple[type, dict, type, dict, str]:
    """Classes, init arguments and precision from ``--config`` and the command line (which wins)."""
    config: dict[str, Any] = {}
    if args.config:
        import yaml

        try:
            config = yaml.safe_load(Path(args.config).read_text()) or {}
        except FileNotFoundError:
            raise ValueError(f"config file {args.config!r} does not exist") from None
        if not isinstance(config, dict):
            raise ValueError(f"{args.config}: expected a LightningCLI YAML mapping with model/data/trainer sections")
    model_cls, model_args = _section(config.get("model"), args.model, args.model_args, "model", "--model")
    data_cls, data_args = _section(config.get("data"), args.datamodule, args.datamodule_args, "data", "--datamodule")
    precision = args.precision or str((config.get("trainer") or {}).get("precision") or "32-true")
    return model_cls, model_args, data_cls, data_args, precision


def _section(section: Any, class_option: str | None, overrides: dict, name: str, flag: str) -> tuple[type, dict]:
    section = dict(section or {})
    if "class_path" in section:
        path = class_option or section["class_path"]
        init_args = dict(section.get("init_args") or {})
    else:
        path, init_args = class_option, section
    if not path:
        raise ValueError(f"say which {name} class to build: {flag} MODULE:CLASS (or a class_path in --config)")
    return load_class(path), {**init_args, **overrides}


def load_class(path: str) -> type:
    """``package.module:Class``, ``package.module.Class`` or ``path/to/file.py:Class``.

    The working directory is importable, as for ``python -m`` (a console script would not have it).
    """
    module_name, sep, class_name = path.rpartition(":")
    if not sep:
        module_name, _, class_name = path.rpartition(".")
    if not module_name or not class_name:
        raise ValueError(f"cannot read {path!r} as MODULE:CLASS")
    if module_name.endswith(".py") or os.sep in module_name:
        file = Path(module_name).resolve()
        if not file.exists():
            raise ValueError(f"{path!r}: file {file} does not exist")
        spec = importlib.util.spec_from_file_location(file.stem, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[file.stem] = module
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ValueError(f"{path!r}: cannot import {module_name!r} ({err})") from None
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ValueError(f"{path!r}: {module_name} has no {class_name!r}") from None


def _example_batch(datamodule: Any) -> Any:
    """One batch of the training DataLoader, prepared as Lightning would (``prepare_data`` on local rank 0)."""
    import torch.distributed as dist

    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    dist.barrier()
    if hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    try:
        return next(iter(datamodule.train_dataloader()))
    except StopIteration:
        raise ValueError(f"{type(datamodule).__name__}.train_dataloader() is empty: no example batch to profile with") from None


# ---------------------------------------------------------------------------------------------- processes
def _join_process_group(args: argparse.Namespace) -> bool:
    """Initialise the default process group unless one exists; return whether this function did it."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        use_cuda = torch.cuda.is_available() and args.accelerator != "cpu"
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=PROCESS_GROUP_TIMEOUT)
        return True
    if args.devices:
        from lightning.fabric import Fabric

        # Lightning's launcher re-runs this command once per extra device and sets up the process group.
        fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy="ddp")
        fabric.launch()
        return True
    raise ValueError(
        "profiling measures the communication between processes: run every rank, e.g. "
        "`torchrun --nproc-per-node 4 --no-python lightning-galvatron profile ...`, or pass --devices 4"
    )


# ---------------------------------------------------------------------------------------------- report
def _summary(result: Any, output: str, precision: str, world: int, seconds: float) -> str:
    from lightning_galvatron.search.report import text_table
    from lightning_galvatron.units import format_bytes

    model, hw = result.model, result.hardware
    lines = [f"Profiled {model.name}: {model.num_blocks} blocks of {len(model.layer_types)} type(s), {precision}, on {hw.name} in {seconds:.1f} s", ""]
    rows = [("block type", "parameters", "forward (b=1)", "per sample", "backward/forward", "activations/sample by degree", "recomputed")]
    for t in model.layer_types:
        degrees = ", ".join(f"{g}: {format_bytes(v)}" for g, v in t.activation_bytes_per_sample.values)
        rows.append((
            t.name, f"{t.parameters:,}", f"{t.forward_time(1) * 1e3:.3f} ms", f"{t.forward_time.per_sample_s * 1e3:.3f} ms",
            f"{t.backward_to_forward:.2f}", degrees, format_bytes(t.recompute_activation_bytes_per_sample),
        ))
    v = model.vocab
    lines += [text_table(rows), ""]
    lines.append(
        f"embedding/head: vocabulary {v.vocab_size}, {v.embedding_parameters:,} + {v.head_parameters:,} parameters"
        + (" (tied)" if v.tied else "")
        + f", forward {v.embedding_forward_time(1) * 1e3:.3f} + {v.head_forward_time(1) * 1e3:.3f} ms at b=1, "
        f"activations {format_bytes(v.embedding_activation_bytes_per_sample.at(1))} + {format_bytes(v.head_activation_bytes_per_sample.at(1))} per sample"
    )
    lines.append("")
    rows = [("collective", "group", "ranks/node", "latency", "bandwidth")]
    for c in hw.collectives:
        rows.append((c.kind, str(c.group_size), str(c.ranks_per_node), f"{c.latency_s * 1e6:.0f} us", f"{c.bandwidth_bytes_per_s / 1e9:.3g} GB/s"))
    lines += [text_table(rows), ""]
    memory = format_bytes(hw.device_memory_bytes) if hw.device_memory_bytes else "not budgeted (CPU)"
    lines.append(f"overlap coefficient {hw.overlap_coefficient:.2f}; device memory {memory}; fixed overhead {format_bytes(hw.memory_overhead_bytes)}")
    budget = "" if hw.device_memory_bytes else " --memory-per-device 4GB"
    lines.append(f"\nWrote {output}. Next: lightning-galvatron search {output} --world-size {world}{budget} --precision {precision}")
    return "\n".join(lines)
