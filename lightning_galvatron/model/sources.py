"""Models named by the user on a command line: a class path, a file, a Hugging Face ``config.json``.

The commands (profile, estimate, dry run) and the dry run's model builder read models the same way: a class is
imported by path (:func:`load_class`), and an architecture's shape comes from a config (counted when the family is
known, else built on the meta device) or from a class built on the meta device. Torch is imported only where a
model is built: an estimate for a known family stays as quick as the search.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_galvatron.jsonfile import read_json_object
from lightning_galvatron.producers.analytic import ArchitectureShape, architecture_from_hf_config


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
        named: type = getattr(module, class_name)  # what the user named: taken to be a class, as documented
        return named
    except AttributeError:
        raise ValueError(f"{path!r}: {module_name} has no {class_name!r}") from None


def architecture_from_config_file(path: str | Path) -> ArchitectureShape:
    """A Hugging Face ``config.json``: counted from the config when the family is known, else built on meta."""
    config = read_json_object(path, "config file")
    shape = architecture_from_hf_config(config)
    if shape is not None:
        return shape
    from lightning_galvatron.model.shapes import architecture_of_module, hf_model_on_meta

    module, counts = hf_model_on_meta(config)
    positions = config.get("max_position_embeddings") or config.get("n_positions")
    name = config.get("_name_or_path") or (config.get("architectures") or [config.get("model_type", "model")])[0]
    return architecture_of_module(module, name=str(name), block_counts=counts, default_seq_length=positions)


def architecture_from_class(
    path: str, init_args: Mapping[str, Any] | None = None, layers: Sequence[str] | None = None
) -> ArchitectureShape:
    """``MODULE:CLASS`` (a LightningModule or any ``nn.Module``) built on the meta device with ``init_args``."""
    import torch

    from lightning_galvatron.model.shapes import architecture_of_module

    cls = load_class(path)
    with torch.device("meta"):
        module = cls(**dict(init_args or {}))
    seq = seq_length_of(module)
    return architecture_of_module(module, layers=layers, name=cls.__name__, default_seq_length=seq)


def seq_length_of(module: Any) -> int | None:
    """The sequence length a module says it was built for (``seq_length``, ``max_seq_length`` or ``block_size``, in
    its hyperparameters or attributes), if any."""
    hparams = getattr(module, "hparams", None)
    for source in (hparams, module):
        for name in ("seq_length", "max_seq_length", "block_size"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int):
                return value
    return None
