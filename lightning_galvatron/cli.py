"""``lightning-galvatron``: offline tools around the plan search.

Subcommands:

* ``profile --model MODULE:CLASS --datamodule MODULE:CLASS -o profile.json`` -- measure a model and
  the cluster it runs on (under ``torchrun``, or ``--devices N`` with Lightning's launcher);
* ``search PROFILE --world-size N --memory-per-device 36GB`` -- the best plan for any cluster;
* ``calibrate PROFILE --model MODULE:CLASS --datamodule MODULE:CLASS -o calibration.json`` -- fit the cost
  model to short runs of probe plans on this machine (under ``torchrun``, or ``--devices N``);
* ``evaluate PROFILE --plan PLAN`` -- predicted time and memory of a plan (ours or the reference
  system's format): a what-if tool;
* ``import-galvatron DIR --hidden-size H --seq-length S -o profile.json`` -- convert the reference
  system's profile files;
* ``estimate --hf-config CONFIG.json --world-size N --memory-per-device 80GB --hardware PROFILE`` -- will
  a model fit a cluster you do not have, and how (an analytic profile scaled from measured blocks);
* ``dry-run --hf-config CONFIG.json --world-size N --plan PLAN`` -- apply and step a plan as sampled (or all)
  ranks of the cluster, on fake tensors: memory, groups and the collective-order proof.

Adding a subcommand: write ``_cmd_<name>(args) -> int`` and a ``_register_<name>(subparsers)``
decorated with :func:`subcommand` that adds its parser and sets ``func=_cmd_<name>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_galvatron.search.report import describe_estimate, describe_search
from lightning_galvatron.units import format_bytes, parse_bytes

_REGISTRARS: list[Callable[[Any], None]] = []


def subcommand(register: Callable[[Any], None]) -> Callable[[Any], None]:
    """Mark a function ``register(subparsers)`` that adds one subcommand."""
    _REGISTRARS.append(register)
    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-galvatron",
        description="Automatic hybrid parallelism for PyTorch Lightning: offline plan search and what-if tools.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in _REGISTRARS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as err:  # our errors are ValueError subclasses with actionable messages
        print(f"lightning-galvatron {args.command}: error: {err}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------- shared options
def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _memory_size(text: str) -> int:
    """A device's memory or budget: a byte size above zero."""
    size = _byte_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a device's memory must be more than 0 bytes, got {text!r}")
    return size


