"""The ``dry-run`` subcommand of ``lightning-galvatron`` (parser arguments and what runs)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from lightning_galvatron.cli.options import (
        add_json_option,
        add_memory_budget_option,
        add_model_options,
        add_precision_option,
        add_search_options,
    )
    from lightning_galvatron.dryrun import PHASES

    add_model_options(
        p,
        hf_help="a Hugging Face config.json: AutoModelForCausalLM with a next-token loss (nothing is downloaded)",
        model_help="a LightningModule class, MODULE:CLASS or module.Class (its own steps and optimizer run)",
    )
    p.add_argument(
        "--plan",
        required=True,
        help="plan JSON (ours or the reference system's format), or 'auto' to search one with --hardware",
    )
    p.add_argument("--world-size", type=int, help="number of devices (default: the plan's)")
    p.add_argument(
        "--ranks",
        default="sample",
        help="'sample' (first, middle and last rank of every stage; default), 'all', or ranks like 0,5,63",
    )
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the plan's)")
    add_precision_option(p)
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="what to step (default: all)")
    p.add_argument(
        "--hardware",
        help=(
            "hardware profile JSON (or a reference profile's name, a100) for the cost model's prediction (and for "
            "--plan auto)"
        ),
    )
    p.add_argument("--reference", help="profile whose measured blocks are scaled to the model (default: --hardware)")
    p.add_argument("--profile", help="instead of --hardware: a full profile of this model")
    add_memory_budget_option(p, "with --plan auto: the memory budget per device, e.g. 36GB")
    add_search_options(p, prefix="with --plan auto: ")
    p.add_argument("--gradient-clip-val", type=float, help="clip by the global norm before the optimizer step")
    p.add_argument(
        "--real-tensors",
        action="store_true",
        help="zero-filled CPU tensors instead of fake ones (faster; small models only)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help=(
            "cuda: each rank holds fake tensors on its own simulated GPU (cuda:local_rank) behind a simulated NCCL "
            "whose rules are checked, host synchronisations counted per step (default: cpu, as gloo runs)"
        ),
    )
    p.add_argument(
        "--devices-per-node",
        type=int,
        help="with --device cuda: GPUs per node (default: the hardware profile's, else 8)",
    )
    p.add_argument(
        "--max-host-syncs",
        type=int,
        help="with --device cuda: fail when a rank's training step synchronises the host more often than this",
    )
    p.add_argument("--no-memory", action="store_true", help="do not measure memory (faster)")
    p.add_argument("--workers", type=int, help="ranks simulated at a time (default: the CPU count)")
    p.add_argument("--events", action="store_true", help="with --json: include every rank's recorded operations")
    add_json_option(p)


def run_dry_run(args: Any) -> int:
    import torch

    from lightning_galvatron.cli.options import profile_path, search_options
    from lightning_galvatron.dryrun.models import ModelSource
    from lightning_galvatron.dryrun.run import dry_run

    torch.set_num_threads(1)  # the ranks are forked from this process
    if args.max_host_syncs is not None and args.device != "cuda":
        raise ValueError("--max-host-syncs limits the host synchronisations of a simulated GPU: add --device cuda")
    ranks: Any = args.ranks
    if ranks not in ("sample", "all"):
        try:
            ranks = [int(r) for r in str(ranks).split(",") if r.strip()]
        except ValueError:
            raise ValueError(f"--ranks {args.ranks!r}: expected 'sample', 'all' or comma-separated ranks") from None
    source = (
        ModelSource.from_hf_config(args.hf_config, args.layers)
        if args.hf_config
        else ModelSource.from_class(args.model, args.model_args, args.layers)
    )
    hardware, reference, profile = (
        profile_path(p) if p else None for p in (args.hardware, args.reference, args.profile)
    )
    precision = args.precision or _measured_precision(profile or reference or hardware)
    report = dry_run(
        source,
        args.plan,
        world_size=args.world_size,
        ranks=ranks,
        precision=precision,
        seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        phases=args.phases,
        hardware=hardware,
        reference=reference,
        profile=profile,
        memory_per_device=args.memory_budget,
        search_options=search_options(args),
        measure_memory=not args.no_memory,
        gradient_clip_val=args.gradient_clip_val,
        real_tensors=args.real_tensors,
        workers=args.workers,
        device=args.device,
        devices_per_node=args.devices_per_node or _devices_per_node(hardware or profile or reference),
    )
    limit = args.max_host_syncs
    over = {} if limit is None else {r: n for r, n in report.host_syncs_per_step().items() if n > limit}
    if args.json:
        out = report.to_dict(events=args.events)
        if limit is not None:
            out["max_host_syncs"] = {"limit": limit, "ranks_over": over, "sites": _sites(report, over)}
        print(json.dumps(out, indent=2))
    else:
        print(report.describe())
        if over:
            print(
                f"--max-host-syncs {limit}: a training step synchronises the host more often on "
                f"{len(over)} rank(s) ({', '.join(f'rank {r}: {n}' for r, n in over.items())}), at:"
            )
            print("\n".join(f"  {site}" for site in _sites(report, over)))
    return 0 if report.ok and not over else 1


def _sites(report: Any, ranks: dict[int, int]) -> list[str]:
    """Where the training steps of ``ranks`` synchronised the host, each site once (innermost line first)."""
    from lightning_galvatron.dryrun.nccl_rules import HostSync

    seen: dict[tuple[str, tuple[str, ...]], str] = {}
    for r in report.ranks:
        for s in r.host_syncs if r.rank in ranks else ():
            if s["phase"] == "train":
                sync = HostSync("train", s["what"], tuple(s["stack"]), s["via"], s["count"])
                seen.setdefault((s["what"], sync.stack), sync.describe())
    return list(seen.values())


def _devices_per_node(profile_file: str | None) -> int | None:
    """The GPUs per node of the profile's hardware (``None`` without a profile: the dry run's default)."""
    from lightning_galvatron.profiles import load_profile

    return load_profile(profile_file).hardware.devices_per_node if profile_file else None


def _measured_precision(profile_file: str | None) -> str:
    """The precision the profile was measured in, else bf16-mixed (what the cost model's prediction assumes)."""
    from lightning_galvatron.profiles import Profile

    return (Profile.load(profile_file).measured_precision if profile_file else None) or "bf16-mixed"
