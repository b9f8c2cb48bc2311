"""On-disk cache of profiles, keyed by what the measurements depend on.

Profiling costs seconds to minutes; the same model on the same kind of cluster gives the same
profile, so it is stored under a key of:

* the model's structure (:func:`model_signature`: block classes and every parameter's name, shape
  and dtype -- not the values, which training changes);
* the precision, the shapes of one sample of the batch (the sequence length);
* the device kind (``cpu``, or the CUDA device name), the backend, the world size and devices per node;
* the profile format version and the torch version (new kernels, new numbers);
* any profiler settings that change the result (batch sizes, degrees).

Files are ``<directory>/<key>.json`` in the profile format, so a cached profile is also a file
``lightning-galvatron search`` accepts. The directory is ``$LIGHTNING_GALVATRON_CACHE`` if set, else
``~/.cache/lightning_galvatron/profiles``. Writes are atomic (a temporary file renamed into place),
so a reader never sees half a file; a file that cannot be read anyway (corrupt, from another
version) is reported with a warning naming it and treated as missing, and the caller profiles again
and overwrites it.

What does not depend on the model -- the interconnect (:func:`~lightning_galvatron.profiler.profile_hardware`)
and the optimizer's per-tensor and per-element costs -- is cached apart, under ``<directory>/clusters/``, keyed by
:func:`cluster_fingerprint` (the device kind, backend, world size, devices per node, the nodes' host names and
the torch version): a new model on the same cluster measures only itself.

A file is not trusted for its name alone: each profile carries its :func:`fingerprint` (what the key is
the digest of), and a cached profile whose fingerprint differs from the live one, or whose content
contradicts the live model (:func:`contradiction`: model name, block count, classes, parameters and hidden
sizes, devices per node) -- a file copied from another machine, edited, or written by another model under this
key -- is reported and measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_galvatron.jsonfile import write_atomically
from lightning_galvatron.profiles import PROFILE_VERSION, HardwareProfile, OptimizerProbe, Profile, ProfileError

ENV_VAR = "LIGHTNING_GALVATRON_CACHE"

#: Cache directories this process could not write, and where it writes instead (``None``: nowhere).
_WRITE_FALLBACKS: dict[Path, Path | None] = {}


def default_cache_dir() -> Path:
    """``$LIGHTNING_GALVATRON_CACHE``, else ``~/.cache/lightning_galvatron/profiles``."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path("~/.cache/lightning_galvatron/profiles").expanduser()


def model_signature(module: Any, structure: Any = None) -> str:
    """A stable description of a model's structure: block classes and parameter names, shapes and dtypes.

    ``structure`` (a :class:`~lightning_galvatron.model.discovery.ModelStructure`) adds which
    containers hold the blocks, so naming other layers as blocks changes the key.
    """
    from lightning_galvatron.profiler.model import block_signature

    description: dict[str, Any] = {
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "parameters": [[name, list(p.shape), str(p.dtype)] for name, p in module.named_parameters()],
    }
    if structure is not None:
        description["block_lists"] = [bl.path for bl in structure.block_lists]
        description["blocks"] = [block_signature(block)[0] for block in structure.blocks]
    return json.dumps(description, sort_keys=True)