def _optimizer(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text


def _add_cost_options(parser: argparse.ArgumentParser) -> None:
    from lightning_galvatron.search.cost import OPTIMIZER_STATES, PRECISIONS

    parser.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS), help="training precision (default: bf16-mixed)")
    parser.add_argument(
        "--optimizer",
        type=_optimizer,
        default="adamw",
        help=f"optimizer kind ({', '.join(sorted(OPTIMIZER_STATES))}) or its state bytes per parameter (default: adamw)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_search_options(parser: argparse.ArgumentParser, note: str = "") -> None:
    """One flag per field of :class:`~lightning_galvatron.search.options.SearchOptions` (``--max-tp``, ``--disable``,
    ``--no-baselines``, ...): a knob added there appears in every command that searches. Defaults are the
    options' own (a flag not given is not passed). ``note`` prefixes each help text."""
    from lightning_galvatron.search.options import SearchOptions

    for option in dataclasses.fields(SearchOptions):
        meta, name = option.metadata, option.name.replace("_", "-")
        flag, text = f"--{name}", note + meta["help"]
        if isinstance(option.default, bool) and option.default:
            help_text = f"{note}do not {meta['help']}"
            parser.add_argument(f"--no-{name}", dest=option.name, action="store_false", default=None, help=help_text)
        elif isinstance(option.default, bool):
            parser.add_argument(flag, action="store_true", default=None, help=text)
        else:
            kinds = {key: meta[key] for key in ("type", "choices", "metavar") if key in meta}
            parser.add_argument(flag, nargs="+" if meta.get("many") else None, default=None, help=text, **kinds)


def search_options(args: argparse.Namespace) -> Any:
    """The :class:`~lightning_galvatron.search.options.SearchOptions` the flags of :func:`add_search_options` give."""
    from lightning_galvatron.search.options import SearchOptions

    names = [option.name for option in dataclasses.fields(SearchOptions)]
    return SearchOptions.of(**{name: getattr(args, name) for name in names if getattr(args, name, None) is not None})


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
    p.add_argument("--model", help="the LightningModule class, MODULE:CLASS or path/to/file.py:CLASS")
    p.add_argument("--model-args", type=_json_object, default={}, help="its init arguments as a JSON object")
    p.add_argument("--datamodule", help="the LightningDataModule class giving the example batch, MODULE:CLASS")
    p.add_argument("--datamodule-args", type=_json_object, default={}, help="its init arguments as a JSON object")
    p.add_argument(
        "--config",
        help="a LightningCLI YAML: its model/data sections (class_path/init_args, or init arguments of --model/--datamodule) "
        "and trainer.precision are used; command-line arguments win",
    )
    p.add_argument("--layers", nargs="+", help="dotted path(s) of the block container(s) (default: detected)")
    p.add_argument("--precision", help="32-true, bf16-mixed or bf16-true (default: the config's, else 32-true)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="local batch sizes to time (default: 1 4)")
    p.add_argument("--budget", type=float, default=3.0, help="rough seconds for the collective measurements (default: 3)")
    p.add_argument("--devices", type=int, help="without torchrun: processes to launch on this machine (Lightning's launcher)")
    p.add_argument("--accelerator", default="auto", help="with --devices: cpu, cuda or auto (default: auto)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cache-dir", help="profile cache directory (default: $LIGHTNING_GALVATRON_CACHE or ~/.cache/lightning_galvatron/profiles)")
    cache.add_argument("--no-cache", action="store_true", help="always measure, never read or write the cache")
    p.add_argument("-o", "--output", required=True, help="where rank 0 writes the profile JSON")
    p.set_defaults(func=_cmd_profile)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"n_layer\": 4}'")
    return value


def _cmd_profile(args: argparse.Namespace) -> int:
    from lightning_galvatron.profiler.command import run_profile

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
    p.add_argument("--model", help="the LightningModule class, MODULE:CLASS or path/to/file.py:CLASS")
    p.add_argument("--model-args", type=_json_object, default={}, help="its init arguments as a JSON object")
    p.add_argument("--datamodule", help="the LightningDataModule class, MODULE:CLASS")
    p.add_argument("--datamodule-args", type=_json_object, default={}, help="its init arguments as a JSON object")
    p.add_argument("--config", help="a LightningCLI YAML with model/data sections (command-line arguments win)")
    p.add_argument("--layers", nargs="+", help="dotted path(s) of the block container(s) (default: detected)")
    p.add_argument("--precision", help="32-true, bf16-mixed or bf16-true (default: the config's, else 32-true)")
    p.add_argument("--global-batch-size", type=int, help="samples per step (default: the datamodule's batch_size x devices)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of each probe before timing (default: 2)")
    p.add_argument("--timed-steps", type=int, default=4, help="timed steps of each probe (default: 4)")
    p.add_argument("--devices", type=int, help="without torchrun: processes to launch on this machine (Lightning's launcher)")
    p.add_argument("--accelerator", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("-o", "--output", required=True, help="where rank 0 writes the calibration JSON")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from lightning_galvatron.profiler.command import run_calibrate

    return run_calibrate(args)


# ---------------------------------------------------------------------------------------------- search
@subcommand
def _register_search(subparsers: Any) -> None:
    p = subparsers.add_parser("search", help="search the best hybrid plan for a cluster (offline)")
    p.add_argument("profile", help="profile JSON (our format; see import-galvatron)")
    p.add_argument("--world-size", type=int, required=True, help="number of devices")
    p.add_argument("--memory-per-device", type=_memory_size, help="memory budget per device, e.g. 36GB or 40GiB (default: the profile's device memory)")
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the world size)")
    add_search_options(p)
    p.add_argument("-o", "--output", help="write the plan JSON here")
    _add_cost_options(p)
    p.set_defaults(func=_cmd_search)


def _cmd_search(args: argparse.Namespace) -> int:
    from lightning_galvatron.profiles import Profile
    from lightning_galvatron.search.engine import search

    profile = Profile.load(args.profile)
    budget = args.memory_per_device if args.memory_per_device is not None else profile.hardware.device_memory_bytes
    if budget is None:
        raise ValueError("the profile does not say the device memory: pass --memory-per-device, e.g. 36GB")
    result = search(
        profile,
        args.world_size,
        budget,
        global_batch_size=args.global_batch_size,
        optimizer=args.optimizer,
        precision=args.precision,
        options=search_options(args),
    )
    if args.output:
        result.plan.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    title = (
        f"Best plan for {profile.model.name} ({profile.model.num_blocks} blocks) on {args.world_size} devices, "
        f"{format_bytes(budget)} per device, global batch {result.global_batch_size}"
    )
    print(describe_search(result, title))
    if args.output:
        print(f"Plan written to {args.output}")
    return 0


# ---------------------------------------------------------------------------------------------- evaluate
@subcommand
def _register_evaluate(subparsers: Any) -> None:
    p = subparsers.add_parser("evaluate", help="predict step time and memory of a plan (ours or the reference system's format)")
    p.add_argument("profile", help="profile JSON (our format)")
    p.add_argument("--plan", required=True, help="plan JSON, ours or Hetu-Galvatron's")
    p.add_argument("--world-size", type=int, help="devices (needed for a reference-format plan unless its file name says, e.g. 1nodes_8gpus_per_node)")
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the plan's)")
    p.add_argument("--memory-per-device", type=_memory_size, help="budget to check the plan against")
    _add_cost_options(p)
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from lightning_galvatron.jsonfile import read_json_object
    from lightning_galvatron.plan import ParallelPlan, PlanError, is_galvatron_format
    from lightning_galvatron.profiles import Profile
    from lightning_galvatron.search.estimate import evaluate

    profile = Profile.load(args.profile)
    world_size = args.world_size
    data = read_json_object(args.plan, "plan file", PlanError)
    if world_size is None and is_galvatron_format(data):
        found = re.search(r"(\d+)nodes_(\d+)gpus_per_node", Path(args.plan).name)
        if not found:
            raise PlanError(f"plan file {args.plan!r} is in the reference format, which does not say its world size: "
                            "pass --world-size")
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
            precision=args.precision,
            memory_budget_bytes=args.memory_per_device,
        )
    except ValueError as err:
        raise PlanError(f"plan file {args.plan!r} (evaluated on the profile {args.profile!r}): {err}") from None
    if args.json:
        print(json.dumps(estimate.to_dict(), indent=2))
        return 0
    print(f"Plan {args.plan} for {profile.model.name} on {plan.world_size} devices, global batch {estimate.global_batch_size}")
    print(describe_estimate(estimate))
    for warning in estimate.warnings:
        print(f"warning: {warning}")
    return 0


