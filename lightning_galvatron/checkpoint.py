"""Checkpoints: sharded ones to one file (``lightning-galvatron consolidate CKPT_DIR -o model.pt``), and resuming
plans whose parameters are all whole tensors.

``GalvatronStrategy`` saves Lightning checkpoints as DCP directories (one shard file per rank plus
``meta.pt`` with Lightning's metadata). Parameter names are those of the plain model whatever the
plan, so the shards assemble into the unparallelised model's state dict. (Lightning's own
``consolidate_checkpoint`` expects another layout of this format and fails on it.)

Lightning's ``ModelParallelStrategy`` loads checkpoints only into models with DTensor parameters; a
plan without sharding or tensor parallelism (DDP everywhere, or one device) holds plain tensors and
is loaded by :func:`load_whole_parameters` instead, from either format.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType
from torch.optim import Optimizer

_METADATA_FILE = "meta.pt"  # what Lightning's ModelParallelStrategy writes next to the shards


def load_model_state(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint, assembled in this process (no process group)."""
    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a sharded (DCP) checkpoint directory: it has no .metadata file")
    return dict(_load_state_dict_from_keys({"state_dict"}, checkpoint_id=str(path))["state_dict"])


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
        meta_file = Path(checkpoint_dir) / _METADATA_FILE
        metadata = torch.load(meta_file, weights_only=False) if meta_file.is_file() else {}
        metadata.pop("galvatron", None)
        payload = {**metadata, "state_dict": state}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, output)
    return output


def load_whole_parameters(
    path: str | os.PathLike, module: nn.Module, optimizers: list[Optimizer], strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load a Lightning checkpoint of this strategy (a DCP directory or one file) into ``module`` and its
    optimizers when no parameter is a DTensor; return Lightning's remaining metadata (loops, callbacks, ...)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        model_state = {"state_dict": get_model_state_dict(module)}
        dcp.load(model_state, checkpoint_id=str(path))
        set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict))
        for index, optimizer in enumerate(optimizers):
            key = f"optimizer_{index}"  # how Lightning's ModelParallelStrategy names them
            optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp.load(optimizer_state, checkpoint_id=str(path))
            set_optimizer_state_dict(module, optimizer, optimizer_state[key])
        return torch.load(path / _METADATA_FILE, weights_only=weights_only)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is neither a sharded checkpoint directory nor a checkpoint file")
    checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
    full = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=full)
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        if state.get("state") and isinstance(next(iter(state["state"])), int):  # saved keyed by parameter index
            state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, module)
        set_optimizer_state_dict(module, optimizer, state, options=full)
    return checkpoint
