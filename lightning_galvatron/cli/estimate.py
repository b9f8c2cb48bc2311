"""Will it fit, and how? The plan and its memory and time for a cluster you do not have.

``lightning-galvatron estimate --hf-config CONFIG.json --world-size 64 --memory-budget 80GB --seq-length 4096
--hardware PROFILE`` (or ``--model MODULE:CLASS``) runs the plan search on an analytic profile of the model
(:mod:`lightning_galvatron.producers.analytic`: exact shapes, compute and activation bytes scaled from a
measured reference profile) with the hardware profile's interconnect, and answers before anything is
launched. From Python: :func:`~lightning_galvatron.search.cluster_estimate.estimate_cluster`.

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
a block whose forward FLOPs are more than
:data:`~lightning_galvatron.search.cluster_estimate.EXTRAPOLATION_WARNING` times (or less than its inverse) the
measured block's is reported as an extrapolation: kernel efficiency does not scale with FLOPs over such ranges.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_galvatron import reference_profiles
from lightning_galvatron.model.sources import architecture_from_class, architecture_from_config_file
from lightning_galvatron.profiles import HardwareProfile, Profile, ProfileError
from lightning_galvatron.search.cluster_estimate import ClusterEstimate, estimate_cluster
from lightning_galvatron.units import format_bytes


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
        f"({reference_profiles.describe()}) or a profile written by `lightning-galvatron profile` on the target "
        "kind of machine (or converted with `lightning-galvatron import-galvatron`)"
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
    """The ``estimate`` subcommand (see :mod:`lightning_galvatron.cli.app`): print the estimate, write the plan
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
