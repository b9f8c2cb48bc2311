"""``lightning-galvatron profile``: the profilers as a standalone command.

Every rank runs the command: under ``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``)
it joins the process group the launcher describes; with ``--devices N`` Lightning's own launcher
starts the other processes, as ``Trainer(devices=N)`` would. The model and datamodule are built
from their classes, or from a LightningCLI YAML read by ``LightningCLI`` itself (so a config that
trains is a config that profiles: class paths, nested classes, checked init arguments), one
training batch is drawn, and :func:`lightning_galvatron.profiler.profile` measures; rank 0 writes
the profile file and prints what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_galvatron.model.sources import load_class

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def run_profile(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lightning_galvatron.model.discovery import find_blocks
    from lightning_galvatron.profiler import ProfileCache, profile
    from lightning_galvatron.profiler.model import _PrecisionConfig

    inputs = _resolve_inputs(args)
    precision = inputs.precision
    _PrecisionConfig.of(precision)  # refuse an unsupported precision before launching anything
    initialised_here = _join_process_group(args)
    try:
        started = time.perf_counter()
        module, datamodule = inputs.build()
        if hasattr(module, "configure_model"):
            module.configure_model()
        structure = find_blocks(module, args.layers)
        batch = _example_batch(datamodule)
        cache = None if args.no_cache else ProfileCache(args.cache_dir)
        result = profile(
            module,
            structure,
            batch,
            precision=precision,
            cache=cache,
            batch_sizes=args.batch_sizes,
            hardware_budget_s=args.budget,
        )
        if dist.get_rank() == 0:
            result.save(args.output)
            seconds = time.perf_counter() - started
            if getattr(args, "json", False):
                print(json.dumps({"output": args.output, "profile": result.to_dict(), "seconds": seconds}, indent=2))
            else:
                print(_summary(result, args.output, precision, dist.get_world_size(), seconds))
        dist.barrier()
    finally:
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- inputs
@dataclass
class _Inputs:
    """What to profile: ``build()`` makes the model and datamodule (after the process group exists)."""

    build: Callable[[], tuple[Any, Any]]
    precision: str


def _resolve_inputs(args: argparse.Namespace) -> _Inputs:
    """The model, datamodule and precision from ``--config`` (read by LightningCLI) and the command line (which
    wins)."""
    if args.config:
        return _from_lightning_config(args)
    model_cls, data_cls = (
        _class_of(path, flag) for path, flag in ((args.model, "--model"), (args.datamodule, "--datamodule"))
    )
    return _Inputs(
        lambda: (model_cls(**args.model_args), data_cls(**args.datamodule_args)), args.precision or "32-true"
    )


def _class_of(path: str | None, flag: str) -> type:
    if not path:
        raise ValueError(f"say which class to build: {flag} MODULE:CLASS (or a LightningCLI YAML with --config)")
    return load_class(path)


def _from_lightning_config(args: argparse.Namespace) -> _Inputs:
    """A LightningCLI YAML read by ``LightningCLI`` itself, without building its Trainer."""
    try:
        from lightning.pytorch.cli import LightningCLI
    except ImportError as err:  # jsonargparse is missing
        raise ValueError(f"--config is read by LightningCLI, which needs jsonargparse[signatures] ({err})") from None
    if not Path(args.config).is_file():
        raise ValueError(f"config file {args.config!r} does not exist")

    class ConfigReader(LightningCLI):
        def instantiate_classes(self) -> None:  # LightningCLI would build the Trainer too; we build on demand
            pass

    model_cls = load_class(args.model) if args.model else None
    data_cls = load_class(args.datamodule) if args.datamodule else None
    argv = ["--config", args.config]
    argv += [f"--model.{key}={json.dumps(value)}" for key, value in args.model_args.items()]
    argv += [f"--data.{key}={json.dumps(value)}" for key, value in args.datamodule_args.items()]
    try:
        with warnings.catch_warnings():  # it warns that sys.argv is ours, not the config's: on purpose
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            reader = ConfigReader(
                model_cls,
                data_cls,
                subclass_mode_model=model_cls is None,
                subclass_mode_data=data_cls is None,
                args=argv,
                run=False,
                save_config_callback=None,
                auto_configure_optimizers=False,
                parser_kwargs={"exit_on_error": False},
            )
    except argparse.ArgumentError as err:
        hint = (
            ""
            if model_cls and data_cls
            else " (name the classes with --model/--datamodule when the YAML has no class_path)"
        )
        raise ValueError(f"{args.config}: {err}{hint}") from None
    precision = args.precision or str(reader.config.get("trainer", {}).get("precision") or "32-true")

    def build() -> tuple[Any, Any]:
        built = reader.parser.instantiate_classes(reader.config)
        if built.get("data") is None:
            raise ValueError(f"{args.config} has no data section: pass --datamodule MODULE:CLASS")
        return built["model"], built["data"]

    return _Inputs(build, precision)


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
        raise ValueError(
            f"{type(datamodule).__name__}.train_dataloader() is empty: no example batch to profile with"
        ) from None


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
    lines = [
        f"Profiled {model.name}: {model.num_blocks} blocks of {len(model.layer_types)} type(s), {precision}, on "
        f"{hw.name} in {seconds:.1f} s",
        "",
    ]
    rows = [
        (
            "block type",
            "parameters",
            "forward (b=1)",
            "per sample",
            "backward/forward",
            "activations/sample by degree",
            "recomputed",
        )
    ]
    for t in model.layer_types:
        degrees = ", ".join(f"{g}: {format_bytes(v)}" for g, v in t.activation_bytes_per_sample.values)
        rows.append(
            (
                t.name,
                f"{t.parameters:,}",
                f"{t.forward_time(1) * 1e3:.3f} ms",
                f"{t.forward_time.per_sample_s * 1e3:.3f} ms",
                f"{t.backward_to_forward:.2f}",
                degrees,
                format_bytes(t.recompute_activation_bytes_per_sample),
            )
        )
    v = model.vocab
    lines += [text_table(rows), ""]
    lines.append(
        f"embedding/head: vocabulary {v.vocab_size}, {v.embedding_parameters:,} + {v.head_parameters:,} parameters"
        + (" (tied)" if v.tied else "")
        + f", forward {v.embedding_forward_time(1) * 1e3:.3f} + {v.head_forward_time(1) * 1e3:.3f} ms at b=1, "
        f"activations {format_bytes(v.embedding_activation_bytes_per_sample.at(1))} + "
        f"{format_bytes(v.head_activation_bytes_per_sample.at(1))} per sample"
    )
    lines.append("")
    rows = [("collective", "group", "ranks/node", "latency", "bandwidth")]
    for c in hw.collectives:
        rows.append(
            (
                c.kind,
                str(c.group_size),
                str(c.ranks_per_node),
                f"{c.latency_s * 1e6:.0f} us",
                f"{c.bandwidth_bytes_per_s / 1e9:.3g} GB/s",
            )
        )
    lines += [text_table(rows), ""]
    memory = format_bytes(hw.device_memory_bytes) if hw.device_memory_bytes else "not budgeted (CPU)"
    lines.append(
        f"overlap coefficient {hw.overlap_coefficient:.2f}; device memory {memory}; fixed overhead "
        f"{format_bytes(hw.memory_overhead_bytes)}"
    )
    budget = "" if hw.device_memory_bytes else " --memory-budget 4GB"
    lines.append(f"\nWrote {output}. Next: lightning-galvatron search {output} --world-size {world}{budget}")
    return "\n".join(lines)
