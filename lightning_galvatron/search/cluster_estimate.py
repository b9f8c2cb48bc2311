"""Will it fit, and how? The plan, its memory and its time for a cluster you do not have, from the shape of a model.

The search (:func:`~lightning_galvatron.search.search`) runs on an analytic profile of the architecture
(:mod:`lightning_galvatron.producers.analytic`: exact shapes, compute and activation bytes scaled from a measured
reference profile) with the hardware profile's interconnect. ``lightning-galvatron estimate``
(:mod:`lightning_galvatron.cli.estimate`) and the dry run's ``plan="auto"`` both ask it here.

It never extrapolates silently: a profile of another kind of device than the question's is refused unless
``allow_other_device``, and a block whose forward FLOPs are more than :data:`EXTRAPOLATION_WARNING` times (or less
than its inverse) the measured block's is reported as an extrapolation.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_galvatron.producers.analytic import ArchitectureShape, Scaling, analytic_profile
from lightning_galvatron.profiles import Profile, load_profile
from lightning_galvatron.units import parse_bytes

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
    answer = functools.partial(
        ClusterEstimate,
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
        return answer(
            smallest_budget_bytes=error.smallest_budget_bytes,
            error=str(error),
            seconds=time.perf_counter() - started,
        )
    return answer(result=result, seconds=time.perf_counter() - started)


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
