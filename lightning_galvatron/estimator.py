"""Will it fit, and how? The plan and its memory and time for a cluster you do not have.

``lightning-galvatron estimate --hf-config CONFIG.json --world-size 64 --memory-budget 80GB --seq-length 4096
--hardware PROFILE`` (or ``--model MODULE:CLASS``) runs the plan search on an analytic profile of the model
(:mod:`lightning_galvatron.producers.analytic`: exact shapes, compute and activation bytes scaled from a
measured reference profile) with the hardware profile's interconnect, and answers before anything is
launched. From Python: :func:`estimate_cluster`.

Where the numbers come from:

* the model: a Hugging Face ``config.json`` (Llama-style decoders, GPT-2 and BERT-style encoders are
  counted from the config alone; other architectures are built on the meta device with
  ``transformers``), or a module class built on the meta device (nothing is allocated);
* the hardware: ``--hardware PROFILE``, a profile JSON (written by ``lightning-galvatron profile`` on
  the target kind of machine, or converted with ``import-galvatron``) or the name of a reference profile
  shipped with the package (:mod:`lightning_galvatron.reference_profiles`, e.g. ``a100``); its collectives,
  overlap coefficient and memory overhead are used as they are;
* the calibration: the measured blocks of ``--reference PROFILE`` (default: the hardware profile's own
  model part, measured on that hardware). Without ``--hardware`` the newest profile of the asked kind of
  device in the local profile cache serves as both.

It never extrapolates silently: the report names the profiles, a profile of another kind of device than the
question's (``--accelerator``, default ``cuda``) is refused unless ``--allow-other-device`` says otherwise, and
a block whose forward FLOPs are more than :data:`EXTRAPOLATION_WARNING` times (or less than its inverse) the
measured block's is reported as an extrapolation: kernel efficiency does not scale with FLOPs over such ranges.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_galvatron.jsonfile import read_json_object
from lightning_galvatron.producers.analytic import (
    ArchitectureShape,
    Scaling,
    analytic_profile,
    architecture_from_hf_config,
)
from lightning_galvatron.profiles import HardwareProfile, Profile, ProfileError, load_profile
from lightning_galvatron.units import format_bytes, parse_bytes

# Per-block FLOPs of decoder models from 1B to 70B parameters differ from a 7B block's by less than this factor;
# beyond it the measured block says little about the kernels' efficiency (small blocks underuse a GPU).
EXTRAPOLATION_WARNING = 10.0


@dataclass(frozen=True)
class ClusterEstimate:
    """The answer: the profile the search used, how it was scaled, and the search's result or why nothing fits."""

    architecture: ArchitectureShape
    profile: Profile
    scalings: tuple[Scaling, ...]
    world_size: int
    memory_budget_bytes: int
    seq_length: int
    result: Any | None = None  # SearchResult when a plan fits
    smallest_budget_bytes: int | None = None  # when nothing fits
    error: str | None = None
    seconds: float = 0.0
    sources: Mapping[str, str] = field(default_factory=dict)
    precision: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.result is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.architecture.name,
            "parameters": self.architecture.parameters,
            "seq_length": self.seq_length,
            "world_size": self.world_size,
            "memory_budget_bytes": self.memory_budget_bytes,
            "fits": self.fits,
            "seconds": self.seconds,
            "scaling": [vars(s) for s in self.scalings],
            "sources": dict(self.sources),
            "precision": self.precision,
            "warnings": list(self.warnings),
        }
        if self.result is not None:
            out["search"] = self.result.to_dict()
        else:
            out["smallest_budget_bytes"] = self.smallest_budget_bytes
            out["error"] = self.error
        return out


