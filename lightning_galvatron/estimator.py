"""Will it fit, and how? The plan and its memory and time for a cluster you do not have.

``lightning-galvatron estimate --hf-config CONFIG.json --world-size 64 --memory-per-device 80GB --seq-length 4096
--hardware PROFILE`` (or ``--model MODULE:CLASS``) runs the plan search on an analytic profile of the model
(:mod:`lightning_galvatron.producers.analytic`: exact shapes, compute and activation bytes scaled from a
measured reference profile) with the hardware profile's interconnect, and answers before anything is
launched. From Python: :func:`estimate_cluster`.

Where the numbers come from:

* the model: a Hugging Face ``config.json`` (Llama-style decoders, GPT-2 and BERT-style encoders are
  counted from the config alone; other architectures are built on the meta device with
  ``transformers``), or a module class built on the meta device (nothing is allocated);
* the hardware: ``--hardware PROFILE``, a profile JSON (written by ``lightning-galvatron profile`` on
  the target kind of machine, or converted with ``import-galvatron``); its collectives, overlap
  coefficient and memory overhead are used as they are;
* the calibration: the measured blocks of ``--reference PROFILE`` (default: the hardware profile's own
  model part, measured on that hardware). Without ``--hardware`` the newest profile in the local
  profile cache serves as both -- then times are those of the local devices.
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
    **search_options: Any,
) -> ClusterEstimate:
    """Search the best plan for ``architecture`` on ``world_size`` devices of ``memory_per_device``.

    ``hardware``: a profile whose hardware part describes the cluster; ``reference``: the profile whose
    measured blocks calibrate compute and activations (default: ``hardware``'s). ``search_options``
    go to :func:`lightning_galvatron.search.search`: ``global_batch_size``, ``precision``, ``optimizer`` and
    ``options`` (its knobs, a :class:`~lightning_galvatron.search.options.SearchOptions`) or knobs by name.
    """
    from lightning_galvatron.search import InfeasibleBudgetError, search

    started = time.perf_counter()
    hardware_profile = load_profile(hardware)
    reference_profile = load_profile(reference) if reference is not None else hardware_profile
    seq = seq_length or architecture.default_seq_length
    if not seq:
        raise ValueError("the sequence length is not known from the model: pass --seq-length")
    budget = memory_per_device if memory_per_device is not None else hardware_profile.hardware.device_memory_bytes
    if budget is None:
        raise ValueError("the hardware profile does not say the device memory: pass --memory-per-device, e.g. 80GB")
    budget = parse_bytes(budget)
    profile, scalings = analytic_profile(architecture, reference_profile, seq, hardware_profile.hardware)
    common = dict(
        architecture=architecture, profile=profile, scalings=tuple(scalings), world_size=world_size,
        memory_budget_bytes=budget, seq_length=seq, sources=dict(sources or {}),
    )
    try:
        result = search(profile, world_size, budget, **search_options)
    except InfeasibleBudgetError as error:
        return ClusterEstimate(
            **common, smallest_budget_bytes=error.smallest_budget_bytes, error=str(error),
            seconds=time.perf_counter() - started,
        )
    return ClusterEstimate(**common, result=result, seconds=time.perf_counter() - started)


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


def newest_cached_profile() -> Path:
    """The most recently written profile in the local profile cache (``lightning-galvatron profile``)."""
    from lightning_galvatron.profiler.cache import default_cache_dir

    directory = default_cache_dir()
    files = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    if not files:
        raise ValueError(
            f"no --hardware profile given and none in the local profile cache ({directory}): pass --hardware PROFILE, "
            "a profile written by `lightning-galvatron profile` on the target kind of machine or converted with "
            "`lightning-galvatron import-galvatron`"
        )
    return files[-1]


# ---------------------------------------------------------------------------------------------- report
def describe(estimate: ClusterEstimate) -> str:
    from lightning_galvatron.search.report import describe_search

    arch = estimate.architecture
    head = (
        f"Estimate for {arch.describe()}, sequence {estimate.seq_length}, on {estimate.world_size} devices with "
        f"{format_bytes(estimate.memory_budget_bytes)} each"
    )
    lines = [head]
    if estimate.result is not None:
        r = estimate.result
        lines.append(
            f"Fits: yes. Peak {format_bytes(r.peak_memory_bytes_per_device)} of {format_bytes(estimate.memory_budget_bytes)} "
            f"per device, {r.throughput_samples_per_s:.2f} samples/s at global batch {r.global_batch_size}, with this plan:\n"
        )
        lines.append(describe_search(r, title="").lstrip("\n"))
    else:
        smallest = estimate.smallest_budget_bytes
        lines.append(
            "Fits: no. " + (estimate.error or "")
            + (f"\nThe smallest memory per device that fits: {format_bytes(smallest)}." if smallest else "")
        )
    lines.append("\nHow these numbers were made:")
    src = estimate.sources
    lines.append(f"  model: parameters and shapes counted exactly ({src.get('model', arch.name)})")
    for s in estimate.scalings:
        lines.append(
            f"  {s.layer_type}: forward time = {s.reference}'s measured time x {s.time_ratio:.3g} (ratio of forward FLOPs); "
            f"activation bytes = its measured bytes x {s.activation_ratio:.3g} (ratio of the tensors kept for backward)"
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
    memory_per_device: int | str | None = None,
    seq_length: int | None = None,
    hardware: str | None = None,
    reference: str | None = None,
    global_batch_size: int | None = None,
    precision: str = "bf16-mixed",
    optimizer: str | float = "adamw",
    options: Any = None,
    output: str | None = None,
    profile_output: str | None = None,
    as_json: bool = False,
) -> int:
    """The ``estimate`` subcommand (see :mod:`lightning_galvatron.cli`): print the estimate, write the plan
    (``output``) and the analytic profile (``profile_output``); 0 when a plan fits, 1 when none does.
    ``options``: the search's knobs (:class:`~lightning_galvatron.search.options.SearchOptions`)."""
    if hf_config:
        architecture = architecture_from_config_file(hf_config)
        model_source = hf_config
    else:
        architecture = architecture_from_class(model, model_args, layers)
        model_source = model
    hardware_path = hardware or str(newest_cached_profile())
    try:
        estimate = estimate_cluster(
            architecture,
            world_size,
            memory_per_device,
            hardware=hardware_path,
            reference=reference,
            seq_length=seq_length,
            sources={"model": model_source, "hardware": hardware_path, "reference": reference or hardware_path},
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
