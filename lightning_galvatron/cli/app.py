"""``lightning-galvatron``: offline tools around the plan search.

Subcommands:

* ``profile --model MODULE:CLASS --datamodule MODULE:CLASS -o profile.json`` -- measure a model and
  the cluster it runs on (under ``torchrun``, or ``--devices N`` with Lightning's launcher);
* ``search PROFILE --world-size N --memory-budget 36GB`` -- the best plan for any cluster;
* ``calibrate PROFILE --model MODULE:CLASS --datamodule MODULE:CLASS -o calibration.json`` -- fit the cost
  model to short runs of probe plans on this machine (under ``torchrun``, or ``--devices N``);
* ``evaluate PROFILE --plan PLAN`` -- predicted time and memory of a plan (ours or the reference
  system's format): a what-if tool;
* ``import-galvatron DIR --hidden-size H --seq-length S -o profile.json`` -- convert the reference
  system's profile files;
* ``estimate --hf-config CONFIG.json --world-size N --memory-budget 80GB --hardware a100`` -- will
  a model fit a cluster you do not have, and how (an analytic profile scaled from measured blocks);
* ``dry-run --hf-config CONFIG.json --world-size N --plan PLAN`` -- apply and step a plan as sampled (or all)
  ranks of the cluster, on fake tensors: memory, groups and the collective-order proof;
* ``consolidate CKPT_DIR -o model.pt`` (or ``--hf OUT_DIR``) -- a sharded checkpoint as one file, or as a
  Hugging Face model directory.

Conventions, the same for every subcommand: exit status 0 on success, 1 when a well-formed question is answered
"no" (no plan fits, the plan does not fit, a dry-run rank failed) or the work failed at run time, 2 for a usage
error (bad arguments or input files); with ``--json`` everything printed on stdout, errors included, is one JSON
object. Option names are those of ``GalvatronStrategy``'s arguments (``--memory-budget`` for ``memory_budget``);
memory sizes need their unit (``36GB``, ``40GiB``); defaults come from the profile where it says (its device
memory, the precision it was measured in).

Adding a subcommand: write ``_cmd_<name>(args) -> int`` and a ``_register_<name>(subparsers)``
decorated with :func:`subcommand` that adds its parser and sets ``func=_cmd_<name>``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_galvatron.cli.options import (
    add_cost_options,
    add_json_option,
    add_memory_budget_option,
    add_model_options,
    add_search_options,
    json_object,
    precision_of,
    profile_path,
    search_options,
)
from lightning_galvatron.search.report import describe_estimate, describe_search
from lightning_galvatron.units import format_bytes

EXIT_OK, EXIT_NO, EXIT_USAGE = 0, 1, 2

_REGISTRARS: list[Callable[[Any], None]] = []


def subcommand(register: Callable[[Any], None]) -> Callable[[Any], None]:
    """Mark a function ``register(subparsers)`` that adds one subcommand."""
    _REGISTRARS.append(register)
    return register


class UsageError(Exception):
    """argparse's complaint about the command line, raised (not printed) so that ``--json`` can print it as JSON."""

    def __init__(self, message: str, usage: str, prog: str) -> None:
        super().__init__(message)
        self.usage, self.prog = usage, prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit 2 itself
        raise UsageError(message, self.format_usage(), self.prog)