def estimate_cluster(
    architecture: ArchitectureShape,
    world_size: int,
    memory_per_device: int | str | None,
    *,
    hardware: Profile | str,
    reference: Profile | str | None = None,
    seq_length: int | None = None,
    sources: Mapping[str, str] | None = None,
    device_type: str | None = None,
    allow_other_device: bool = False,
    precision: str | None = None,
    **search_options: Any,
) -> ClusterEstimate:
    """Search the best plan for ``architecture`` on ``world_size`` devices of ``memory_per_device``.

    ``hardware``: a profile whose hardware part describes the cluster; ``reference``: the profile whose
    measured blocks calibrate compute and activations (default: ``hardware``'s). ``device_type``: the kind of
    device asked about (``cuda``, ``cpu``; default: the hardware profile's); a profile measured on another kind
    is refused unless ``allow_other_device``. ``precision``: default the reference's measured precision.
    ``search_options`` go to :func:`lightning_galvatron.search.search`: ``global_batch_size``, ``optimizer`` and
    ``options`` (its knobs, a :class:`~lightning_galvatron.search.options.SearchOptions`) or knobs by name.
    """
    from lightning_galvatron.search import InfeasibleBudgetError, search

    started = time.perf_counter()
    hardware_profile = load_profile(hardware)
    reference_profile = load_profile(reference) if reference is not None else hardware_profile
    names = dict(sources or {})
    checked = {f"the hardware profile {names.get('hardware', '')}".rstrip(): hardware_profile}
    if reference_profile is not hardware_profile:
        checked[f"the reference profile {names.get('reference', '')}".rstrip()] = reference_profile
    warnings = check_device_types(device_type or hardware_profile.device_type, checked, allow_other_device)
    precision = precision or reference_profile.measured_precision or "bf16-mixed"
    seq = seq_length or architecture.default_seq_length
    if not seq:
        raise ValueError("the sequence length is not known from the model: pass --seq-length")
    budget = memory_per_device if memory_per_device is not None else hardware_profile.hardware.device_memory_bytes
    if budget is None:
        raise ValueError("the hardware profile does not say the device memory: pass --memory-budget, e.g. 80GB")
    budget = parse_bytes(budget)
    profile, scalings = analytic_profile(architecture, reference_profile, seq, hardware_profile.hardware)
    warnings += extrapolation_warnings(scalings, names.get("reference", "the reference profile"))
    common = dict(
        architecture=architecture,
        profile=profile,
        scalings=tuple(scalings),
        world_size=world_size,
        memory_budget_bytes=budget,
        seq_length=seq,
        sources=names,
        precision=precision,
        warnings=tuple(warnings),
    )
    try:
        result = search(profile, world_size, budget, precision=precision, **search_options)
    except InfeasibleBudgetError as error:
        return ClusterEstimate(
            **common,
            smallest_budget_bytes=error.smallest_budget_bytes,
            error=str(error),
            seconds=time.perf_counter() - started,
        )
    return ClusterEstimate(**common, result=result, seconds=time.perf_counter() - started)


def check_device_types(device_type: str | None, profiles: Mapping[str, Profile], allow_other_device: bool) -> list[str]:
    """Refuse (``ValueError``) a profile measured on another kind of device than ``device_type``; return warnings
    for profiles that do not say (and, with ``allow_other_device``, for the mismatches let through)."""
    warnings = []
    for name, profile in profiles.items():
        measured = profile.device_type
        if measured is None:
            warnings.append(
                f"{name} does not record the kind of device it was measured on; its times are taken as "
                f"those of {device_type or 'the devices asked about'}"
            )
        elif device_type is not None and measured != device_type:
            message = (
                f"{name} was measured on {measured} devices but the question is about {device_type} devices: its "
                f"times and bandwidths would be those of {measured}"
            )
            if not allow_other_device:
                raise ValueError(
                    f"{message}. Pass --hardware with a profile of {device_type} devices (shipped: "
                    f"{_reference_names()}; or one written by `lightning-galvatron profile` on them), --accelerator "
                    f"{measured} to ask about {measured} devices, or --allow-other-device to use it anyway"
                )
            warnings.append(message)
    return warnings


def extrapolation_warnings(scalings: Sequence[Scaling], reference: str) -> list[str]:
    """One warning per block type whose forward FLOPs are far from the measured block's."""
    out = []
    for s in scalings:
        if s.time_ratio > EXTRAPOLATION_WARNING or s.time_ratio < 1 / EXTRAPOLATION_WARNING:
            out.append(
                f"{s.layer_type}: forward time extrapolated x{s.time_ratio:.3g} in FLOPs from the measured block "
                f"{s.reference!r} of {reference}; kernel efficiency does not scale with FLOPs over such a range, so "
                "times are rough: use a reference profile (--reference) measured on a model of similar size"
            )
    return out


def _reference_names() -> str:
    from lightning_galvatron import reference_profiles

    return reference_profiles.describe()


# ---------------------------------------------------------------------------------------------- model sources
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
    from lightning_galvatron.profiler.command import load_class

    cls = load_class(path)
    with torch.device("meta"):
        module = cls(**dict(init_args or {}))
    seq = _seq_length_of(module)
    return architecture_of_module(module, layers=layers, name=cls.__name__, default_seq_length=seq)


def _seq_length_of(module: Any) -> int | None:
    hparams = getattr(module, "hparams", None)
    for source in (hparams, module):
        for name in ("seq_length", "max_seq_length", "block_size"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int):
                return value
    return None


def newest_cached_profile(device_type: str | None = None) -> Path:
    """The most recently written profile (of ``device_type`` devices) in the local profile cache."""
    from lightning_galvatron.profiler.cache import default_cache_dir

    directory = default_cache_dir()
    files = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    others = []
    for file in reversed(files):
        try:
            measured = Profile.load(file).device_type
        except ProfileError:
            continue
        if device_type is None or measured == device_type:
            return file
        others.append(f"{file.name} ({measured or 'unknown device'})")
    found = f"only profiles of other devices: {', '.join(others[:3])}" if others else "none"
    raise ValueError(
        f"no --hardware profile given and no profile of {device_type or 'any'} devices in the local profile cache "
        f"({directory}; {found}): pass --hardware with a reference profile shipped with the package "
        f"({_reference_names()}) or a profile written by `lightning-galvatron profile` on the target kind of machine "
        "(or converted with `lightning-galvatron import-galvatron`)"
    )


