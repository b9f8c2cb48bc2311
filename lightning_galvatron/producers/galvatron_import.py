"""Convert a directory of Hetu-Galvatron profile files into our :class:`~lightning_galvatron.profiles.Profile`.

The reference system writes one JSON per measurement, named after what it measured, in its own
units (milliseconds, MiB, MiB per millisecond):

* ``computation_profiling_{dtype}_{model}_all.json``: ``layertype_{i}_bsz{b}_seq{s}`` -- forward
  milliseconds per sample of one block of type ``i`` at batch size ``b``; ``layertype_other_...``
  the same for the embedding, head and loss together.
* ``memory_profiling_{dtype}_{model}_all.json``: per block type ``parameter_size`` (MiB of fp32
  parameters) and ``tp_activation_per_bsz_dict`` (MiB per sample per tensor-parallel degree, and
  ``checkpoint`` for a recomputed block); ``other_memory_pp_on_{first,last}`` the embedding's and
  head's activations per vocabulary-parallel degree. Keys ending in ``_sp`` were measured with
  sequence parallelism (activations split over the group), the case our format stores.
* ``allreduce_bandwidth_{N}nodes_{D}gpus_per_node.json``: ``allreduce_size_{g}_consec_{0|1}`` bus
  bandwidth in MiB/ms of groups of ``g`` ranks, consecutive or strided in a world of ``N*D``.
* ``p2p_bandwidth_{N}nodes_{D}gpus_per_node.json``: ``pp_size_{p}`` point-to-point bandwidth
  between neighbouring stages of a ``p``-stage pipeline.
* ``sp_time_{N}nodes_{D}gpus_per_node.json``: ``{allreduce,all2all}_size_{g}_{m}MB_time``
  milliseconds per message size (fitted here to latency + bandwidth).
* ``overlap_coefficient.json``: ``overlap_coe``.

Conversion policy (each choice is a documented assumption, not a measurement):

* All-reduce bandwidth comes from the bandwidth files (what the reference uses for gradient
  synchronisation, measured with all groups busy); its latency from the ``sp_time`` fit.
  All-to-all comes from the ``sp_time`` fit. When several files measure the same kind of group,
  the larger cluster wins; equal clusters are averaged.
* The reference measured activations only with sequence parallelism; what Megatron TP without it
  keeps whole is estimated as the inputs of a block's two norms: ``2 * seq * hidden * dtype`` bytes
  per sample.
* The embedding lookup is free; the measured "other" time is the head's (the vocabulary matmul
  and loss).
* Parameter counts come from the measured fp32 ``parameter_size``; the embedding and head have
  ``vocab_size * hidden_size`` parameters each (one matrix if tied).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from lightning_galvatron.jsonfile import read_json_object
from lightning_galvatron.plan.layout import ranks_per_node
from lightning_galvatron.profiles import (
    CollectiveFit,
    DegreeTable,
    HardwareProfile,
    LayerTypeProfile,
    LinearFit,
    ModelProfile,
    Profile,
    ProfileError,
    VocabProfile,
)

MIB = 2**20
MS = 1e-3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# The reference trains "bf16"/"fp16" with fp32 master weights and optimizer states (mixed precision).
DTYPE_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}

# Published shapes of models the reference ships profiles for; any of them can be overridden.
KNOWN_MODELS: dict[str, dict[str, int]] = {
    "llama2-7b": {
        "hidden_size": 4096,
        "num_layers": 32,
        "num_heads": 32,
        "ffn_hidden_size": 11008,
        "vocab_size": 32000,
    },
    "llama-7b": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "ffn_hidden_size": 11008, "vocab_size": 32000},
    "llama2-13b": {
        "hidden_size": 5120,
        "num_layers": 40,
        "num_heads": 40,
        "ffn_hidden_size": 13824,
        "vocab_size": 32000,
    },
    "llama-13b": {
        "hidden_size": 5120,
        "num_layers": 40,
        "num_heads": 40,
        "ffn_hidden_size": 13824,
        "vocab_size": 32000,
    },
}

_CLUSTER = re.compile(r"_(\d+)nodes_(\d+)gpus_per_node\.json$")


def import_galvatron(
    directory: str | Path,
    *,
    hidden_size: int,
    seq_length: int,
    num_layers: int | list[int] | None = None,
    num_heads: int | None = None,
    ffn_hidden_size: int | None = None,
    vocab_size: int | None = None,
    tied_embeddings: bool = False,
    model_name: str | None = None,
    memory_overhead_bytes: int = 0,
    device_memory_bytes: int | None = None,
    hardware_name: str | None = None,
) -> Profile:
    """Read the reference system's profile files in ``directory`` and return our profile.

    ``num_layers`` may be a list (blocks per layer type, in order) for models with several block
    types. Shapes not given are taken from a reference-format plan in the directory (layer count)
    or from :data:`KNOWN_MODELS` by the model name in the file names.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ProfileError(f"{str(directory)!r} is not a directory of Hetu-Galvatron profile files")
    compute_path, dtype, found_model = _find_one(directory, "computation_profiling", seq_length)
    memory_path, _, _ = _find_one(directory, "memory_profiling", seq_length)
    model_name = model_name or found_model
    known = KNOWN_MODELS.get(model_name, {})
    if known and known["hidden_size"] != hidden_size:
        known = {}
    if num_layers is None:
        num_layers = _layers_from_plan(directory) or known.get("num_layers")
    shape = {
        "num_layers": num_layers,
        "num_heads": num_heads or known.get("num_heads"),
        "ffn_hidden_size": ffn_hidden_size or known.get("ffn_hidden_size"),
        "vocab_size": vocab_size or known.get("vocab_size"),
    }
    missing = [f"--{k.replace('_', '-')}" for k, v in shape.items() if v is None]
    if missing:
        raise ProfileError(
            f"the profile files do not say the model's {', '.join(missing)} and {model_name!r} is not a known model "
            f"({', '.join(sorted(KNOWN_MODELS))}): pass them"
        )
    dtype_bytes = DTYPE_BYTES[dtype]
    compute = _read_json(compute_path)
    memory = _read_json(memory_path)

    type_ids = sorted({int(m.group(1)) for k in compute if (m := re.match(r"layertype_(\d+)_bsz", k))})
    if not type_ids:
        raise ProfileError(f"{compute_path.name} has no per-layer-type times (layertype_<i>_bsz<b>_seq<s> keys)")
    counts = shape["num_layers"] if isinstance(shape["num_layers"], list) else [shape["num_layers"]]
    if len(counts) != len(type_ids):
        raise ProfileError(
            f"the profiles describe {len(type_ids)} layer type(s); pass --num-layers as {len(type_ids)} "
            "comma-separated counts"
        )
    layer_types = tuple(
        _layer_type(
            t,
            compute,
            memory,
            seq_length,
            hidden_size,
            shape["num_heads"],
            shape["ffn_hidden_size"],
            dtype_bytes,
            compute_path,
            memory_path,
        )
        for t in type_ids
    )
    blocks = tuple(i for i, count in enumerate(counts) for _ in range(int(count)))
    vocab = _vocab(
        compute, memory, seq_length, hidden_size, shape["vocab_size"], tied_embeddings, compute_path, memory_path
    )
    model = ModelProfile(
        name=model_name,
        layer_types=layer_types,
        blocks=blocks,
        vocab=vocab,
        hidden_size=hidden_size,
        seq_length=seq_length,
        activation_dtype_bytes=dtype_bytes,
        precision=DTYPE_PRECISION[dtype],
    )
    hardware = _hardware(directory, memory_overhead_bytes, device_memory_bytes, hardware_name)
    source = f"imported from Hetu-Galvatron profiles ({directory.name}/, {dtype}, seq {seq_length})"
    return Profile(model=model, hardware=hardware, source=source)


