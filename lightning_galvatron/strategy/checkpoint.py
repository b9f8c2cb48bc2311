"""Checkpoints of ``GalvatronStrategy``: resume into any plan, and sharded checkpoints to one file.

``GalvatronStrategy`` saves Lightning checkpoints as DCP directories (one shard file per rank, DCP's
``.metadata`` index, and ``meta.pt`` with Lightning's loop state), written aside and renamed into place when whole
(:mod:`lightning_galvatron.strategy.checkpoint_files`); a directory whose files do not make one save is refused,
naming the file (:func:`check_sharded_checkpoint`). Parameter names are those of the
plain model whatever the plan, so a checkpoint loads into any other plan or world size
(:func:`load_checkpoint`, what ``Trainer.fit(ckpt_path=...)`` runs) and assembles into the
unparallelised model's state dict (:func:`consolidate`, ``lightning-galvatron consolidate CKPT_DIR -o
model.pt``) or, for a Hugging Face model inside the LightningModule, into a directory that
``from_pretrained`` loads (:func:`export_hf`, ``lightning-galvatron consolidate CKPT_DIR --hf OUT_DIR``).

Lightning's own loader (``ModelParallelStrategy.load_checkpoint``) needs a model with at least one
DTensor parameter, so it cannot resume a plan of plain DDP blocks; and DCP stores the optimizer's
parameter groups of one rank only, which under a pipeline name another stage's parameters, so their
hyper-parameters would not be restored on the other stages. :func:`load_checkpoint` uses DCP's public
state-dict API for every plan and matches parameter groups by position, as
``torch.optim.Optimizer.load_state_dict`` does. (Lightning's ``consolidate_checkpoint`` expects another
layout of this format and fails on it.)
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_galvatron.strategy.checkpoint_files import DCP_INDEX_FILE, METADATA_FILE, committed_path

MODEL_KEY = "state_dict"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong with it."""


