"""Sharded checkpoint directories that are whole or absent, whenever the job is killed.

A sharded checkpoint is a directory every rank writes into: its shard files, DCP's ``.metadata`` index (written
last, by the coordinator) and Lightning's ``meta.pt`` (rank 0). Written in place -- as ``ModelCheckpoint(save_last=
True)`` rewrites ``last.ckpt`` at every save -- a save killed midway leaves the previous save's index beside
half-written shards: neither the old state nor the new one, and the old one is gone. So a save is staged:

1. :func:`begin_save` (rank 0): a fresh hidden sibling ``.NAME.partial`` (what killed saves left is removed);
2. every rank writes its shards into it, DCP's coordinator its index (DCP fsyncs each file);
3. :func:`write_loop_state` (rank 0): ``meta.pt``, recording the index's save id, fsynced;
4. :func:`commit` (rank 0): the staged directory takes the checkpoint's name -- in one step where the file system
   can exchange two names (``renameat2(RENAME_EXCHANGE)``, Linux), so the name always holds a complete checkpoint;
   elsewhere the previous one is renamed aside (``.NAME.replaced``) first, and a job killed between the two
   renames resumes from it (:func:`committed_path`) -- and only then is the previous checkpoint deleted.

:func:`remove_checkpoint` (``save_top_k`` rotation) renames a checkpoint to a hidden name before deleting it, so a
deletion killed midway never leaves a half checkpoint under a checkpoint's name. Hidden names match neither
``ModelCheckpoint``'s ``*.ckpt`` nor ``ckpt_path="last"``'s ``last*.ckpt``: what those find is always complete.

A full checkpoint file (``save_distributed_checkpoint=False`` under Fabric, :func:`save_file`) is staged and
committed the same way: written whole and flushed under the hidden name, then renamed into place.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

METADATA_FILE = "meta.pt"  # what Lightning's ModelParallelStrategy writes next to the shards
DCP_INDEX_FILE = ".metadata"  # what DCP writes last, once every shard is on disk
STAGING_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
REMOVING_SUFFIX = ".removing"


def hidden_sibling(path: Path, suffix: str) -> Path:
    """``DIR/.NAME<suffix>``: next to ``path`` (the same file system, so renames are atomic), never a checkpoint's
    name."""
    return path.with_name(f".{path.name}{suffix}")


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, rank: int, barrier: Callable[[], None]) -> None:
    """Save Lightning's ``checkpoint`` as a sharded (DCP) directory at ``path``, atomically (module docstring).

    Collective: every rank calls it with the same ``path``; the model and optimizer states go to the shards, the
    rest (loops, callbacks, hyper-parameters) to ``meta.pt``, as Lightning's ``ModelParallelStrategy`` lays them out.
    """
    from torch.distributed.checkpoint import save as dcp_save

    path = Path(path)
    refuse_to_replace_other_directories(path)  # every rank: the same answer from the same file system
    staging = begin_save(path) if rank == 0 else hidden_sibling(path, STAGING_SUFFIX)
    barrier()  # no rank writes before the staging directory is fresh
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp_save(state, checkpoint_id=staging)  # returns once every rank's shards and the index are written
    if rank == 0:
        write_loop_state(checkpoint, staging)
        commit(staging, path)


def refuse_to_replace_other_directories(path: Path) -> None:
    """A save replaces what is at ``path``: refuse a directory that holds files but no checkpoint (Lightning's
    in-place writer kept them; replacing would delete them)."""
    if not path.is_dir() or path.is_symlink() or not any(path.iterdir()):
        return
    if not any((path / name).exists() for name in (METADATA_FILE, DCP_INDEX_FILE)) and not any(path.glob("*.distcp")):
        raise FileExistsError(
            f"cannot save a checkpoint to {str(path)!r}: it is a directory that holds other files than a "
            "checkpoint's, which replacing it would delete; save to another path"
        )


def save_file(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Rank 0: ``checkpoint`` as one ``torch.save`` file at ``path``, whole or absent whenever the job is killed:
    written under the staging name, flushed to the disk, then committed as a sharded save is (:func:`commit`)."""
    path = Path(path)
    refuse_to_replace_other_directories(path)
    staging = begin_save(path, directory=False)
    with open(staging, "wb") as file:
        torch.save(checkpoint, file)
        file.flush()
        os.fsync(file.fileno())
    commit(staging, path)


def begin_save(path: Path, directory: bool = True) -> Path:
    """Rank 0, before any rank writes: put back a checkpoint an interrupted replace left aside, clear what killed
    saves and deletions left, and make the empty staging directory (a file's staging name is only cleared)."""
    aside = hidden_sibling(path, REPLACED_SUFFIX)
    if os.path.lexists(aside) and not os.path.lexists(path):
        os.rename(aside, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(f".*{REMOVING_SUFFIX}"):
        remove_path(leftover)
    staging = hidden_sibling(path, STAGING_SUFFIX)
    remove_path(staging)
    if directory:
        staging.mkdir()
    return staging


def write_loop_state(checkpoint: dict[str, Any], directory: Path) -> None:
    """Rank 0, after every shard and the index are written: ``meta.pt``, with the index's save id (so a loader can
    tell it belongs to these shards), flushed to the disk."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(directory)).read_metadata().storage_meta
    checkpoint.setdefault("galvatron", {})["save_id"] = getattr(storage, "save_id", None)
    with open(directory / METADATA_FILE, "wb") as file:
        torch.save(checkpoint, file)
        file.flush()
        os.fsync(file.fileno())


def commit(staging: Path, path: Path) -> None:
    """Rank 0: the complete ``staging`` directory (or flushed file) becomes ``path``; the checkpoint there before is
    deleted after."""
    if staging.is_dir():
        fsync_directory(staging)
    if not os.path.lexists(path):
        os.rename(staging, path)
    elif exchange(staging, path):
        fsync_directory(path.parent)
        remove_path(staging)  # the previous checkpoint, now under the staging name
    else:
        aside = hidden_sibling(path, REPLACED_SUFFIX)
        remove_path(aside)
        os.rename(path, aside)
        os.rename(staging, path)
        fsync_directory(path.parent)
        remove_path(aside)
    fsync_directory(path.parent)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint (directory, file or link) so that its name never holds a half-deleted one."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    doomed = hidden_sibling(path, REMOVING_SUFFIX)
    remove_path(doomed)
    os.rename(path, doomed)
    fsync_directory(path.parent)
    remove_path(doomed)


def committed_path(path: Path) -> Path:
    """``path``, or the previous checkpoint a replace killed between its two renames left aside (file systems
    without an atomic exchange): what was last complete under that name."""
    aside = hidden_sibling(path, REPLACED_SUFFIX)
    return aside if not os.path.lexists(path) and os.path.lexists(aside) else path


def remove_path(path: Path) -> None:
    """Remove a file, a link (not its target) or a directory tree; nothing if absent."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def fsync_directory(directory: Path) -> None:
    """Make the directory's entries (created, renamed files) durable; a no-op where directories cannot be opened."""
    if sys.platform == "win32":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that do not sync directories
            raise
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing names in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the
    platform or file system cannot (then nothing changed)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, f"cannot exchange {first} and {second}: {os.strerror(code)}")


def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+, musl 1.2.2+
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function