# ---------------------------------------------------------------------------------------------- model
def _layer_type(
    t, compute, memory, seq, hidden, heads, ffn, dtype_bytes, compute_path, memory_path
) -> LayerTypeProfile:
    points = sorted(
        (int(m.group(1)), v) for k, v in compute.items() if (m := re.fullmatch(rf"layertype_{t}_bsz(\d+)_seq{seq}", k))
    )
    if not points:
        raise ProfileError(f"{compute_path.name} has no times for layer type {t} at sequence length {seq}")
    fit = LinearFit.fit([b for b, _ in points], [b * ms * MS for b, ms in points])
    entry = _seq_entry(memory, f"layertype_{t}", seq, memory_path)
    acts = entry.get("tp_activation_per_bsz_dict")
    if not isinstance(acts, dict) or "checkpoint" not in acts:
        raise ProfileError(
            f"{memory_path.name}: layertype_{t} lacks tp_activation_per_bsz_dict with a 'checkpoint' entry"
        )
    split = DegreeTable(tuple((int(g), v * MIB) for g, v in acts.items() if g != "checkpoint"))
    replicated = 2.0 * seq * hidden * dtype_bytes
    plain = memory.get(f"layertype_{t}", {}).get(str(seq)) if f"layertype_{t}_sp" in memory else None
    if plain and isinstance(plain.get("tp_activation_per_bsz_dict"), dict):
        # Measured without sequence parallelism too: the difference is the part TP keeps whole.
        diffs = [
            (v * MIB - split.at(int(g))) / (1 - 1 / int(g))
            for g, v in plain["tp_activation_per_bsz_dict"].items()
            if g != "checkpoint" and int(g) > 1
        ]
        if diffs:
            replicated = max(sum(diffs) / len(diffs), 0.0)
    return LayerTypeProfile(
        name=f"layertype_{t}",
        parameters=int(round(entry["parameter_size"] * MIB / 4)),
        hidden_size=hidden,
        num_heads=heads,
        ffn_hidden_size=ffn,
        seq_length=seq,
        forward_time=fit,
        activation_bytes_per_sample=split,
        recompute_activation_bytes_per_sample=acts["checkpoint"] * MIB,
        replicated_activation_bytes_per_sample=replicated,
    )


