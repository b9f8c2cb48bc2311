"""Checkpoints of ``GalvatronStrategy``: resume into any plan, and sharded checkpoints to one file.

``GalvatronStrategy`` saves Lightning checkpoints as DCP directories (one shard file per rank, DCP's
``.metadata`` index, and ``meta.pt`` with Lightning's loop state). Parameter names are those of the
plain model whatever the plan, so a checkpoint loads into any other plan or world size
(:func:`load_checkpoint`, what ``Trainer.fit(ckpt_path=...)`` runs) and assembles into the
unparallelised model's state dict (:func:`consolidate`, ``lightning-galvatron consolidate CKPT_DIR -o
model.pt``).

Lightning's own loader (``ModelParallelStrategy.load_checkpoint``) needs a model with at least one
DTensor parameter, so it cannot resume a plan of plain DDP blocks; and DCP stores the optimizer's
parameter groups of one rank only, which under a pipeline name another stage's parameters, so their
hyper-parameters would not be restored on the other stages. :func:`load_checkpoint` uses DCP's public
state-dict API for every plan and matches parameter groups by position, as
``torch.optim.Optimizer.load_state_dict`` does. (Lightning's ``consolidate_checkpoint`` expects another
layout of this format and fails on it.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

METADATA_FILE = "meta.pt"  # what Lightning's ModelParallelStrategy writes next to the shards
DCP_INDEX_FILE = ".metadata"  # what DCP writes last, once every shard is on disk
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
                f"{str(path)!r} is not a sharded (DCP) checkpoint directory: it has no {DCP_INDEX_FILE}, no shard files "
                f"and no {METADATA_FILE}"
            )
        found = f"it holds {len(shards)} shard file(s) but" if shards else "it"
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} is incomplete: {found} has no {DCP_INDEX_FILE} file, which DCP writes "
            "last -- the save that wrote it was interrupted; resume from an earlier checkpoint"
        )
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a truncated or foreign index: say which file
        raise CheckpointError(f"cannot read {str(path / DCP_INDEX_FILE)!r} ({type(err).__name__}: {err})") from None


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
    path = Path(path)
    if path.is_file():
        return _load_full(path, model, optimizers, strict=strict, weights_only=weights_only)
    index = check_sharded_checkpoint(path)
    if not (path / METADATA_FILE).is_file():
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} is incomplete: it has no {METADATA_FILE} (Lightning's loop state, "
            "written after the shards) -- the save that wrote it was interrupted; resume from an earlier checkpoint"
        )
    saved = set(index.state_dict_metadata)
    _load_model(path, model, saved, strict)
    for number, optimizer in enumerate(optimizers):
        _load_optimizer(path, model, optimizer, f"optimizer_{number}", saved, strict)
    try:
        return torch.load(path / METADATA_FILE, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - say which file
        raise CheckpointError(f"cannot read {str(path / METADATA_FILE)!r} ({type(err).__name__}: {err})") from None


def _load_model(path: Path, model: nn.Module, saved: set[str], strict: bool) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    missing = sorted(name for name in state if f"{MODEL_KEY}.{name}" not in saved)
    if missing and strict:
        raise CheckpointError(
            f"checkpoint {str(path)!r} lacks {len(missing)} of this model's tensors ({_first(missing)}): it was saved "
            "from another model; load it into that model, or set the LightningModule's strict_loading = False"
        )
    state = {name: value for name, value in state.items() if name not in missing}
    holder = {MODEL_KEY: state}
    dcp_load(holder, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(model, holder[MODEL_KEY], options=StateDictOptions(strict=False))


def _load_optimizer(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, key: str, saved: set[str], strict: bool) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if not any(name.startswith(f"{key}.") for name in saved):
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no state for optimizer {key[len('optimizer_'):]} (saved with "
            "save_weights_only=True, or with fewer optimizers): it can initialise a model but not resume its training"
        )
    state = get_optimizer_state_dict(model, optimizer)
    own_groups = [list(group["params"]) for group in state["param_groups"]]
    holder = {key: state}
    dcp_load(holder, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=not strict))
    loaded = holder[key]
    if len(loaded["param_groups"]) != len(own_groups):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: optimizer {key[len('optimizer_'):]} has {len(own_groups)} parameter groups but "
            f"the checkpoint's has {len(loaded['param_groups'])}; configure_optimizers must build the same groups"
        )
    for group, params in zip(loaded["param_groups"], own_groups):
        group["params"] = params  # one rank's names were stored; hyper-parameters are the same on every rank
    set_optimizer_state_dict(model, optimizer, loaded, options=StateDictOptions(strict=strict))


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


def load_model_state(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint, assembled in this process (no process group)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    check_sharded_checkpoint(checkpoint_dir)
    return dict(_load_state_dict_from_keys({MODEL_KEY}, checkpoint_id=str(checkpoint_dir))[MODEL_KEY])


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
        meta_file = Path(checkpoint_dir) / METADATA_FILE
        metadata = torch.load(meta_file, weights_only=False) if meta_file.is_file() else {}
        metadata.pop("galvatron", None)
        payload = {**metadata, MODEL_KEY: state}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, output)
    return output
