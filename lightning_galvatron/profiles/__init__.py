"""The profile: everything the search needs to know about a model and a cluster, as versioned JSON.

A :class:`Profile` has two halves:

* :class:`ModelProfile` -- the Transformer: one or more :class:`LayerTypeProfile` (most models have
  one block type, encoder-decoder models two), the block sequence (a layer-type index per block)
  and the embedding/head (:class:`VocabProfile`). Per layer type: parameter count, shape
  (heads, hidden, FFN, sequence) for the divisibility rules, forward time as a linear fit of the
  local batch size, and activation bytes per sample for each tensor/sequence-parallel degree and
  with recomputation.
* :class:`HardwareProfile` -- the devices: memory, a fixed per-device overhead, the overlap
  coefficient of computation with communication and one :class:`CollectiveFit` per measured
  (collective, group size, ranks per node): ``time = latency + volume * bytes / bandwidth``.

Units are SI throughout: seconds, bytes, bytes per second. Parameters are counted in elements
(their bytes follow from the precision the search is asked about); activations are bytes in the
profiled compute dtype (``ModelProfile.activation_dtype_bytes``).

Bandwidths follow the NCCL-tests "bus bandwidth" convention, so one number per group describes
every collective: a collective of ``bytes`` (the full, unsharded tensor) over ``g`` ranks moves
``volume(kind, g) * bytes`` per rank, with ``volume`` = ``2(g-1)/g`` for all-reduce,
``(g-1)/g`` for all-gather, reduce-scatter and all-to-all, and 1 for point-to-point.

The layout of a group is described by ``ranks_per_node``: how many of its ranks share a node
(``== group_size`` for a group inside one node). This is what decides its bandwidth, and unlike a
"consecutive" flag it means the same thing whatever the size of the cluster it was measured on.

Shape of the JSON (version 1; every key is a field of the dataclass of the same name)::

    {"format": "lightning_galvatron.profile", "version": 1, "source": "...", "fingerprint": {...} (optional),
     "model": {"name": "llama2-7b", "hidden_size": 4096, "seq_length": 2048, "activation_dtype_bytes": 2,
               "layer_types": [{"name": "decoder", "parameters": 202383360, "hidden_size": 4096,
                                "num_heads": 32, "ffn_hidden_size": 11008, "seq_length": 2048,
                                "forward_time": {"intercept_s": 0.0008, "per_sample_s": 0.0039},
                                "activation_bytes_per_sample": {"1": 5.4e8, "2": 2.9e8, "4": 1.4e8, "8": 7.2e7},
                                "recompute_activation_bytes_per_sample": 3.4e7, ...}],
               "blocks": [0, 0, ...], "precision": "bf16-mixed" (optional),
               "vocab": {"vocab_size": 32000, "embedding_parameters": ..., "head_parameters": ..., ...}},
     "hardware": {"name": "...", "devices_per_node": 8, "overlap_coefficient": 1.13, "device_type": "cuda" (optional),
                  "device_memory_bytes": null, "memory_overhead_bytes": 0,
                  "collectives": [{"kind": "all_reduce", "group_size": 8, "ranks_per_node": 8,
                                   "latency_s": 8.6e-05, "bandwidth_bytes_per_s": 1.6e11}, ...]},
     "overheads": {...} (optional: per-call costs, see :mod:`.overheads`)}

A reader refuses unknown keys, missing required keys and newer versions, naming the path of the
offending entry. Profilers fill it naturally: time a block at two or more batch sizes and
:meth:`LinearFit.fit`; count activation bytes per degree; sweep message sizes per group and
:meth:`CollectiveFit.fit`.

The parts: :mod:`.fields` (fits, per-degree tables, the reader's checks), :mod:`.model` and
:mod:`.hardware` (the two halves); this module holds the whole and its JSON file.

The package is torch-free: the offline search and the torch profilers both use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_galvatron.jsonfile import read_json_object
from lightning_galvatron.profiles.fields import DegreeTable, LinearFit, ProfileError
from lightning_galvatron.profiles.hardware import (
    COLLECTIVE_KINDS,
    CollectiveFit,
    HardwareProfile,
    bus_volume,
    lookup_collective,
)
from lightning_galvatron.profiles.model import LayerTypeProfile, ModelProfile, VocabProfile
from lightning_galvatron.profiles.overheads import CallProbe, OptimizerProbe, Overheads, PipelineProbe, ReductionProbe

PROFILE_FORMAT = "lightning_galvatron.profile"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class Profile:
    """A model on a kind of hardware: the search's whole input besides world size and budget."""

    model: ModelProfile
    hardware: HardwareProfile
    source: str = ""
    fingerprint: Mapping[str, Any] | None = None  # what it was measured on (profiler.cache.fingerprint); optional
    overheads: Overheads | None = None  # per-call costs measured with it (profiles.overheads); optional

    def __post_init__(self) -> None:
        if self.overheads is not None:
            self.overheads.check(len(self.model.layer_types))

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "source": self.source,
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
        }
        if self.fingerprint is not None:
            out["fingerprint"] = dict(self.fingerprint)
        if self.overheads is not None:
            out["overheads"] = self.overheads.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, Mapping):
            raise ProfileError("a profile must be a JSON object")
        if data.get("format") != PROFILE_FORMAT:
            hint = ""
            if any(str(k).startswith(("layertype_", "layernum", "allreduce_size_")) for k in data):
                hint = (
                    " (this looks like a Hetu-Galvatron profile file: convert the directory with "
                    "`lightning-galvatron import-galvatron`)"
                )
            raise ProfileError(f"not a lightning_galvatron profile: format={data.get('format')!r}{hint}")
        version = data.get("version")
        if not isinstance(version, int) or version < 1:
            raise ProfileError(f"profile version must be a positive integer, got {version!r}")
        if version > PROFILE_VERSION:
            raise ProfileError(
                f"profile format version {version} is newer than this lightning_galvatron understands "
                f"({PROFILE_VERSION}); upgrade the package"
            )
        unknown = set(data) - {"format", "version", "source", "model", "hardware", "fingerprint", "overheads"}
        if unknown:
            raise ProfileError(
                f"unknown profile keys {sorted(unknown)}; known: format, version, source, model, hardware, "
                "fingerprint, overheads"
            )
        for key in ("model", "hardware"):
            if key not in data:
                raise ProfileError(f"the profile lacks its {key!r} section")
        fingerprint = data.get("fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, Mapping):
            raise ProfileError(f"the profile's fingerprint must be a JSON object, got {type(fingerprint).__name__}")
        return cls(
            model=ModelProfile.from_dict(data["model"]),
            hardware=HardwareProfile.from_dict(data["hardware"]),
            source=str(data.get("source", "")),
            fingerprint=None if fingerprint is None else dict(fingerprint),
            overheads=None if data.get("overheads") is None else Overheads.from_dict(data["overheads"]),
        )

    @property
    def measured_precision(self) -> str | None:
        """The precision the blocks were measured in (recorded in the model part, else in the fingerprint)."""
        return self.model.precision or (self.fingerprint or {}).get("precision")

    @property
    def device_type(self) -> str | None:
        """The kind of device measured (``cuda``, ``cpu``): recorded in the hardware part, else in the fingerprint."""
        if self.hardware.device_type:
            return self.hardware.device_type
        device = (self.fingerprint or {}).get("device")  # torch's device type, or the name of a CUDA device
        if not device:
            return None
        return device if device in ("cpu", "mps", "xpu", "meta") else "cuda"

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise ProfileError(f"profile is not valid JSON: {err}") from None

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        data = read_json_object(path, "profile file", ProfileError)
        try:
            return cls.from_dict(data)
        except ProfileError as err:
            raise ProfileError(f"profile file {str(path)!r}: {err}") from None

    def with_num_blocks(self, num_blocks: int) -> Profile:
        return dataclasses.replace(self, model=self.model.with_num_blocks(num_blocks))


def load_profile(source: Profile | Mapping[str, Any] | str | os.PathLike) -> Profile:
    """Accept a :class:`Profile`, its dict, or a path to its JSON file."""
    if isinstance(source, Profile):
        return source
    if isinstance(source, Mapping):
        return Profile.from_dict(source)
    if isinstance(source, (str, os.PathLike)):
        return Profile.load(source)
    raise ProfileError(f"expected a Profile, a dict or a path, got {type(source).__name__}")


__all__ = [
    "COLLECTIVE_KINDS",
    "CallProbe",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "CollectiveFit",
    "DegreeTable",
    "HardwareProfile",
    "LayerTypeProfile",
    "LinearFit",
    "ModelProfile",
    "OptimizerProbe",
    "Overheads",
    "PipelineProbe",
    "Profile",
    "ProfileError",
    "ReductionProbe",
    "VocabProfile",
    "bus_volume",
    "load_profile",
    "lookup_collective",
]