def build_parser() -> argparse.ArgumentParser:
    from lightning_galvatron import __version__

    parser = _Parser(
        prog="lightning-galvatron",
        description="Automatic hybrid parallelism for PyTorch Lightning: offline plan search and what-if tools. "
        "Exit status: 0 success, 1 the answer is no (no plan fits) or a run-time failure, 2 a usage error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in _REGISTRARS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; return its exit status (see the module's conventions)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        command = err.prog.split(" ", 1)[1] if " " in err.prog else None
        return _fail(EXIT_USAGE, "usage", str(err), command, as_json, usage=err.usage)
    except SystemExit as done:  # --help, --version
        return done.code if isinstance(done.code, int) else EXIT_OK
    try:
        return int(args.func(args) or 0)
    except Exception as err:  # noqa: BLE001 - every failure becomes a message and an exit status
        from lightning_galvatron.errors import debug_enabled
        from lightning_galvatron.search.engine import InfeasibleBudgetError, NoValidPlanError

        if debug_enabled():
            import traceback

            traceback.print_exc()
        if isinstance(err, InfeasibleBudgetError):
            extra = {
                "fits": False,
                "smallest_budget_bytes": err.smallest_budget_bytes,
                "global_batch_size": err.global_batch_size,
            }
            return _fail(EXIT_NO, "no_plan", str(err), args.command, as_json, **extra)
        if isinstance(err, NoValidPlanError):
            return _fail(EXIT_NO, "no_plan", str(err), args.command, as_json, fits=False)
        if isinstance(err, ValueError):  # our errors are ValueError subclasses saying what to change in the input
            return _fail(EXIT_USAGE, "usage", str(err), args.command, as_json)
        return _fail(EXIT_NO, "failure", f"{type(err).__name__}: {err}", args.command, as_json)


def _fail(code: int, kind: str, message: str, command: str | None, as_json: bool, usage: str = "", **extra: Any) -> int:
    """Print an error (a JSON object on stdout under ``--json``, else a line on stderr); return ``code``."""
    if as_json:
        fits = extra.pop("fits", None)
        error = {"kind": kind, "message": message, "exit_code": code, "command": command, **extra}
        print(json.dumps({"error": error} if fits is None else {"fits": fits, "error": error}, indent=2))
    else:
        print(f"{usage}lightning-galvatron{f' {command}' if command else ''}: error: {message}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------------------------------- profile
@subcommand
def _register_profile(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure a model and this cluster into a profile for `search` (run under torchrun, or with --devices)",
        description="Profile the hardware (collectives of the live process group) and the model (per block type time "
        "and activation memory), and write a profile JSON that `lightning-galvatron search` reads. Run it on every "
        "rank: `torchrun --nproc-per-node 4 --no-python lightning-galvatron profile ...`, or let Lightning launch the "
        "processes with --devices 4.",
    )
    _add_training_inputs(p)
    p.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 4], help="local batch sizes to time (default: 1 4)"
    )
    p.add_argument(
        "--budget", type=float, default=3.0, help="rough seconds for the collective measurements (default: 3)"
    )
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--profile-cache",
        "--cache-dir",
        dest="cache_dir",
        help="profile cache directory (default: $LIGHTNING_GALVATRON_CACHE or ~/.cache/lightning_galvatron/profiles)",
    )
    cache.add_argument("--no-cache", action="store_true", help="always measure, never read or write the cache")
    p.add_argument("-o", "--output", required=True, help="where rank 0 writes the profile JSON")
    add_json_option(p)
    p.set_defaults(func=_cmd_profile)


def _add_training_inputs(p: argparse.ArgumentParser) -> None:
    """What a command that trains or measures the model on this machine builds it from, and on how many processes."""
    p.add_argument("--model", help="the LightningModule class, MODULE:CLASS or path/to/file.py:CLASS")
    p.add_argument("--model-args", type=json_object, default={}, help="its init arguments as a JSON object")
    p.add_argument("--datamodule", help="the LightningDataModule class giving the training batches, MODULE:CLASS")
    p.add_argument("--datamodule-args", type=json_object, default={}, help="its init arguments as a JSON object")
    p.add_argument(
        "--config",
        help="a LightningCLI YAML (read as LightningCLI reads it): its model, data and trainer.precision are used; "
        "--model/--datamodule name the classes when the YAML has no class_path; command-line arguments win",
    )
    p.add_argument("--layers", nargs="+", help="dotted path(s) of the block container(s) (default: detected)")
    p.add_argument("--precision", help="32-true, bf16-mixed or bf16-true (default: the config's, else 32-true)")
    p.add_argument(
        "--devices", type=int, help="without torchrun: processes to launch on this machine (Lightning's launcher)"
    )
    p.add_argument("--accelerator", default="auto", help="with --devices: cpu, cuda or auto (default: auto)")


