"""Sharded checkpoints to one file: ``lightning-galvatron consolidate CKPT_DIR -o model.pt``.

``GalvatronStrategy`` saves Lightning checkpoints as DCP directories (one shard file per rank plus
``meta.pt`` with Lightning's metadata). Parameter names are those of the plain model whatever the
plan, so the shards assemble into the unparallelised model's state dict. (Lightning's own
``consolidate_checkpoint`` expects another layout of this format and fails on it.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

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
