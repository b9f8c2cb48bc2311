"""The parallel plan: what the search produces and the runtime executes.

A :class:`ParallelPlan` says, for a model of ``L`` Transformer blocks trained on ``world_size``
devices, how many pipeline stages there are and which blocks each holds, which schedule runs
them with how many micro-batches, and -- per block -- a :class:`LayerStrategy`: the size of its
tensor/sequence-parallel group, the kind of sequence parallelism, how its data-parallel
replicas keep their states (DDP, ZeRO-2, ZeRO-3) and whether its activations are recomputed.
The embedding and head ("vocabulary" layers) get a strategy of their own.

The data-parallel degree is not stored: on a stage of ``n = world_size / pp`` devices a block
with group size ``tp`` has ``dp = n / tp`` replicas. Rank layout: a stage owns the consecutive
ranks ``[s*n, (s+1)*n)``; with ``tp_consecutive`` the ``tp`` ranks of one group are neighbours
(``tp`` varies fastest), otherwise they are ``dp`` apart.

This module imports neither Lightning nor ``torch.distributed``: plans are built, validated and
stored offline. Plans are immutable; :meth:`ParallelPlan.replace` makes changed copies.

The reference system (Hetu-Galvatron) stores the same information in a flat JSON of
comma-separated strings; :meth:`ParallelPlan.from_galvatron` / :meth:`ParallelPlan.to_galvatron`
convert both ways.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_galvatron.jsonfile import read_json_object
from lightning_galvatron.plan.layout import Layout, rank_chunks

DP_TYPES = ("ddp", "zero2", "zero3")
SP_KINDS = ("none", "megatron", "ulysses")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PLAN_FORMAT = "lightning_galvatron.plan"
PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan that cannot be executed; the message says what to change."""


@dataclass(frozen=True)
class LayerStrategy:
    """How one block (or the vocabulary layers) is parallelised inside its pipeline stage.

    Attributes:
        tp: size of the block's model-parallel group (1 = none). With ``sp="none"`` or
            ``"megatron"`` the weights are split Megatron-style over this group; with
            ``sp="ulysses"`` the weights stay whole and the group splits the sequence instead
            (all-to-all around attention), i.e. ``tp`` is the Ulysses degree.
        sp: sequence parallelism: ``"none"``, ``"megatron"`` (norms/dropout sharded on the
            sequence around the tensor-parallel region) or ``"ulysses"``.
        dp_type: how the ``dp = devices_per_stage / tp`` replicas hold parameters, gradients and
            optimizer states: ``"ddp"`` (replicated), ``"zero2"`` (gradients and optimizer states
            sharded) or ``"zero3"`` (everything sharded, parameters gathered on use).
        recompute: drop the block's activations after forward and recompute them in backward.
        tp_consecutive: the group's ranks are neighbours (``True``) or ``dp`` apart (``False``).
    """

    tp: int = 1
    sp: str = "none"
    dp_type: str = "ddp"
    recompute: bool = False
    tp_consecutive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise PlanError(f"tp must be a positive integer, got {self.tp!r}")
        if self.sp not in SP_KINDS:
            raise PlanError(f"sp must be one of {SP_KINDS}, got {self.sp!r}")
        if self.dp_type not in DP_TYPES:
            raise PlanError(f"dp_type must be one of {DP_TYPES}, got {self.dp_type!r}")
        if self.sp != "none" and self.tp == 1:
            raise PlanError(
                f"sp={self.sp!r} needs a group to split the sequence over: set tp > 1 (the sequence-parallel degree) "
                "or sp='none'"
            )
        if not isinstance(self.recompute, bool) or not isinstance(self.tp_consecutive, bool):
            raise PlanError("recompute and tp_consecutive must be booleans")

    @property
    def splits_weights(self) -> bool:
        """Whether the weights are tensor-parallel (Megatron) rather than replicated in the group."""
        return self.tp > 1 and self.sp != "ulysses"

    def short(self) -> str:
        """Compact label used in tables and logs, e.g. ``tp2-megatron-zero3-rc``."""
        parts = [f"tp{self.tp}" if self.sp != "ulysses" else f"sp{self.tp}"]
        if self.sp == "megatron":
            parts.append("msp")
        if self.tp > 1 and not self.tp_consecutive:
            parts.append("strided")
        parts.append(self.dp_type)
        if self.recompute:
            parts.append("rc")
        return "-".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "layer strategy") -> LayerStrategy:
        if not isinstance(data, Mapping):
            raise PlanError(f'{where} must be an object like {{"tp": 2, "dp_type": "zero3"}}, got {data!r}')
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise PlanError(
                f"{where}: unknown layer strategy keys {sorted(unknown)}; known: tp, sp, dp_type, recompute, "
                "tp_consecutive"
            )
        try:
            return cls(**data)
        except PlanError as err:
            raise PlanError(f"{where}: {err}") from None