def _cmd_profile(args: argparse.Namespace) -> int:
    from lightning_galvatron.cli.profile import run_profile

    return run_profile(args)


# ---------------------------------------------------------------------------------------------- calibrate
@subcommand
def _register_calibrate(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit the cost model to short runs of probe plans on this machine (under torchrun, or with --devices)",
        description="Train a few probe plans briefly (every kind of block strategy, two micro-batch sizes, a "
        "pipeline), time them with the runtime profiler and fit the cost model's calibration; rank 0 writes it for "
        "GalvatronStrategy(calibration=...) and `search --calibration`.",
    )
    p.add_argument("profile", help="the profile of this model on this machine (`lightning-galvatron profile`)")
    _add_training_inputs(p)
    p.add_argument(
        "--global-batch-size", type=int, help="samples per step (default: the datamodule's batch_size x devices)"
    )
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of each probe before timing (default: 2)")
    p.add_argument("--timed-steps", type=int, default=4, help="timed steps of each probe (default: 4)")
    p.add_argument("-o", "--output", required=True, help="where rank 0 writes the calibration JSON")
    add_json_option(p)
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """:func:`~lightning_galvatron.cli.calibrate.calibrate` on every rank; rank 0 writes the calibration."""
    import torch.distributed as dist

    from lightning_galvatron.cli.calibrate import calibrate, launched_world
    from lightning_galvatron.cli.profile import _resolve_inputs

    inputs = _resolve_inputs(args)  # the model and data as `profile` reads them
    datamodule = inputs.build()[1]
    world = launched_world(args.devices)[1] or 0
    hparams = getattr(datamodule, "hparams", None)
    per_device = getattr(datamodule, "batch_size", None) or getattr(hparams, "batch_size", None)
    batch = args.global_batch_size or (per_device or 0) * world
    if not batch:
        raise ValueError("say how many samples a step trains on: --global-batch-size (no batch_size in the datamodule)")
    started = time.perf_counter()
    calibration = calibrate(
        args.profile,
        lambda: inputs.build()[0],
        datamodule,
        global_batch_size=batch,
        layers=args.layers,
        warmup_steps=args.warmup_steps,
        timed_steps=args.timed_steps,
        precision=inputs.precision,
        accelerator=args.accelerator,
        devices=args.devices,
    )
    if dist.get_rank() == 0:
        calibration.save(args.output)
        seconds = time.perf_counter() - started
        if getattr(args, "json", False):
            result = {"output": args.output, "calibration": calibration.to_dict(), "seconds": seconds}
            print(json.dumps(result, indent=2))
        else:
            print(f"Calibrated in {seconds:.1f} s: {calibration.describe()}")
            print(f"Wrote {args.output} (for GalvatronStrategy(calibration=...) and `search --calibration`)")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- search
@subcommand
def _register_search(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "search",
        help="search the best hybrid plan for a cluster (offline)",
        description=(
            "Search the plan with the highest predicted throughput that fits the memory budget. "
            "Exit status 0 with a plan, 1 when no plan fits (the message says the smallest budget that does)."
        ),
    )
    p.add_argument(
        "profile", help="profile JSON (ours, see import-galvatron), or the name of a reference profile (a100)"
    )
    p.add_argument("--world-size", type=int, required=True, help="number of devices")
    add_memory_budget_option(p, "memory budget per device, e.g. 36GB or 40GiB (default: the profile's device memory)")
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the world size)")
    add_search_options(p)
    p.add_argument("-o", "--output", help="write the plan JSON here")
    add_cost_options(p)
    p.set_defaults(func=_cmd_search)


