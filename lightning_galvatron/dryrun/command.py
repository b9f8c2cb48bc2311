"""The ``dry-run`` subcommand of ``lightning-galvatron`` (parser arguments and what runs)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from lightning_galvatron.cli import _byte_size, _json_object, add_search_options
    from lightning_galvatron.dryrun import PHASES

    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-config", help="a Hugging Face config.json: AutoModelForCausalLM with a next-token loss (nothing is downloaded)")
    model.add_argument("--model", help="a LightningModule class, MODULE:CLASS or module.Class (its own steps and optimizer run)")
    p.add_argument("--model-args", type=_json_object, default={}, help="with --model: its init arguments as a JSON object")
    p.add_argument("--layers", nargs="+", help="dotted path(s) of the block container(s) (default: detected)")
    p.add_argument("--plan", required=True, help="plan JSON (ours or the reference system's format), or 'auto' to search one with --hardware")
    p.add_argument("--world-size", type=int, help="number of devices (default: the plan's)")
    p.add_argument("--ranks", default="sample", help="'sample' (first, middle and last rank of every stage; default), 'all', or ranks like 0,5,63")
    p.add_argument("--seq-length", type=int, help="tokens per sample (default: the config's maximum positions)")
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the plan's)")
    p.add_argument("--precision", default="bf16-mixed", help="32-true, bf16-mixed or bf16-true (default: bf16-mixed)")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="what to step (default: all)")
    p.add_argument("--hardware", help="hardware profile JSON for the cost model's prediction (and for --plan auto)")
    p.add_argument("--reference", help="profile whose measured blocks are scaled to the model (default: --hardware)")
    p.add_argument("--profile", help="instead of --hardware: a full profile of this model")
    p.add_argument("--memory-per-device", type=_byte_size, help="with --plan auto: the memory budget per device")
    add_search_options(p, note="with --plan auto: ")
    p.add_argument("--gradient-clip-val", type=float, help="clip by the global norm before the optimizer step")
    p.add_argument("--real-tensors", action="store_true", help="zero-filled CPU tensors instead of fake ones (faster; small models only)")
    p.add_argument("--no-memory", action="store_true", help="do not measure memory (faster)")
    p.add_argument("--workers", type=int, help="ranks simulated at a time (default: the CPU count)")
    p.add_argument("--events", action="store_true", help="with --json: include every rank's recorded operations")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run_dry_run(args: Any) -> int:
    import torch

    from lightning_galvatron.dryrun.models import ModelSource
    from lightning_galvatron.dryrun.run import dry_run

    torch.set_num_threads(1)  # the ranks are forked from this process
    ranks: Any = args.ranks
    if ranks not in ("sample", "all"):
        try:
            ranks = [int(r) for r in str(ranks).split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"--ranks {args.ranks!r}: expected 'sample', 'all' or comma-separated ranks") from None
    source = ModelSource.from_hf_config(args.hf_config, args.layers) if args.hf_config else ModelSource.from_class(args.model, args.model_args, args.layers)
    from lightning_galvatron.cli import search_options

    report = dry_run(
        source, args.plan, world_size=args.world_size, ranks=ranks, precision=args.precision, seq_length=args.seq_length,
        global_batch_size=args.global_batch_size, phases=args.phases, hardware=args.hardware, reference=args.reference,
        profile=args.profile, memory_per_device=args.memory_per_device, search_options=search_options(args),
        measure_memory=not args.no_memory, gradient_clip_val=args.gradient_clip_val, real_tensors=args.real_tensors,
        workers=args.workers,
    )
    print(json.dumps(report.to_dict(events=args.events), indent=2) if args.json else report.describe())
    return 0 if report.ok else 1
