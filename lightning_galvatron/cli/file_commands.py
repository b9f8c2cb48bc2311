"""The subcommands that convert files: ``import-galvatron`` (the reference system's profiles into ours) and
``consolidate`` (a sharded checkpoint into one file, or into a Hugging Face model directory).

Registered by :mod:`lightning_galvatron.cli.app`, which owns the conventions (exit codes, ``--json`` errors).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_galvatron.cli.options import add_json_option, byte_size, memory_size

EXIT_OK = 0


def _counts(text: str) -> list[int] | int:
    values = [int(v) for v in text.split(",") if v.strip()]
    return values[0] if len(values) == 1 else values


def register_import_galvatron(subparsers: Any) -> None:
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
    p.add_argument("--hardware-name", help="name of the devices measured, e.g. 'NVIDIA A100 x8 per node'")
    p.add_argument(
        "--memory-overhead",
        type=byte_size,
        default=0,
        help="fixed memory per device the model does not account for, e.g. 2GB",
    )
    p.add_argument("--device-memory", type=memory_size, help="memory of one device, e.g. 80GB")
    p.add_argument("-o", "--output", required=True, help="where to write the profile JSON")
    add_json_option(p)
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
        hardware_name=args.hardware_name,
    )
    profile.save(args.output)
    model = profile.model
    if args.json:
        print(
            json.dumps(
                {
                    "output": args.output,
                    "model": model.name,
                    "blocks": model.num_blocks,
                    "layer_types": len(model.layer_types),
                    "collectives": len(profile.hardware.collectives),
                    "devices_per_node": profile.hardware.devices_per_node,
                },
                indent=2,
            )
        )
        return EXIT_OK
    print(
        f"Wrote {args.output}: {model.name}, {model.num_blocks} blocks of {len(model.layer_types)} type(s), "
        f"{len(profile.hardware.collectives)} collective fits, {profile.hardware.devices_per_node} devices per node"
    )
    return EXIT_OK


def register_consolidate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "consolidate",
        help="assemble a sharded checkpoint into one file for the plain model, or into a Hugging Face model directory",
        description="Assemble a sharded (DCP) checkpoint saved by GalvatronStrategy: into one file holding the model's "
        "state dict, which loads into the unparallelised model with load_state_dict(strict=True) (-o); or, for a "
        "LightningModule wrapping a Hugging Face model, into a directory that transformers' from_pretrained loads "
        "(--hf: safetensors and config.json).",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (e.g. epoch=0-step=100.ckpt/)")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("-o", "--output", help="file to write (e.g. model.pt)")
    out.add_argument("--hf", metavar="OUT_DIR", help="write the Hugging Face model inside the LightningModule here")
    parser.add_argument(
        "--lightning",
        action="store_true",
        help=(
            "with -o: write a Lightning checkpoint (state_dict + epoch/step/hyper-parameters) for load_from_checkpoint"
        ),
    )
    parser.add_argument(
        "--hf-config",
        help="with --hf, for checkpoints that do not record their Hugging Face model (saved by an earlier version): "
        "the model's config.json or a directory holding it",
    )
    add_json_option(parser)
    parser.set_defaults(func=_cmd_consolidate)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from lightning_galvatron.strategy.checkpoint import consolidate, export_hf

    if args.hf:
        if args.lightning:
            raise ValueError("--lightning writes a Lightning checkpoint file: use it with -o, not with --hf")
        exported = export_hf(args.checkpoint, args.hf, config=args.hf_config)
        if args.json:
            print(
                json.dumps(
                    {
                        "output": str(exported.directory),
                        "class": exported.class_name,
                        "prefix": exported.prefix,
                        "tensors": exported.tensors,
                    },
                    indent=2,
                )
            )
        else:
            print(
                f"wrote {exported.directory}: {exported.class_name} ({exported.tensors} tensors under "
                f"{exported.prefix or 'the top level'!r} of the LightningModule); load it with "
                f"transformers.{exported.class_name}.from_pretrained({str(exported.directory)!r})"
            )
        return EXIT_OK
    if args.hf_config:
        raise ValueError("--hf-config describes the model of --hf: pass --hf OUT_DIR")
    path = consolidate(args.checkpoint, args.output, lightning=args.lightning)
    print(json.dumps({"output": str(path)}) if args.json else f"wrote {path}")
    return EXIT_OK