# ---------------------------------------------------------------------------------------------- report
def describe(estimate: ClusterEstimate) -> str:
    from lightning_galvatron.search.report import describe_search

    arch = estimate.architecture
    head = (
        f"Estimate for {arch.describe()}, sequence {estimate.seq_length}, on {estimate.world_size} devices with "
        f"{format_bytes(estimate.memory_budget_bytes)} each"
    )
    src = estimate.sources
    lines = [
        head,
        f"Profiles: hardware {src.get('hardware', '?')}, measured blocks "
        f"{src.get('reference', src.get('hardware', '?'))}; "
        f"precision {estimate.precision}",
    ]
    lines += [f"warning: {w}" for w in estimate.warnings]
    if estimate.result is not None:
        r = estimate.result
        lines.append(
            f"Fits: yes. Peak {format_bytes(r.peak_memory_bytes_per_device)} of "
            f"{format_bytes(estimate.memory_budget_bytes)} per device, {r.throughput_samples_per_s:.2f} samples/s "
            f"at global batch {r.global_batch_size}, with this plan:\n"
        )
        lines.append(describe_search(r, title="").lstrip("\n"))
    else:
        smallest = estimate.smallest_budget_bytes
        lines.append(
            "Fits: no. "
            + (estimate.error or "")
            + (f"\nThe smallest memory per device that fits: {format_bytes(smallest)}." if smallest else "")
        )
    lines.append("\nHow these numbers were made:")
    lines.append(f"  model: parameters and shapes counted exactly ({src.get('model', arch.name)})")
    for s in estimate.scalings:
        lines.append(
            f"  {s.layer_type}: forward time = {s.reference}'s measured time x {s.time_ratio:.3g} (ratio of "
            f"forward FLOPs); activation bytes = its measured bytes x {s.activation_ratio:.3g} (ratio of the "
            "tensors kept for backward)"
        )
    lines.append(f"  calibration: measured blocks of {src.get('reference', 'the reference profile')}")
    hw: HardwareProfile = estimate.profile.hardware
    lines.append(
        f"  hardware: {hw.name} ({src.get('hardware', 'hardware profile')}): {len(hw.collectives)} collective fits, "
        f"overlap coefficient {hw.overlap_coefficient:.3g}, memory overhead {format_bytes(hw.memory_overhead_bytes)}"
    )
    lines.append(f"Estimated in {estimate.seconds:.2f} s.")
    return "\n".join(lines)


def run_estimate(
    *,
    world_size: int,
    hf_config: str | None = None,
    model: str | None = None,
    model_args: Mapping[str, Any] | None = None,
    layers: Sequence[str] | None = None,
    memory_budget: int | str | None = None,
    seq_length: int | None = None,
    hardware: str | None = None,
    reference: str | None = None,
    accelerator: str = "cuda",
    allow_other_device: bool = False,
    global_batch_size: int | None = None,
    precision: str | None = None,
    optimizer: str | float = "adamw",
    options: Any = None,
    output: str | None = None,
    profile_output: str | None = None,
    as_json: bool = False,
) -> int:
    """The ``estimate`` subcommand (see :mod:`lightning_galvatron.cli`): print the estimate, write the plan
    (``output``) and the analytic profile (``profile_output``); 0 when a plan fits, 1 when none does.
    ``hardware``/``reference``: profile files or names of reference profiles; ``options``: the search's knobs
    (:class:`~lightning_galvatron.search.options.SearchOptions`)."""
    from lightning_galvatron.reference_profiles import resolve

    if hf_config:
        architecture = architecture_from_config_file(hf_config)
        model_source = hf_config
    else:
        architecture = architecture_from_class(model, model_args, layers)
        model_source = model
    device_type = "cuda" if accelerator == "gpu" else accelerator
    hardware_path = resolve(hardware) if hardware else str(newest_cached_profile(device_type))
    reference_path = resolve(reference) if reference else None
    hardware_name, reference_name = hardware or hardware_path, reference or hardware or hardware_path
    try:
        estimate = estimate_cluster(
            architecture,
            world_size,
            memory_budget,
            hardware=hardware_path,
            reference=reference_path,
            seq_length=seq_length,
            sources={"model": model_source, "hardware": hardware_name, "reference": reference_name},
            device_type=device_type,
            allow_other_device=allow_other_device,
            global_batch_size=global_batch_size,
            optimizer=optimizer,
            precision=precision,
            options=options,
        )
    except ProfileError as err:
        raise ValueError(str(err)) from None
    if profile_output:
        estimate.profile.save(profile_output)
    if output and estimate.result is not None:
        estimate.result.plan.save(output)
    if as_json:
        print(json.dumps(estimate.to_dict(), indent=2))
    else:
        print(describe(estimate))
        if profile_output:
            print(f"Analytic profile written to {profile_output} (`lightning-galvatron search`/`evaluate` read it)")
        if output and estimate.result is not None:
            print(f"Plan written to {output}")
    return 0 if estimate.fits else 1