def _cmd_search(args: argparse.Namespace) -> int:
    from lightning_galvatron.profiles import Profile
    from lightning_galvatron.search.engine import search

    profile = Profile.load(profile_path(args.profile))
    budget = args.memory_budget if args.memory_budget is not None else profile.hardware.device_memory_bytes
    if budget is None:
        raise ValueError("the profile does not say the device memory: pass --memory-budget, e.g. 36GB")
    precision, precision_source = precision_of(args, profile)
    result = search(
        profile,
        args.world_size,
        budget,
        global_batch_size=args.global_batch_size,
        optimizer=args.optimizer,
        precision=precision,
        options=search_options(args),
    )
    if args.output:
        result.plan.save(args.output)
    if args.json:
        print(json.dumps({**result.to_dict(), "precision": precision, "profile": args.profile}, indent=2))
        return EXIT_OK
    title = (
        f"Best plan for {profile.model.name} ({profile.model.num_blocks} blocks) on {args.world_size} devices, "
        f"budget {format_bytes(budget)} per device, global batch {result.global_batch_size}, {precision} "
        f"({precision_source})"
    )
    print(describe_search(result, title))
    if args.output:
        print(f"Plan written to {args.output}")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- evaluate
@subcommand
def _register_evaluate(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="predict step time and memory of a plan (ours or the reference system's format)",
        description="Predict a plan's step time and peak memory per device. Exit status 0, or 1 when a budget is "
        "given (or the profile says the device memory) and the plan does not fit it.",
    )
    p.add_argument("profile", help="profile JSON (ours), or the name of a reference profile (a100)")
    p.add_argument("--plan", required=True, help="plan JSON, ours or Hetu-Galvatron's")
    p.add_argument(
        "--world-size",
        type=int,
        help="devices (needed for a reference-format plan unless its file name says, e.g. 1nodes_8gpus_per_node)",
    )
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the plan's)")
    add_memory_budget_option(p, "budget to check the plan against (default: the profile's device memory)")
    add_cost_options(p)
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from lightning_galvatron.jsonfile import read_json_object
    from lightning_galvatron.plan import ParallelPlan, PlanError, is_galvatron_format
    from lightning_galvatron.profiles import Profile
    from lightning_galvatron.search.estimate import evaluate

    profile = Profile.load(profile_path(args.profile))
    precision, precision_source = precision_of(args, profile)
    budget = args.memory_budget if args.memory_budget is not None else profile.hardware.device_memory_bytes
    world_size = args.world_size
    data = read_json_object(args.plan, "plan file", PlanError)
    if world_size is None and is_galvatron_format(data):
        found = re.search(r"(\d+)nodes_(\d+)gpus_per_node", Path(args.plan).name)
        if not found:
            raise PlanError(
                f"plan file {args.plan!r} is in the reference format, which does not say its world size: "
                "pass --world-size"
            )
        world_size = int(found.group(1)) * int(found.group(2))
    try:
        plan = ParallelPlan.from_dict(data, world_size=world_size)
        if args.global_batch_size is None and plan.global_batch_size is None:
            raise PlanError("it does not fix its global batch size: pass --global-batch-size")
        estimate = evaluate(
            profile,
            plan,
            global_batch_size=args.global_batch_size,
            optimizer=args.optimizer,
            precision=precision,
            memory_budget_bytes=budget,
        )
    except ValueError as err:
        raise PlanError(f"plan file {args.plan!r} (evaluated on the profile {args.profile!r}): {err}") from None
    status = EXIT_NO if estimate.fits is False else EXIT_OK
    if args.json:
        print(json.dumps({**estimate.to_dict(), "precision": precision, "profile": args.profile}, indent=2))
        return status
    print(
        f"Plan {args.plan} for {profile.model.name} on {plan.world_size} devices, global batch "
        f"{estimate.global_batch_size}, {precision} ({precision_source})"
    )
    print(describe_estimate(estimate))
    for warning in estimate.warnings:
        print(f"warning: {warning}")
    return status


# ---------------------------------------------------------------------------------------------- import-galvatron
@subcommand
def _register_import_galvatron(subparsers: Any) -> None:
    from lightning_galvatron.cli.file_commands import register_import_galvatron

    register_import_galvatron(subparsers)