def check_sharded_checkpoint(path: str | os.PathLike) -> Any:
    """DCP's index of a sharded checkpoint directory, or :class:`CheckpointError` saying why it is not one."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a sharded (DCP) checkpoint directory")
    if not (path / DCP_INDEX_FILE).is_file():
        shards = sorted(p.name for p in path.glob("*.distcp"))
        if not shards and not (path / METADATA_FILE).is_file():
            raise CheckpointError(
                f"{str(path)!r} is not a sharded (DCP) checkpoint directory: it has no {DCP_INDEX_FILE}, no shard "
                f"files and no {METADATA_FILE}"
            )
        found = f"it holds {len(shards)} shard file(s) but" if shards else "it"
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} is incomplete: {found} has no {DCP_INDEX_FILE} file, which DCP writes "
            "last -- the save that wrote it was interrupted; resume from an earlier checkpoint"
        )
    try:
        index = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a truncated or foreign index: say which file
        raise CheckpointError(f"cannot read {str(path / DCP_INDEX_FILE)!r} ({type(err).__name__}: {err})") from None
    _check_shard_files(path, index)
    return index


def _check_shard_files(path: Path, index: Any) -> None:
    """Every shard file the index names holds the bytes it places there: a save killed while it rewrote a directory
    in place (before saves were staged) left the previous index beside half-written shards."""
    needed: dict[str, int] = {}
    for info in (getattr(index, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        have = shard.stat().st_size if shard.is_file() else None
        if have is None or have < size:
            found = "is missing" if have is None else f"holds {have} bytes"
            raise CheckpointError(
                f"checkpoint directory {str(path)!r} is incomplete: its shard file {name} {found} but the index "
                f"({DCP_INDEX_FILE}) places {size} bytes in it -- a save was interrupted while it wrote this "
                "directory; resume from an earlier checkpoint"
            )


def _check_same_save(path: Path, index: Any, loop_state: Any) -> None:
    """``meta.pt`` records the save id of the index it was written with (checkpoints of this version): refuse a
    directory whose two files come from different saves."""
    recorded = (loop_state.get("galvatron") or {}).get("save_id") if isinstance(loop_state, dict) else None
    indexed = getattr(getattr(index, "storage_meta", None), "save_id", None)
    if recorded is not None and indexed is not None and recorded != indexed:
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} mixes two saves: its {METADATA_FILE} was written with another "
            f"save's shards than its {DCP_INDEX_FILE} indexes -- a save was interrupted while it wrote this "
            "directory; resume from an earlier checkpoint"
        )


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a checkpoint saved by ``GalvatronStrategy`` (any plan, any world size) into ``model`` as parallelised now.

    Call on every rank. Loads the model's parameters and, for each optimizer, its states and the hyper-parameters of
    its parameter groups; returns Lightning's metadata (loops, callbacks, schedulers, ...). A full checkpoint file
    (``save_distributed_checkpoint=False``) loads the same way, by parameter name.
    """
    given, path = Path(path), committed_path(Path(path))
    if path != given:
        warnings.warn(
            f"checkpoint {str(given)!r} is missing: the save that replaced it was killed between its two renames; "
            f"loading the checkpoint it replaced, left at {str(path)!r}",
            stacklevel=2,
        )
    if path.is_file():
        return _load_full(path, model, optimizers, strict=strict, weights_only=weights_only)
    index = check_sharded_checkpoint(path)
    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} is incomplete: it has no {METADATA_FILE} (Lightning's loop state, "
            "written after the shards) -- the save that wrote it was interrupted; resume from an earlier checkpoint"
        )
    try:
        loop_state = torch.load(path / METADATA_FILE, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - say which file
        raise CheckpointError(f"cannot read {str(path / METADATA_FILE)!r} ({type(err).__name__}: {err})") from None
    _check_same_save(path, index, loop_state)
    read = _read_files(path)
    load_sharded_states(read, set(index.state_dict_metadata), model, optimizers, strict=strict, name=repr(str(path)))
    return loop_state


# Fills a state dict of holders (nested) through a DCP load planner: ``read(holders, planner)``.
ReadStates = Callable[[dict[str, Any], Any], None]


def load_sharded_states(
    read: ReadStates,
    saved: set[str],
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool,
    name: str,
) -> None:
    """Load the model's and each optimizer's states of a sharded checkpoint whose index holds the entries ``saved``
    into ``model`` as parallelised now: the holders this rank's shards need, filled by ``read`` (DCP's ``load`` from
    the files; the dry run plans the reads against the index instead), then set. ``name`` names it in errors."""
    _load_model(read, name, model, saved, strict)
    for number, optimizer in enumerate(optimizers):
        _load_optimizer(read, name, model, optimizer, f"optimizer_{number}", saved, strict)


def _read_files(path: Path) -> ReadStates:
    """DCP's ``load`` of the checkpoint directory ``path``: the holders filled from its shard files."""
    from torch.distributed.checkpoint import load as dcp_load

    def read(holders: dict[str, Any], planner: Any) -> None:
        dcp_load(holders, checkpoint_id=str(path), planner=planner)

    return read


def without_created_states(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict as it was before ``get_optimizer_state_dict`` made it: that function steps an
    optimizer without states once (zero gradients, no learning rate) to create them, so a checkpoint saved before
    the first step (``Tuner.lr_find``'s) left Adam counting a step it never took. Call with what it returned for
    an optimizer that had no states: they are dropped from the optimizer and from ``saved``."""
    optimizer.state.clear()
    return {**saved, "state": {}} if "state" in saved else saved  # rank 0 only holds a full state dict


# DCP writes a DTensor's local chunk at the offset a plain ``Shard`` would have: a ``_StridedShard`` (a fused
# q/k/v projection split by heads, see runtime/tensor_parallel.ColwiseFused) would land on its neighbours'
# rows. Such tensors are saved whole (every rank holds the same copy: DCP writes one) and split again on load.
def _is_strided(value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def whole_strided_tensors(state: Any) -> Any:
    """``state`` (nested dicts/lists) with every strided-sharded DTensor replaced by the whole tensor (to save)."""
    if isinstance(state, dict):
        return {k: whole_strided_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [whole_strided_tensors(v) for v in state]
    return _whole(state) if _is_strided(state) else state


def _whole(value: Any) -> torch.Tensor:
    """A DTensor's whole tensor, gathered on its mesh's device even when its local part was offloaded to the host
    (``cpu_offload``, as Lightning collects sharded state dicts: NCCL takes no CPU tensor), and returned there."""
    local = value.to_local()
    kind = value.device_mesh.device_type
    if local.device.type == kind:
        return value.full_tensor()
    device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    return value.to(device).full_tensor().to(local.device)


def _whole_holders(state: dict[str, Any]) -> dict[str, Any]:
    """Load targets: a whole, empty tensor for every strided-sharded DTensor of ``state`` (nested)."""
    holders: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            holders[k] = _whole_holders(v)
        elif _is_strided(v):
            holders[k] = torch.empty(v.shape, dtype=v.dtype, device=v.to_local().device)
        else:
            holders[k] = v
    return holders


def _split_like(loaded: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """Loaded whole tensors split again as ``own``'s strided-sharded DTensors are (nested)."""
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {}
    for k, v in loaded.items():
        mine = own.get(k)
        if isinstance(v, dict) and isinstance(mine, dict):
            out[k] = _split_like(v, mine)
        elif _is_strided(mine):
            out[k] = distribute_tensor(v, mine.device_mesh, mine.placements)
        else:
            out[k] = v
    return out


def _load_model(read: ReadStates, name: str, model: nn.Module, saved: set[str], strict: bool) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    missing = sorted(fqn for fqn in state if f"{MODEL_KEY}.{fqn}" not in saved)
    if missing and strict:
        raise CheckpointError(
            f"checkpoint {name} lacks {len(missing)} of this model's tensors ({_first(missing)}): it was saved "
            "from another model; load it into that model, or set the LightningModule's strict_loading = False"
        )
    state = {fqn: value for fqn, value in state.items() if fqn not in missing}
    holder = {MODEL_KEY: _whole_holders(state)}
    read(holder, DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(model, _split_like(holder[MODEL_KEY], state), options=StateDictOptions(strict=False))


def _load_optimizer(
    read: ReadStates,
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    key: str,
    saved: set[str],
    strict: bool,
) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if not any(entry.startswith(f"{key}.") for entry in saved):
        raise CheckpointError(
            f"checkpoint {name} has no state for optimizer {key[len('optimizer_') :]} (saved with "
            "save_weights_only=True, or with fewer optimizers): it can initialise a model but not resume its training"
        )
    state = _saved_entries(get_optimizer_state_dict(model, optimizer), key, saved)
    own_groups = [list(group["params"]) for group in state["param_groups"]]
    saved_groups = len({entry.split(".")[2] for entry in saved if entry.startswith(f"{key}.param_groups.")})
    if saved_groups != len(own_groups):
        raise CheckpointError(
            f"checkpoint {name}: optimizer {key[len('optimizer_') :]} has {len(own_groups)} parameter "
            f"groups but the checkpoint's has {saved_groups}; configure_optimizers must build the same groups"
        )
    holder = {key: {**state, "state": _whole_holders(state["state"])}}
    read(holder, DefaultLoadPlanner(allow_partial_load=not strict))
    loaded = {**holder[key], "state": _split_like(holder[key]["state"], state["state"])}
    for group, params in zip(loaded["param_groups"], own_groups):
        group["params"] = params  # one rank's names were stored; hyper-parameters are the same on every rank
    set_optimizer_state_dict(model, optimizer, loaded, options=StateDictOptions(strict=strict))


def _saved_entries(state: dict[str, Any], key: str, saved: set[str]) -> dict[str, Any]:
    """An optimizer's state dict as the checkpoint has it: without the hyper-parameters added to its groups since
    the save (a scheduler made later sets ``initial_lr``: ``Tuner.lr_find``) and the states of parameters that had
    none then. Loaded, the optimizer is as it was saved, as ``Optimizer.load_state_dict`` makes it."""
    groups = [
        {name: value for name, value in group.items() if f"{key}.param_groups.{index}.{name}" in saved}
        for index, group in enumerate(state["param_groups"])
    ]
    states = {
        fqn: {name: value for name, value in values.items() if f"{key}.state.{fqn}.{name}" in saved}
        for fqn, values in state["state"].items()
    }
    return {**state, "param_groups": groups, "state": {fqn: values for fqn, values in states.items() if values}}


def _load_full(
    path: Path, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """A full checkpoint file, read on every rank (memory-mapped) and distributed to the local shards by name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    try:
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say which
        raise CheckpointError(f"cannot read the checkpoint file {str(path)!r} ({type(err).__name__}: {err})") from None
    if not isinstance(checkpoint, dict) or MODEL_KEY not in checkpoint:
        raise CheckpointError(f"{str(path)!r} is not a Lightning checkpoint: it has no {MODEL_KEY!r}")
    full = checkpoint.pop(MODEL_KEY)
    own = get_model_state_dict(model)
    missing = sorted(set(own) - set(full))
    if missing and strict:
        raise CheckpointError(
            f"checkpoint {str(path)!r} lacks {len(missing)} of this model's tensors ({_first(missing)}): it was saved "
            "from another model; load it into that model, or set the LightningModule's strict_loading = False"
        )
    if optimizers and set(full) - set(own):
        raise CheckpointError(
            f"{str(path)!r} is a full checkpoint file (save_distributed_checkpoint=False): its optimizer states are "
            "keyed by the position of each parameter in the whole model, which a pipeline stage does not hold; resume "
            "it with a plan without pipeline stages (pp=1), or save sharded checkpoints (the default)"
        )
    local = {name: full[name] for name in own if name in full}
    options = StateDictOptions(full_state_dict=True, strict=False)  # every rank has the file: no broadcast
    set_model_state_dict(model, local, options=options)
    for number, optimizer in enumerate(optimizers):
        states = checkpoint.get("optimizer_states", [])
        if number >= len(states):
            raise CheckpointError(f"checkpoint {str(path)!r} has no state for optimizer {number}")
        state = states[number]
        if state["state"] and all(isinstance(k, int) for k in state["state"]):  # Lightning keys them by position
            state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, model)
        set_optimizer_state_dict(model, optimizer, state, options=options)
    return checkpoint


def _first(names: Sequence[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (", ..." if len(names) > count else "")


def load_model_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The full model state dict of a sharded checkpoint, assembled in this process (no process group).

    DCP's public API only: the index gives every entry's shape and dtype, ``load(..., no_dist=True)`` fills them.
    """
    from torch.distributed.checkpoint import TensorStorageMetadata
    from torch.distributed.checkpoint import load as dcp_load

    index = check_sharded_checkpoint(checkpoint_dir)
    root: dict[str, Any] = {}
    for key, entry in index.state_dict_metadata.items():
        path = (index.planner_data or {}).get(key) or tuple(key.split(".", 1))  # the nesting DCP flattened
        if path[0] != MODEL_KEY:
            continue
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        is_tensor = isinstance(entry, TensorStorageMetadata)
        node[path[-1]] = (
            torch.empty(entry.size, dtype=entry.properties.dtype) if is_tensor else None
        )  # None: DCP fills in
    if MODEL_KEY not in root:
        raise CheckpointError(f"checkpoint {str(checkpoint_dir)!r} holds no model state ({MODEL_KEY!r} entries)")
    with warnings.catch_warnings():  # one process on purpose; DCP warns that no process group is initialised
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp_load(root, checkpoint_id=str(checkpoint_dir), no_dist=True)
    return root[MODEL_KEY]


def _metadata(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Lightning's loop state and hyper-parameters saved next to the shards (empty if absent)."""
    meta_file = Path(checkpoint_dir) / METADATA_FILE
    if not meta_file.is_file():
        return {}
    try:
        return torch.load(meta_file, weights_only=False)
    except Exception as err:  # noqa: BLE001 - say which file
        raise CheckpointError(f"cannot read {str(meta_file)!r} ({type(err).__name__}: {err})") from None


def consolidate(checkpoint_dir: str | os.PathLike, output: str | os.PathLike, lightning: bool = False) -> Path:
    """Write the model of a sharded checkpoint as one file.

    Args:
        output: the file to write.
        lightning: write a Lightning checkpoint (``state_dict`` plus Lightning's metadata: epoch, step,
            hyper-parameters; no optimizer states) that ``LightningModule.load_from_checkpoint`` reads,
            instead of a bare state dict for ``model.load_state_dict(..., strict=True)``.
    """
    state = load_model_state(checkpoint_dir)
    payload: dict[str, Any] | dict[str, torch.Tensor] = state
    if lightning:
        metadata = _metadata(checkpoint_dir)
        metadata.pop("galvatron", None)
        payload = {**metadata, MODEL_KEY: state}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, output)
    return output


# ---------------------------------------------------------------------------------------------- Hugging Face
def hf_models(module: nn.Module) -> list[dict[str, Any]]:
    """The Hugging Face models inside ``module`` (outermost only): their prefix, class and config, recorded in the
    checkpoint so that :func:`export_hf` can rebuild them without the LightningModule's code."""
    transformers = sys.modules.get("transformers")  # a model of transformers means it is imported already
    if transformers is None:
        return []
    found: list[dict[str, Any]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, transformers.PreTrainedModel) and not any(_under(name, r["prefix"]) for r in found):
            cls = type(sub)
            found.append(
                {
                    "prefix": name,
                    "class": f"{cls.__module__}:{cls.__qualname__}",
                    "config": json.loads(sub.config.to_json_string(use_diff=False)),
                }
            )
    return found


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


@dataclass(frozen=True)
class HFExport:
    """What :func:`export_hf` wrote."""

    directory: Path
    class_name: str
    prefix: str
    tensors: int


def export_hf(
    checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, config: str | os.PathLike | None = None
) -> HFExport:
    """Write the Hugging Face model of a sharded checkpoint as a directory that ``from_pretrained`` loads.

    The checkpoint records the model's prefix in the LightningModule, class and config when it is saved
    (``GalvatronStrategy`` does); for a checkpoint without that record pass ``config`` (a ``config.json`` or a
    directory holding one): the class is its ``architectures[0]`` and the prefix is found by the names of the
    model's tensors. The model is built on the meta device, given the checkpoint's tensors and saved with
    ``save_pretrained`` (safetensors and ``config.json``).
    """
    try:
        import transformers
    except ImportError:
        raise CheckpointError("--hf needs transformers: pip install 'lightning_galvatron[hf]'") from None

    state = load_model_state(checkpoint_dir)
    if config is not None:
        hf_config = transformers.AutoConfig.from_pretrained(str(config))
        if not hf_config.architectures:
            raise CheckpointError(f"config {str(config)!r} does not name its model class (architectures): add it")
        cls = getattr(transformers, hf_config.architectures[0])
        prefix = _find_prefix(state, cls, hf_config, checkpoint_dir)
    else:
        records = (_metadata(checkpoint_dir).get("galvatron") or {}).get("hf_models") or []
        if len(records) != 1:
            found = (
                "no Hugging Face model"
                if not records
                else f"{len(records)} ({', '.join(r['prefix'] for r in records)})"
            )
            raise CheckpointError(
                f"checkpoint {str(checkpoint_dir)!r} records {found}: pass the model's config (--hf-config "
                "CONFIG.json) to say which model to export"
            )
        (record,) = records
        module_name, _, qualname = record["class"].partition(":")
        cls = _import_class(module_name, qualname)
        hf_config = cls.config_class.from_dict(record["config"])
        prefix = record["prefix"]
    start = len(prefix) + 1 if prefix else 0
    own = {name[start:]: value for name, value in state.items() if _under(name, prefix) and name != prefix}
    with torch.device("meta"):
        model = cls(hf_config)
    missing, unexpected = model.load_state_dict(own, strict=False, assign=True)
    missing = [name for name in missing if name not in _tied_names(model)]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(checkpoint_dir)!r}: the tensors under {prefix or 'the top level'!r} do not make a "
            f"{cls.__name__} (missing {_first(missing)}; unexpected {_first(unexpected)})"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    return HFExport(output_dir, cls.__name__, prefix, len(own))


def _tied_names(model: nn.Module) -> set[str]:
    """Names the model ties to another tensor (its head to the embedding): a checkpoint may hold only one of them."""
    return set(getattr(model, "_tied_weights_keys", None) or ())  # a dict (transformers 5) or a list of names


def _find_prefix(state: dict[str, Any], cls: type, config: Any, checkpoint_dir: Any) -> str:
    with torch.device("meta"):
        expected = list(cls(config).state_dict())
    anchor = expected[0]
    for name in state:
        if name == anchor or name.endswith("." + anchor):
            prefix = name[: -len(anchor)].rstrip(".")
            if all((f"{prefix}.{key}" if prefix else key) in state for key in expected):
                return prefix
    raise CheckpointError(
        f"checkpoint {str(checkpoint_dir)!r} holds no {cls.__name__} of this config (no tensors named like {anchor!r})"
    )


def _import_class(module_name: str, qualname: str) -> type:
    import importlib

    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise CheckpointError(f"cannot import the checkpoint's model class {module_name}:{qualname} ({err})") from None
    return obj
