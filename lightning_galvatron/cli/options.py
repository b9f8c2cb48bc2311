"""The option blocks the subcommands of ``lightning-galvatron`` share, declared once: memory sizes with their units,
the model of a question, the search's knobs (one flag per field of
:class:`~lightning_galvatron.search.options.SearchOptions`), precision and optimizer, ``--json``. The commands'
modules (``app``, ``estimate``, ``dry_run``, ...) import them from here, so none imports another for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Any

from lightning_galvatron.units import parse_bytes

_BARE_NUMBER = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?\s*$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """A memory size with its unit (``36GB``, ``40GiB``, ``512MB``; ``0`` alone is allowed)."""
    if _BARE_NUMBER.match(text) and float(text) != 0:
        raise argparse.ArgumentTypeError(
            f"{text.strip()!r} has no unit: write e.g. '{text.strip()}GB' (decimal) or '{text.strip()}GiB' (binary), "
            f"or '{text.strip()}B' if you mean bytes"
        )
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def memory_size(text: str) -> int:
    """A device's memory or budget: a byte size above zero."""
    size = byte_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a device's memory must be more than 0 bytes, got {text!r}")
    return size


def optimizer_kind_or_bytes(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"n_layer\": 4}'")
    return value


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object (errors included) instead of text")


def add_memory_budget_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--memory-budget`` (``GalvatronStrategy(memory_budget=...)``; ``--memory-per-device`` is its old name)."""
    parser.add_argument("--memory-budget", "--memory-per-device", dest="memory_budget", type=memory_size, help=help)


def add_precision_option(parser: argparse.ArgumentParser) -> None:
    from lightning_galvatron.search.cost import PRECISIONS

    parser.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        help="training precision (default: the precision the profile was measured in)",
    )


def add_cost_options(parser: argparse.ArgumentParser) -> None:
    from lightning_galvatron.search.cost import OPTIMIZER_STATES

    add_precision_option(parser)
    parser.add_argument(
        "--optimizer",
        type=optimizer_kind_or_bytes,
        default="adamw",
        help=f"optimizer kind ({', '.join(sorted(OPTIMIZER_STATES))}) or its state bytes per parameter "
        "(default: adamw)",
    )
    add_json_option(parser)


def add_model_options(parser: argparse.ArgumentParser, *, hf_help: str, model_help: str) -> None:
    """The model of a question about a cluster at hand or not: a Hugging Face config or a class, built on meta."""
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf-config", help=hf_help)
    model.add_argument("--model", help=model_help)
    parser.add_argument(
        "--model-args", type=json_object, default={}, help="with --model: its init arguments as a JSON object"
    )
    parser.add_argument("--layers", nargs="+", help="dotted path(s) of the block container(s) (default: detected)")
    parser.add_argument("--seq-length", type=int, help="tokens per sample (default: the config's maximum positions)")


def precision_of(args: argparse.Namespace, profile: Any) -> tuple[str, str]:
    """The precision asked for, else the profile's; and where it came from (for the report)."""
    if args.precision:
        return args.precision, "given"
    if profile is not None and profile.measured_precision:
        return profile.measured_precision, "the profile's"
    assumed = "32-true" if profile is not None and profile.model.activation_dtype_bytes == 4 else "bf16-mixed"
    return assumed, "assumed: the profile does not record its precision; pass --precision"


def profile_path(text: str) -> str:
    """A profile file, or the name of a reference profile shipped with the package (``a100``)."""
    from lightning_galvatron import reference_profiles

    return reference_profiles.resolve(text)


def add_search_options(parser: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """The search's knobs, one flag per field of :class:`~lightning_galvatron.search.options.SearchOptions`, named as
    the field (``--max-tp``, ``--disable``, ``--no-baselines``, ...): a knob added there appears in every command that
    searches. A flag not given is not passed (the defaults are the options' own). ``prefix`` starts each help text."""
    from lightning_galvatron.search.options import SearchOptions

    for option in dataclasses.fields(SearchOptions):
        meta, name = option.metadata, option.name.replace("_", "-")
        if isinstance(option.default, bool) and option.default:
            help_text = f"{prefix}do not {meta['help']}"
            parser.add_argument(f"--no-{name}", dest=option.name, action="store_false", default=None, help=help_text)
        elif isinstance(option.default, bool):
            parser.add_argument(f"--{name}", action="store_true", default=None, help=prefix + meta["help"])
        else:
            kinds = {key: meta[key] for key in ("type", "choices", "metavar") if key in meta}
            many = "+" if meta.get("many") else None
            parser.add_argument(f"--{name}", nargs=many, default=None, help=prefix + meta["help"], **kinds)


def search_options(args: argparse.Namespace) -> Any:
    """The :class:`~lightning_galvatron.search.options.SearchOptions` the flags of :func:`add_search_options` give."""
    from lightning_galvatron.search.options import SearchOptions

    names = [option.name for option in dataclasses.fields(SearchOptions)]
    return SearchOptions.of(**{name: getattr(args, name) for name in names if getattr(args, name, None) is not None})