def fingerprint(
    model_signature: str,
    *,
    precision: str,
    sample_shapes: Any,
    device_kind: str,
    world_size: int,
    devices_per_node: int | None = None,
    backend: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a profile depends on, as plain JSON (the model as a digest of its signature).

    ``sample_shapes`` is any JSON-able description of one sample (e.g. the shapes and dtypes of the
    batch's tensors without the batch dimension): it carries the sequence length.
    """
    content = {
        "model": hashlib.sha256(model_signature.encode()).hexdigest()[:32],
        "precision": precision,
        "sample": sample_shapes,
        "device": device_kind,
        "world_size": world_size,
        "devices_per_node": devices_per_node,
        "backend": backend,
        "extra": dict(extra or {}),
    }
    return _as_measured_on(content)


def cluster_fingerprint(
    *,
    device_kind: str,
    world_size: int,
    devices_per_node: int,
    backend: str,
    hosts: list[str],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the model-independent measurements depend on, as plain JSON: the cluster's shape and kind and
    its nodes (``hosts``: the host name of every rank, in rank order), the profile format and the torch version."""
    content = {
        "device": device_kind,
        "world_size": world_size,
        "devices_per_node": devices_per_node,
        "backend": backend,
        "hosts": list(hosts),
        "extra": dict(extra or {}),
    }
    return _as_measured_on(content)


def _as_measured_on(content: Mapping[str, Any]) -> dict[str, Any]:
    """``content`` with the profile format and the torch version (new kernels, new numbers), exactly as a JSON file
    gives it back."""
    import torch

    stamped = {**content, "format_version": PROFILE_VERSION, "torch": torch.__version__}
    return json.loads(json.dumps(stamped, sort_keys=True, default=str))


def _digest(content: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


def cache_key(model_signature: str, **what: Any) -> str:
    """The hex digest (32 characters) of the :func:`fingerprint` (same arguments): the cache file's name."""
    return _digest(fingerprint(model_signature, **what))


def contradiction(profile: Profile, structure: Any, devices_per_node: int, model_name: str | None = None) -> str | None:
    """What in ``profile`` contradicts the live model (its name, ``model_name``; its blocks, a
    :class:`~lightning_galvatron.model.discovery.ModelStructure`: count, class, parameters, hidden size) or cluster,
    or ``None``. The key says what a profile was measured on; this reads what it says it measured."""
    from lightning_galvatron.model.discovery import model_class

    model = profile.model
    if model_name is not None and model.name != model_name:
        return f"it describes the model {model.name!r}, not {model_name!r}"
    if len(model.blocks) != structure.num_blocks:
        return f"it describes {len(model.blocks)} blocks but the model has {structure.num_blocks}"
    for index, block in enumerate(structure.blocks):
        layer_type = model.layer_types[model.blocks[index]]
        expected = sum(p.numel() for p in block.parameters())
        if layer_type.parameters != expected:
            return f"its block {index} has {layer_type.parameters} parameters but the model's has {expected}"
        block_class = model_class(block).__name__
        if layer_type.name.split("#")[0] != block_class:
            return f"its block {index} is a {layer_type.name.split('#')[0]}, the model's a {block_class}"
        sizes = {size for p in block.parameters() for size in p.shape}
        for what, hidden in (("block", layer_type.hidden_size), ("model", model.hidden_size)):
            if sizes and hidden not in sizes:
                return f"its {what} hidden size {hidden} is no size of block {index}'s parameters ({sorted(sizes)})"
    if profile.hardware.devices_per_node != devices_per_node:
        return f"it was measured with {profile.hardware.devices_per_node} devices per node, not {devices_per_node}"
    return None


def write_to_cache(root: Path, relative: str, text: str) -> Path | None:
    """Write ``text`` atomically to ``root / relative`` and return where it went. A cache is a hint, never a reason
    to fail: when ``root`` cannot be written (read-only, no permission, full) this process writes to a temporary
    directory instead, with one warning; when that fails too, it caches nothing (``None``)."""
    while (target := _WRITE_FALLBACKS.get(root, root)) is not None:
        try:
            write_atomically(target / relative, text)
            return target / relative
        except OSError as err:
            _WRITE_FALLBACKS[root] = _write_fallback(root, target, err)
    return None


def _write_fallback(root: Path, failed: Path, err: OSError) -> Path | None:
    fallback = None
    if failed == root:
        try:
            fallback = Path(tempfile.mkdtemp(prefix="lightning_galvatron-cache-"))
        except OSError:
            pass
    instead = f"caching in {fallback} for the rest of this run" if fallback is not None else "running without a cache"
    warnings.warn(
        f"cannot write to the profile cache {failed} ({err}); {instead}. Pass profile_cache=<a writable directory> "
        "to keep what is measured for the next run, or profile_cache=False not to cache",
        stacklevel=4,
    )
    return fallback


def cached_file(root: Path, relative: str) -> Path:
    """Where to read ``root / relative``: this process's fallback copy if it wrote one (``root`` was not writable)."""
    fallback = _WRITE_FALLBACKS.get(root)
    return fallback / relative if fallback is not None and (fallback / relative).is_file() else root / relative


class ProfileCache:
    """Profiles on disk, one JSON file per key. ``directory=None``: :func:`default_cache_dir`."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()

    def path(self, key: str) -> Path:
        if not key or not all(c.isalnum() or c in "-_" for c in key):
            raise ValueError(f"a cache key is letters, digits, '-' and '_', got {key!r}")
        return self.directory / f"{key}.json"

    def load(self, key: str, fingerprint: Mapping[str, Any] | None = None) -> Profile | None:
        """The cached profile, or ``None`` if there is none, it cannot be read or it was measured on something
        other than ``fingerprint`` describes (with a warning naming the file)."""
        path = cached_file(self.directory, self.path(key).name)
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError):  # not cached (a file where the cache should be: see save)
            return None
        except OSError as err:
            warnings.warn(f"cannot read the cached profile {path}: {err}; profiling again", stacklevel=2)
            return None
        try:
            profile = Profile.from_json(text)
        except (ProfileError, TypeError, ValueError) as err:
            warnings.warn(
                f"ignoring the corrupt cached profile {path} ({err}); profiling again and overwriting it", stacklevel=2
            )
            return None
        if fingerprint is not None and profile.fingerprint != fingerprint:
            stored = profile.fingerprint
            if stored is None:
                reason = "it does not say what it was measured on (no fingerprint)"
            else:
                differ = sorted(k for k in {*fingerprint, *stored} if stored.get(k) != fingerprint.get(k))
                reason = f"it was measured on another model or cluster (its fingerprint differs in {', '.join(differ)})"
            warnings.warn(
                f"ignoring the cached profile {path}: {reason}; profiling again and overwriting it", stacklevel=2
            )
            return None
        return profile

    def save(self, key: str, profile: Profile) -> Path | None:
        """Write atomically (a temporary file in the same directory, renamed over the target); where it went
        (see :func:`write_to_cache`)."""
        return write_to_cache(self.directory, self.path(key).name, profile.to_json() + "\n")

    def cluster_path(self, fingerprint: Mapping[str, Any]) -> Path:
        return self.directory / self._cluster_file(fingerprint)

    @staticmethod
    def _cluster_file(fingerprint: Mapping[str, Any]) -> str:
        return f"clusters/{_digest(fingerprint)}.json"

    def load_cluster(self, fingerprint: Mapping[str, Any]) -> tuple[HardwareProfile, tuple[OptimizerProbe, ...]] | None:
        """The hardware profile and optimizer probes measured on the cluster ``fingerprint`` (a
        :func:`cluster_fingerprint`) describes, or ``None`` (with a warning when a file is there but unusable)."""
        path = cached_file(self.directory, self._cluster_file(fingerprint))
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("fingerprint") != dict(fingerprint):
                raise ProfileError("it was measured on another cluster (its fingerprint differs)")
            optimizer = data.get("optimizer")
            if not isinstance(optimizer, list) or not optimizer:
                raise ProfileError("it has no optimizer probes")
            return (
                HardwareProfile.from_dict(data.get("hardware")),
                tuple(OptimizerProbe.from_dict(o, f"optimizer[{i}]") for i, o in enumerate(optimizer)),
            )
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ProfileError, TypeError, ValueError) as err:
            warnings.warn(f"ignoring the cached cluster measurements {path} ({err}); measuring again", stacklevel=2)
            return None

    def save_cluster(
        self, fingerprint: Mapping[str, Any], hardware: HardwareProfile, optimizer: tuple[OptimizerProbe, ...]
    ) -> Path | None:
        """Store what :meth:`load_cluster` returns (atomically, as :meth:`save`)."""
        content = {
            "fingerprint": dict(fingerprint),
            "hardware": hardware.to_dict(),
            "optimizer": [o.to_dict() for o in optimizer],
        }
        text = json.dumps(content, indent=1, sort_keys=True) + "\n"
        return write_to_cache(self.directory, self._cluster_file(fingerprint), text)


__all__ = [
    "ENV_VAR",
    "ProfileCache",
    "cache_key",
    "cluster_fingerprint",
    "contradiction",
    "default_cache_dir",
    "fingerprint",
    "model_signature",
    "write_to_cache",
]