@dataclass(frozen=True)
class ParallelPlan:
    """A complete hybrid-parallel plan; see the module docstring for the rank layout.

    Attributes:
        world_size: number of devices (processes) the plan is for.
        layers: one :class:`LayerStrategy` per Transformer block, in model order; none for a model without blocks
            (trained as one unit under ``vocab``, with ``pp = 1`` and one micro-batch).
        vocab: strategy of the embedding and the head (``tp`` = vocabulary-parallel degree).
        pp: number of pipeline stages.
        partition: blocks per pipeline chunk, in order; ``pp * virtual_stages`` entries summing
            to ``len(layers)``. ``None`` means as even as possible (earlier chunks get the extra).
        schedule: pipeline schedule, one of :data:`SCHEDULES`.
        micro_batches: micro-batches per optimizer step (pipeline chunks / gradient accumulation).
        virtual_stages: model chunks per pipeline rank (> 1 only for ``interleaved_1f1b``).
        global_batch_size: samples per optimizer step; ``None`` = taken from the DataLoader
            (its batch size times the number of devices, as DDP would train).
    """

    world_size: int
    layers: tuple[LayerStrategy, ...]
    vocab: LayerStrategy = field(default_factory=LayerStrategy)
    pp: int = 1
    partition: tuple[int, ...] | None = None
    schedule: str = "1f1b"
    micro_batches: int = 1
    virtual_stages: int = 1
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        # Normalise containers so that equality and hashing work whatever the caller passed.
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.partition is not None:
            object.__setattr__(self, "partition", tuple(self.partition))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise :class:`PlanError` naming the first thing that makes this plan unrunnable."""
        _positive_int("world_size", self.world_size)
        _positive_int("pp", self.pp)
        _positive_int("micro_batches", self.micro_batches)
        _positive_int("virtual_stages", self.virtual_stages)
        if not self.layers and (self.pp, self.micro_batches) != (1, 1):
            # No blocks: the whole model is one unit under the vocab strategy (plan="auto"'s floor for a model it
            # cannot decompose), which neither a pipeline nor micro-batches can cut.
            raise PlanError(
                "a plan needs at least one layer strategy (one per Transformer block); without blocks the whole "
                "model is one unit, with pp=1 and one micro-batch"
            )
        for index, strategy in enumerate(self.layers):
            if not isinstance(strategy, LayerStrategy):
                raise PlanError(f"layers[{index}] must be a LayerStrategy, got {type(strategy).__name__}")
        if not isinstance(self.vocab, LayerStrategy):
            raise PlanError(f"vocab must be a LayerStrategy, got {type(self.vocab).__name__}")
        if self.world_size % self.pp:
            raise PlanError(
                f"pp={self.pp} does not divide world_size={self.world_size}: choose pp among "
                f"{divisors(self.world_size)}"
            )
        n = self.devices_per_stage
        for where, strategy in [*((f"layers[{i}]", s) for i, s in enumerate(self.layers)), ("vocab", self.vocab)]:
            if n % strategy.tp:
                raise PlanError(
                    f"{where}: tp={strategy.tp} does not divide the {n} devices of a pipeline stage "
                    f"(world_size={self.world_size} / pp={self.pp}); choose tp among {divisors(n)}"
                )
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "interleaved_1f1b":
            if self.virtual_stages < 2:
                raise PlanError("schedule='interleaved_1f1b' needs virtual_stages >= 2 model chunks per pipeline rank")
            if self.pp < 2:
                raise PlanError("schedule='interleaved_1f1b' needs pp >= 2")
        elif self.virtual_stages != 1:
            raise PlanError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved_1f1b'")
        chunks = self.pp * self.virtual_stages
        if chunks > max(self.num_layers, 1):
            raise PlanError(
                f"{chunks} pipeline chunks (pp={self.pp} x virtual_stages={self.virtual_stages}) for only "
                f"{self.num_layers} blocks: every chunk needs at least one block"
            )
        if self.partition is not None:
            if len(self.partition) != chunks:
                raise PlanError(
                    f"partition has {len(self.partition)} entries but the plan has {chunks} pipeline chunks "
                    f"(pp={self.pp} x virtual_stages={self.virtual_stages})"
                )
            if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in self.partition):
                raise PlanError(f"every pipeline chunk needs at least one block, got partition={list(self.partition)}")
            if sum(self.partition) != self.num_layers:
                raise PlanError(
                    f"partition {list(self.partition)} sums to {sum(self.partition)} but the model has "
                    f"{self.num_layers} blocks"
                )
        if self.global_batch_size is not None:
            self.check_batch_size(self.global_batch_size)

    def check_batch_size(self, global_batch_size: int) -> None:
        """Raise if ``global_batch_size`` cannot be split evenly by every layer's dp and the micro-batches."""
        _positive_int("global_batch_size", global_batch_size)
        for where, strategy in [*((f"layers[{i}]", s) for i, s in enumerate(self.layers)), ("vocab", self.vocab)]:
            dp = self.dp_of(strategy)
            if global_batch_size % (dp * self.micro_batches):
                raise PlanError(
                    f"global batch size {global_batch_size} is not divisible by dp={dp} x micro_batches="
                    f"{self.micro_batches} of {where}; use a multiple of {self.batch_granularity}"
                )

    # ------------------------------------------------------------------ derived quantities
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def devices_per_stage(self) -> int:
        return self.world_size // self.pp

    def dp_of(self, strategy: LayerStrategy) -> int:
        """Data-parallel degree of a strategy on one stage of this plan."""
        return self.devices_per_stage // strategy.tp

    @property
    def batch_granularity(self) -> int:
        """Smallest global batch size every layer can split evenly (lcm of dp x micro-batches)."""
        from math import lcm

        return lcm(*(self.dp_of(s) * self.micro_batches for s in (*self.layers, self.vocab)))

    @property
    def is_uniform(self) -> bool:
        """Every block has the same strategy (the plans a user picks without a search)."""
        return len(set(self.layers)) <= 1

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Blocks per pipeline chunk (the explicit partition or the even default)."""
        if self.partition is not None:
            return self.partition
        return even_partition(self.num_layers, self.pp * self.virtual_stages)

    def chunk_layers(self, chunk: int) -> range:
        """Block indices of pipeline chunk ``chunk`` (chunk ``c`` runs on stage ``c % pp``)."""
        sizes = self.chunk_sizes
        start = sum(sizes[:chunk])
        return range(start, start + sizes[chunk])

    def stage_layers(self, stage: int) -> list[int]:
        """Block indices held by pipeline rank ``stage`` (several chunks when interleaved)."""
        return [i for c in rank_chunks(stage, self.pp, self.virtual_stages) for i in self.chunk_layers(c)]

    def stage_ranks(self, stage: int) -> range:
        return Layout.stage(self).stage_ranks(stage)

    @property
    def uses_tensor_or_sequence_parallel(self) -> bool:
        return any(s.tp > 1 for s in (*self.layers, self.vocab))

    def replace(self, **changes: Any) -> ParallelPlan:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def uniform(
        cls, world_size: int, num_layers: int, strategy: LayerStrategy | None = None, **kwargs: Any
    ) -> ParallelPlan:
        """The same strategy for every block (and, unless given, for the vocabulary layers)."""
        strategy = strategy or LayerStrategy()
        kwargs.setdefault("vocab", strategy)
        return cls(world_size=world_size, layers=(strategy,) * num_layers, **kwargs)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "world_size": self.world_size,
            "pp": self.pp,
            "partition": None if self.partition is None else list(self.partition),
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "virtual_stages": self.virtual_stages,
            "global_batch_size": self.global_batch_size,
            "vocab": self.vocab.to_dict(),
            "layers": [s.to_dict() for s in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], world_size: int | None = None) -> ParallelPlan:
        """Read our JSON format, or the reference system's (then ``world_size`` is required)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan is a JSON object ({{...}}) with 'layers', got a {type(data).__name__}")
        if is_galvatron_format(data):
            if world_size is None:
                raise PlanError("a plan in the reference system's format does not say its world size: pass world_size")
            return cls.from_galvatron(data, world_size)
        if data.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise PlanError(f"not a lightning_galvatron plan: format={data.get('format')!r}")
        if data.get("version", PLAN_VERSION) > PLAN_VERSION:
            raise PlanError(
                f"plan format version {data['version']} is newer than this lightning_galvatron understands "
                f"({PLAN_VERSION}); upgrade the package"
            )
        known = {f.name for f in dataclasses.fields(cls)} | {"format", "version"}
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"unknown plan keys {sorted(unknown)}; known: {sorted(known)}")
        if "layers" not in data:
            raise PlanError("a plan needs 'layers': one strategy per Transformer block")
        kwargs = {k: v for k, v in data.items() if k not in ("format", "version", "layers", "vocab")}
        if world_size is not None and kwargs.get("world_size", world_size) != world_size:
            raise world_size_mismatch(kwargs["world_size"], world_size)
        kwargs.setdefault("world_size", world_size)
        if kwargs["world_size"] is None:
            raise PlanError("the plan does not say its world_size")
        if not isinstance(data["layers"], (list, tuple)):
            raise PlanError(f"'layers' must be a list of layer strategies, got {type(data['layers']).__name__}")
        layers = tuple(LayerStrategy.from_dict(s, where=f"layers[{i}]") for i, s in enumerate(data["layers"]))
        vocab = LayerStrategy.from_dict(data["vocab"], where="vocab") if "vocab" in data else LayerStrategy()
        return cls(layers=layers, vocab=vocab, **kwargs)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str, world_size: int | None = None) -> ParallelPlan:
        return cls.from_dict(json.loads(text), world_size=world_size)

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str], world_size: int | None = None) -> ParallelPlan:
        data = read_json_object(path, "plan file", PlanError)
        try:
            return cls.from_dict(data, world_size=world_size)
        except PlanError as err:
            raise PlanError(f"plan file {str(path)!r}: {err}") from None

    # ------------------------------------------------------------------ reference-system format
    @classmethod
    def from_galvatron(cls, data: Mapping[str, Any], world_size: int) -> ParallelPlan:
        """Convert the reference system's strategy JSON (``pp_deg``, ``tp_sizes_enc``, ...)."""
        missing = [k for k in ("pp_deg", "tp_sizes_enc", "dp_types_enc") if k not in data]
        if missing:
            raise PlanError(f"reference-format plan lacks {missing}")
        tp_sizes = _int_list(data["tp_sizes_enc"])
        num_layers = len(tp_sizes)

        def flags(key: str, default: int) -> list[int]:
            values = _int_list(data[key]) if key in data else [default] * num_layers
            if len(values) != num_layers:
                raise PlanError(f"{key} has {len(values)} entries but tp_sizes_enc has {num_layers}")
            return values

        default_dp = data.get("default_dp_type", "ddp")
        if default_dp not in ("ddp", "zero2"):
            raise PlanError(f"default_dp_type must be 'ddp' or 'zero2', got {default_dp!r}")
        layers = tuple(
            LayerStrategy(
                tp=tp,
                sp="ulysses" if use_sp and tp > 1 else "none",
                dp_type="zero3" if zero3 else default_dp,
                recompute=bool(ckpt),
                tp_consecutive=bool(consec),
            )
            for tp, consec, zero3, use_sp, ckpt in zip(
                tp_sizes,
                flags("tp_consecutive_flags", 1),
                flags("dp_types_enc", 0),
                flags("use_sp", 0),
                flags("checkpoint", 0),
            )
        )
        vtp = int(data.get("vtp", 1))
        vocab = LayerStrategy(
            tp=vtp,
            sp="ulysses" if int(data.get("vsp", 0)) and vtp > 1 else "none",
            dp_type="zero3" if int(data.get("embed_sdp", 0)) else default_dp,
        )
        pipeline_type = data.get("pipeline_type", "gpipe")
        schedules = {"gpipe": "gpipe", "pipedream_flush": "1f1b"}
        if pipeline_type not in schedules:
            raise PlanError(f"unknown pipeline_type {pipeline_type!r}; the reference format knows {sorted(schedules)}")
        pp = int(data["pp_deg"])
        partition = tuple(_int_list(data["pp_division"])) if "pp_division" in data else None
        bsz = data.get("global_bsz")
        return cls(
            world_size=world_size,
            layers=layers,
            vocab=vocab,
            pp=pp,
            partition=partition,
            schedule=schedules[pipeline_type],
            micro_batches=int(data.get("chunks", 1)),
            global_batch_size=None if bsz is None else int(bsz),
        )

    def to_galvatron(self) -> dict[str, Any]:
        """The reference system's strategy JSON; raises for what that format cannot express."""
        if self.virtual_stages != 1:
            raise PlanError("the reference format has no interleaved schedule (virtual_stages must be 1)")
        if any(s.sp == "megatron" for s in (*self.layers, self.vocab)):
            raise PlanError("the reference format has no per-layer Megatron sequence parallelism (sp='megatron')")
        dp_types = {s.dp_type for s in (*self.layers, self.vocab) if s.dp_type != "zero3"}
        if len(dp_types) > 1:
            raise PlanError(
                "the reference format allows one non-ZeRO-3 dp type per plan (default_dp_type), "
                f"this plan mixes {sorted(dp_types)}"
            )
        # With every layer on ZeRO-3 the default is unused; "zero2" is the reference system's usual value.
        default_dp = dp_types.pop() if dp_types else "zero2"
        if self.vocab.recompute:
            raise PlanError("the reference format cannot recompute the vocabulary layers")
        if self.vocab.tp > 1 and not self.vocab.tp_consecutive:
            raise PlanError("the reference format has no strided layout for the vocabulary layers")

        def join(values: Iterable[int]) -> str:
            return ",".join(str(int(v)) for v in values)

        out: dict[str, Any] = {
            "pp_deg": self.pp,
            "tp_sizes_enc": join(s.tp for s in self.layers),
            "tp_consecutive_flags": join(s.tp_consecutive for s in self.layers),
            "dp_types_enc": join(s.dp_type == "zero3" for s in self.layers),
            "use_sp": join(s.sp == "ulysses" for s in self.layers),
            "checkpoint": join(s.recompute for s in self.layers),
        }
        if self.global_batch_size is not None:
            out["global_bsz"] = self.global_batch_size
        out.update(
            {
                "chunks": self.micro_batches,
                "pp_division": join(self.chunk_sizes),
                "pipeline_type": {"gpipe": "gpipe", "1f1b": "pipedream_flush"}[self.schedule],
                "default_dp_type": default_dp,
                "vtp": self.vocab.tp,
                "vsp": int(self.vocab.sp == "ulysses"),
                "embed_sdp": int(self.vocab.dp_type == "zero3"),
            }
        )
        return out