# ---------------------------------------------------------------------------------------------- import-galvatron
def _counts(text: str) -> list[int] | int:
    values = [int(v) for v in text.split(",") if v.strip()]
    return values[0] if len(values) == 1 else values


@subcommand
def _register_import_galvatron(subparsers: Any) -> None:
    p = subparsers.add_parser("import-galvatron", help="convert Hetu-Galvatron profile files into our profile format")
    p.add_argument("directory", help="directory with the reference system's computation/memory/bandwidth JSON files")
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--num-layers", type=_counts, help="blocks (per layer type, comma-separated, for several types)")
    p.add_argument("--num-heads", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--tied-embeddings", action="store_true", help="the head shares the embedding's weights")
    p.add_argument("--model-name", help="name of the model (default: from the file names)")
    p.add_argument("--memory-overhead", type=_byte_size, default=0, help="fixed memory per device the model does not account for")
    p.add_argument("--device-memory", type=_memory_size, help="memory of one device")
    p.add_argument("-o", "--output", required=True, help="where to write the profile JSON")
    p.set_defaults(func=_cmd_import_galvatron)


def _cmd_import_galvatron(args: argparse.Namespace) -> int:
    from lightning_galvatron.producers.galvatron_import import import_galvatron

    profile = import_galvatron(
        args.directory,
        hidden_size=args.hidden_size,
        seq_length=args.seq_length,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.vocab_size,
        tied_embeddings=args.tied_embeddings,
        model_name=args.model_name,
        memory_overhead_bytes=args.memory_overhead,
        device_memory_bytes=args.device_memory,
    )
    profile.save(args.output)
    model = profile.model
    print(f"Wrote {args.output}: {model.name}, {model.num_blocks} blocks of {len(model.layer_types)} type(s), "
          f"{len(profile.hardware.collectives)} collective fits, {profile.hardware.devices_per_node} devices per node")
    return 0


# ---------------------------------------------------------------------------------------------- formatting
# ---------------------------------------------------------------------------------------------- consolidate
@subcommand
def _register_consolidate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "consolidate",
        help="assemble a sharded checkpoint into one file for the plain model",
        description="Assemble a sharded (DCP) checkpoint saved by GalvatronStrategy into one file: the model's "
        "state dict, which loads into the unparallelised model with load_state_dict(strict=True).",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (e.g. epoch=0-step=100.ckpt/)")
    parser.add_argument("-o", "--output", required=True, help="file to write (e.g. model.pt)")
    parser.add_argument(
        "--lightning",
        action="store_true",
        help="write a Lightning checkpoint (state_dict + epoch/step/hyper-parameters) for load_from_checkpoint",
    )
    parser.set_defaults(func=_cmd_consolidate)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from lightning_galvatron.checkpoint import consolidate

    path = consolidate(args.checkpoint, args.output, lightning=args.lightning)
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------------- estimate
@subcommand
def _register_estimate(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="will a model fit a cluster you do not have, and how? (plan, memory and time from an analytic profile)",
        description="Search the plan for a model on a cluster that is not at hand: per-block costs are computed from "
        "the model's shape and scaled from the measured blocks of a profile (--reference, default --hardware); the "
        "interconnect is the hardware profile's. Exit status 0 when a plan fits, 1 when none does.",
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-config", help="a Hugging Face config.json (nothing is downloaded)")
    model.add_argument("--model", help="a LightningModule or nn.Module class, MODULE:CLASS, built on the meta device")
    p.add_argument("--model-args", type=_json_object, default={}, help="with --model: its init arguments as a JSON object")
    p.add_argument("--layers", nargs="+", help="with --model: dotted path(s) of the block container(s) (default: detected)")
    p.add_argument("--world-size", type=int, required=True, help="number of devices")
    p.add_argument("--memory-per-device", type=_memory_size, help="memory budget per device, e.g. 80GB (default: the hardware profile's)")
    p.add_argument("--seq-length", type=int, help="tokens per sample (default: the config's maximum positions)")
    p.add_argument("--hardware", help="profile JSON whose hardware part describes the cluster (default: the newest profile in the local profile cache)")
    p.add_argument("--reference", help="profile JSON whose measured blocks calibrate compute and activations (default: --hardware)")
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the world size)")
    add_search_options(p)
    p.add_argument("-o", "--output", help="write the plan JSON here (when one fits)")
    p.add_argument("--profile-output", help="write the analytic profile here (for `search` and `evaluate`)")
    _add_cost_options(p)
    p.set_defaults(func=_cmd_estimate)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from lightning_galvatron.estimator import run_estimate

    return run_estimate(
        hf_config=args.hf_config, model=args.model, model_args=args.model_args, layers=args.layers,
        world_size=args.world_size, memory_per_device=args.memory_per_device, seq_length=args.seq_length,
        hardware=args.hardware, reference=args.reference, global_batch_size=args.global_batch_size,
        precision=args.precision, optimizer=args.optimizer, options=search_options(args), output=args.output,
        profile_output=args.profile_output, as_json=args.json,
    )


# ---------------------------------------------------------------------------------------------- dry-run
@subcommand
def _register_dry_run(subparsers: Any) -> None:
    from lightning_galvatron.dryrun.command import add_arguments

    p = subparsers.add_parser(
        "dry-run",
        help="apply and step a plan as any rank of any world size on fake tensors: memory, groups, collective order",
        description="Act as ranks of a cluster you do not have (torch's fake process-group backend, fake tensors): "
        "apply the plan as training would and run one step of training, validation and a checkpoint save; report "
        "per rank the blocks and parameters it holds, its process groups and its peak memory by category next to "
        "the cost model's prediction. With --ranks all, also prove that every member of every group issues the "
        "same collectives in the same order. Exit status 0 when every rank succeeded (and the order holds).",
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_dry_run)


def _cmd_dry_run(args: argparse.Namespace) -> int:
    from lightning_galvatron.dryrun.command import run_dry_run

    return run_dry_run(args)


if __name__ == "__main__":
    sys.exit(main())