def _vocab(compute, memory, seq, hidden, vocab_size, tied, compute_path, memory_path) -> VocabProfile:
    points = sorted(
        (int(m.group(1)), v)
        for k, v in compute.items()
        if (m := re.fullmatch(rf"layertype_other_bsz(\d+)_seq{seq}", k))
    )
    if not points:
        raise ProfileError(f"{compute_path.name} has no embedding/head times (layertype_other_bsz<b>_seq{seq})")
    head_fit = LinearFit.fit([b for b, _ in points], [b * ms * MS for b, ms in points])

    def activation(stage: str) -> DegreeTable | None:
        for key in (f"other_memory_pp_on_{stage}_sp", f"other_memory_pp_on_{stage}"):
            if key in memory:
                act = _seq_entry(memory, key.removesuffix("_sp"), seq, memory_path).get("activation")
                if isinstance(act, dict) and act:
                    return DegreeTable(tuple((int(g), v * MIB) for g, v in act.items()))
        return None

    first, last = activation("first"), activation("last")
    if first is None or last is None:
        both = _seq_entry(memory, "other_memory_pp_off", seq, memory_path).get("activation")
        if not isinstance(both, dict):
            raise ProfileError(f"{memory_path.name} has no embedding/head activation memory (other_memory_pp_*)")
        last = DegreeTable(tuple((int(g), v * MIB) for g, v in both.items()))
        first = DegreeTable(((1, 0.0),))
    params = vocab_size * hidden
    return VocabProfile(
        vocab_size=vocab_size,
        embedding_parameters=params,
        head_parameters=0 if tied else params,
        tied=tied,
        embedding_forward_time=LinearFit(0.0, 0.0),
        head_forward_time=head_fit,
        embedding_activation_bytes_per_sample=first,
        head_activation_bytes_per_sample=last,
    )


def _seq_entry(memory: dict, key: str, seq: int, path: Path) -> dict:
    for name in (f"{key}_sp", key):
        if name in memory:
            block = memory[name]
            if str(seq) not in block:
                raise ProfileError(f"{path.name}: {name} has no entry for sequence length {seq} (has {sorted(block)})")
            return block[str(seq)]
    raise ProfileError(f"{path.name} has no {key} entry")