def is_galvatron_format(data: Mapping[str, Any]) -> bool:
    """Whether a dict is a strategy in the reference system's format."""
    return "tp_sizes_enc" in data and "pp_deg" in data


def load_plan(
    source: ParallelPlan | Mapping[str, Any] | str | os.PathLike[str], world_size: int | None = None
) -> ParallelPlan:
    """Accept a plan object, a dict (ours or the reference format) or a JSON file path."""
    if isinstance(source, ParallelPlan):
        plan = source
    elif isinstance(source, Mapping):
        plan = ParallelPlan.from_dict(source, world_size=world_size)
    elif isinstance(source, (str, os.PathLike)):
        plan = ParallelPlan.load(source, world_size=world_size)
    else:
        raise PlanError(f"plan must be a ParallelPlan, a dict or a path to a JSON file, got {type(source).__name__}")
    if world_size is not None and plan.world_size != world_size:
        raise world_size_mismatch(plan.world_size, world_size)
    return plan


def world_size_mismatch(planned: int, running: int) -> PlanError:
    return PlanError(
        f"the plan is for world_size={planned} but {running} device{'s are' if running > 1 else ' is'} running; "
        f"launch with {planned} devices, or use plan='auto' (or `lightning-galvatron search --world-size {running}`) "
        f"for a plan for {running}"
    )