@subcommand
def _register_consolidate(subparsers: Any) -> None:
    from lightning_galvatron.cli.file_commands import register_consolidate

    register_consolidate(subparsers)


# ---------------------------------------------------------------------------------------------- estimate
@subcommand
def _register_estimate(subparsers: Any) -> None:
    from lightning_galvatron import reference_profiles

    p = subparsers.add_parser(
        "estimate",
        help="will a model fit a cluster you do not have, and how? (plan, memory and time from an analytic profile)",
        description="Search the plan for a model on a cluster that is not at hand: per-block costs are computed from "
        "the model's shape and scaled from the measured blocks of a profile (--reference, default --hardware); the "
        "interconnect is the hardware profile's. The report names the profiles used and warns when the model is far "
        "from the measured one. Exit status 0 when a plan fits, 1 when none does.",
    )
    add_model_options(
        p,
        hf_help="a Hugging Face config.json (nothing is downloaded)",
        model_help="a LightningModule or nn.Module class, MODULE:CLASS, built on the meta device",
    )
    p.add_argument("--world-size", type=int, required=True, help="number of devices")
    add_memory_budget_option(p, "memory budget per device, e.g. 80GB (default: the hardware profile's device memory)")
    p.add_argument(
        "--hardware",
        help="profile JSON whose hardware part describes the cluster, or the name of a reference profile shipped with "
        f"the package ({reference_profiles.describe()}) (default: the newest profile of --accelerator devices in the "
        "local profile cache)",
    )
    p.add_argument(
        "--reference",
        help=(
            "profile JSON (or reference name) whose measured blocks calibrate compute and activations (default: "
            "--hardware)"
        ),
    )
    p.add_argument(
        "--accelerator",
        default="cuda",
        choices=("cuda", "gpu", "cpu"),
        help="the kind of devices asked about (default: cuda)",
    )
    p.add_argument(
        "--allow-other-device",
        action="store_true",
        help="use a profile measured on another kind of device than --accelerator (its times and bandwidths are then "
        "those of that device)",
    )
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the world size)")
    add_search_options(p)
    p.add_argument("-o", "--output", help="write the plan JSON here (when one fits)")
    p.add_argument("--profile-output", help="write the analytic profile here (for `search` and `evaluate`)")
    add_cost_options(p)
    p.set_defaults(func=_cmd_estimate)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from lightning_galvatron.cli.estimate import run_estimate

    names = (
        "hf_config",
        "model",
        "model_args",
        "layers",
        "world_size",
        "memory_budget",
        "seq_length",
        "hardware",
        "reference",
        "accelerator",
        "allow_other_device",
        "global_batch_size",
        "precision",
        "optimizer",
        "output",
        "profile_output",
    )
    given = {name: getattr(args, name) for name in names}
    return run_estimate(**given, options=search_options(args), as_json=args.json)


# ---------------------------------------------------------------------------------------------- dry-run
@subcommand
def _register_dry_run(subparsers: Any) -> None:
    from lightning_galvatron.cli.dry_run import add_arguments

    p = subparsers.add_parser(
        "dry-run",
        help="apply and step a plan as any rank of any world size on fake tensors: memory, groups, collective order",
        description="Act as ranks of a cluster you do not have (torch's fake process-group backend, fake tensors): "
        "apply the plan as training would and run one step of training, validation and a checkpoint save; report "
        "per rank the blocks and parameters it holds, its process groups and its peak memory by category next to "
        "the cost model's prediction. With --ranks all, also prove that every member of every group issues the "
        "same collectives in the same order. Exit status 0 when every rank succeeded (and the order holds), 1 when "
        "one did not.",
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_dry_run)


def _cmd_dry_run(args: argparse.Namespace) -> int:
    from lightning_galvatron.cli.dry_run import run_dry_run

    return run_dry_run(args)


if __name__ == "__main__":
    sys.exit(main())