# ---------------------------------------------------------------------------------------------- hardware
def _hardware(
    directory: Path, memory_overhead_bytes: int, device_memory_bytes: int | None, hardware_name: str | None = None
) -> HardwareProfile:
    clusters = {}
    for path in directory.glob("*.json"):
        if m := _CLUSTER.search(path.name):
            clusters[path.name] = (int(m.group(1)), int(m.group(2)))
    if not clusters:
        raise ProfileError(f"{directory} has no bandwidth files (*_<N>nodes_<D>gpus_per_node.json)")
    per_node = max(d for _, d in clusters.values())

    # Latency and all-to-all from the message-size sweeps.
    latency: dict[int, float] = {}
    candidates: dict[tuple[str, int, int], list[tuple[int, CollectiveFit]]] = defaultdict(list)
    for name, (nodes, gpus) in clusters.items():
        if not name.startswith("sp_time_"):
            continue
        sweeps: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
        for key, ms in _read_json(directory / name).items():
            if m := re.fullmatch(r"(allreduce|all2all)_size_(\d+)_(\d+)MB_time", key):
                sweeps[(m.group(1), int(m.group(2)))].append((int(m.group(3)) * MIB, ms * MS))
        for (kind, g), pts in sweeps.items():
            ours = "all_reduce" if kind == "allreduce" else "all_to_all"
            k = ranks_per_node(g, 1, per_node, nodes * gpus)
            fit = CollectiveFit.fit(ours, g, k, [s for s, _ in pts], [t for _, t in pts])
            if ours == "all_reduce":
                latency[g] = fit.latency_s
            else:
                candidates[(ours, g, k)].append((nodes * gpus, fit))

    def latency_for(g: int) -> float:
        if not latency:
            return 0.0
        return latency[min(latency, key=lambda x: abs(x - g))]

    for name, (nodes, gpus) in clusters.items():
        world = nodes * gpus
        if name.startswith("allreduce_bandwidth_"):
            for key, bw in _read_json(directory / name).items():
                if m := re.fullmatch(r"allreduce_size_(\d+)_consec_([01])", key):
                    g, consec = int(m.group(1)), m.group(2) == "1"
                    k = ranks_per_node(g, 1 if consec else world // g, per_node, world)
                    candidates[("all_reduce", g, k)].append(
                        (world, CollectiveFit("all_reduce", g, k, latency_for(g), bw * MIB / MS))
                    )
        elif name.startswith("p2p_bandwidth_"):
            for key, bw in _read_json(directory / name).items():
                if m := re.fullmatch(r"pp_size_(\d+)", key):
                    p = int(m.group(1))
                    k = 2 if world <= per_node else 1
                    candidates[("p2p", p, k)].append((world, CollectiveFit("p2p", p, k, latency_for(2), bw * MIB / MS)))
    collectives = []
    for (kind, g, k), found in sorted(candidates.items()):
        largest = max(w for w, _ in found)
        chosen = [f for w, f in found if w == largest]
        collectives.append(
            CollectiveFit(
                kind,
                g,
                k,
                sum(f.latency_s for f in chosen) / len(chosen),
                sum(f.bandwidth_bytes_per_s for f in chosen) / len(chosen),
            )
        )
    overlap_path = directory / "overlap_coefficient.json"
    overlap = float(_read_json(overlap_path).get("overlap_coe", 1.0)) if overlap_path.exists() else 1.0
    sizes = sorted({n * d for n, d in clusters.values()})
    measured = f"Hetu-Galvatron measurements on {', '.join(map(str, sizes))} devices"
    return HardwareProfile(
        name=f"{hardware_name} ({measured})" if hardware_name else f"{per_node} devices per node ({measured})",
        devices_per_node=per_node,
        overlap_coefficient=max(overlap, 1.0),
        collectives=tuple(collectives),
        device_memory_bytes=device_memory_bytes,
        memory_overhead_bytes=memory_overhead_bytes,
        device_type="cuda",  # the reference system profiles GPUs with NCCL
    )


# ---------------------------------------------------------------------------------------------- files
def _find_one(directory: Path, prefix: str, seq: int) -> tuple[Path, str, str]:
    """The ``{prefix}_{dtype}_{model}_all.json`` file with per-layer-type data (not the single-run variants)."""
    found = []
    for path in sorted(directory.glob(f"{prefix}_*_all.json")):
        m = re.fullmatch(rf"{prefix}_(bf16|fp16|fp32)_(.+?)(_seqlen\d+)?_all\.json", path.name)
        if not m:
            continue
        data = _read_json(path)
        if any(str(k).startswith("layertype_") for k in data):
            found.append((m.group(3) is not None, path, m.group(1), m.group(2)))
    if not found:
        raise ProfileError(f"{directory} has no {prefix}_<dtype>_<model>_all.json file with layertype_* entries")
    found.sort(key=lambda f: f[0])  # prefer the file covering all sequence lengths
    _, path, dtype, model = found[0]
    return path, dtype, model


def _layers_from_plan(directory: Path) -> int | None:
    for path in sorted(directory.glob("galvatron_config_*.json")):
        data = _read_json(path)
        if "tp_sizes_enc" in data:
            return len([v for v in str(data["tp_sizes_enc"]).split(",") if v.strip()])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "Hetu-Galvatron profile file", ProfileError)