def check_plan_source(source: ParallelPlan | Mapping[str, Any] | str | os.PathLike[str]) -> None:
    """Check a plan before the world size is known (when a strategy is made): a file must exist and hold a JSON
    object; a plan in our format that states its world size must be valid. The rest is checked by
    :func:`load_plan` once the world size is known."""
    if isinstance(source, ParallelPlan):
        return
    data: Mapping[str, Any]
    if isinstance(source, (str, os.PathLike)):
        data, where = read_json_object(source, "plan file", PlanError), f"plan file {str(source)!r}: "
    elif isinstance(source, Mapping):
        data, where = source, ""
    else:
        raise PlanError(f"plan must be 'auto', a ParallelPlan, a dict or a path to a JSON file, got {source!r}")
    if is_galvatron_format(data) or "world_size" not in data:
        return
    try:
        ParallelPlan.from_dict(data)
    except PlanError as err:
        raise PlanError(f"{where}{err}") from None


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order: the degrees a group of ``n`` devices can be split by."""
    return [d for d in range(1, n + 1) if n % d == 0]


def even_partition(num_layers: int, chunks: int) -> tuple[int, ...]:
    """Split ``num_layers`` into ``chunks`` nearly equal parts, larger parts first."""
    base, extra = divmod(num_layers, chunks)
    return tuple(base + (1 if i < extra else 0) for i in range(chunks))


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


def _int_list(value: str | Sequence[int] | int) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, str):
        try:
            return [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise PlanError(f"expected comma-separated integers, got {value!r}") from None
    return [int(v) for v in value]
