"""The search's knobs in one object, :class:`SearchOptions`: a knob is added here and nowhere else.

The strategy takes the object whole (``GalvatronStrategy(search_options=...)``, or a dict of its fields), the
CLI's ``search``, ``estimate`` and ``dry-run`` make one flag per field (``--max-tp``, ``--no-baselines``; the
help text is the field's ``help`` metadata), and :func:`~lightning_galvatron.search.search` reads it whole.
What is not a knob but a fact about the training -- world size, memory budget, global batch size, precision,
optimizer -- the caller passes beside it.

Torch-free, like the rest of the search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_galvatron.plan import SCHEDULES
from lightning_galvatron.search.coefficients import Calibration, load_calibration

DISABLE_CHOICES = {
    "ddp": "data parallelism with replicated states",
    "zero2": "ZeRO-2 (sharded gradients and optimizer states)",
    "zero3": "ZeRO-3 (everything sharded)",
    "recompute": "activation recomputation",
    "tensor_parallel": "Megatron tensor parallelism (with or without sequence parallelism)",
    "tp_without_sp": "Megatron tensor parallelism without sequence parallelism",
    "megatron_sp": "Megatron sequence parallelism",
    "ulysses": "Ulysses sequence parallelism",
    "vocab_parallel": "vocabulary-parallel embedding and head",
    "strided": "strided tensor-parallel rank layouts",
    "pipeline": "pipeline parallelism (pp > 1)",
}


def _knob(default: Any = None, *, help: str, factory: Any = None, **kinds: Any) -> Any:
    """A field with its help text; ``kinds``: ``type`` of a value, ``many`` (a list), ``choices``."""
    metadata = {"help": help, **kinds}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class SearchOptions:
    """User limits and knobs of the search (each field's ``help`` metadata says what it does).

    Attributes:
        max_tp: largest model-parallel group (TP or Ulysses degree) to consider.
        max_pp: largest pipeline degree.
        max_micro_batches: most micro-batches per step (measured selection searches with half the best plan's,
            since the model prices their fixed per-call costs least surely).
        disable: names from :data:`DISABLE_CHOICES` to leave out.
        schedules: pipeline schedules allowed.
        virtual_stages: model chunks per rank tried with ``interleaved_1f1b``.
        memory_tolerance: ``eps`` of the DP's guarantee: its plan is at least as fast as the best
            plan under a budget smaller by ``eps * (budget - fixed memory)``, and never over budget.
        max_stage_imbalance: a stage holds at most this many times the even share of blocks.
        search_batch_size: also search the global batch size for throughput, up to ``max_global_batch_size``
            (default ``8 * world_size``); off, the global batch is the caller's.
        baselines: price the uniform baselines (pure DDP, ZeRO-3, TP, the best uniform 3D plan) too.
        token_means: leave out plans whose losses would not each hold one DDP rank's samples
            (:func:`~lightning_galvatron.plan.rules.token_mean_problem`): ``plan="auto"`` sets it for batches with
            labels ``-100``.
        calibration: price plans with the cost model calibrated from measured steps
            (:class:`~lightning_galvatron.search.coefficients.Calibration`, its dict or JSON file).
    """

    max_tp: int | None = _knob(help="largest tensor/sequence-parallel degree", type=int)
    max_pp: int | None = _knob(help="largest pipeline degree", type=int)
    max_micro_batches: int | None = _knob(help="most micro-batches per step (default: any)", type=int)
    disable: frozenset[str] = _knob(
        help=f"leave out: {', '.join(sorted(DISABLE_CHOICES))}",
        factory=frozenset,
        many=True,
        choices=sorted(DISABLE_CHOICES),
        metavar="WHAT",
    )
    schedules: tuple[str, ...] = _knob(
        SCHEDULES, help="pipeline schedules allowed (default: all)", many=True, choices=SCHEDULES
    )
    virtual_stages: tuple[int, ...] = _knob(
        (2,), help="model chunks per pipeline rank tried with interleaved_1f1b (default: 2)", many=True, type=int
    )
    memory_tolerance: float = _knob(
        0.01, help="DP memory resolution as a fraction of the budget (default: 0.01)", type=float
    )
    max_stage_imbalance: float = _knob(
        2.0, help="a pipeline stage holds at most this many times the even share of blocks (default: 2)", type=float
    )
    search_batch_size: bool = _knob(False, help="also search the global batch size for throughput")
    max_global_batch_size: int | None = _knob(
        help="largest batch tried by --search-batch-size (default: 8 x world size)", type=int
    )
    baselines: bool = _knob(True, help="price the uniform baselines (pure DDP, ZeRO-3, TP, best uniform 3D) too")
    token_means: bool = _knob(
        False,
        help="only plans whose micro-batches each hold one DDP rank's samples (micro-batches = pp x vocab tp), so "
        "that losses averaged over tokens (labels -100) train as under DDP",
    )
    calibration: Calibration | None = _knob(
        help="calibration JSON (`lightning-galvatron calibrate`): price plans with the calibrated cost model", type=str
    )

    def __post_init__(self) -> None:
        # A single name is a list of one (YAML users write `disable: zero3`); None is the default.
        for name, default in (("disable", frozenset()), ("schedules", SCHEDULES), ("virtual_stages", (2,))):
            value = getattr(self, name)
            value = default if value is None else (value,) if isinstance(value, (str, int)) else value
            object.__setattr__(self, name, frozenset(value) if name == "disable" else tuple(value))
        unknown = self.disable - set(DISABLE_CHOICES)
        if unknown:
            raise ValueError(f"cannot disable {sorted(unknown)}; choose from {sorted(DISABLE_CHOICES)}")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ValueError(f"schedules must be a non-empty subset of {SCHEDULES}, got {list(self.schedules)}")
        if any(not isinstance(v, int) or v < 2 for v in self.virtual_stages):
            raise ValueError(f"virtual_stages must be integers >= 2, got {list(self.virtual_stages)}")
        for name in ("max_tp", "max_pp", "max_micro_batches", "max_global_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not 0 < self.memory_tolerance < 1:
            raise ValueError(f"memory_tolerance must be in (0, 1), got {self.memory_tolerance!r}")
        if self.max_stage_imbalance < 1:
            raise ValueError(f"max_stage_imbalance must be >= 1, got {self.max_stage_imbalance!r}")
        if {"ddp", "zero2", "zero3"} <= self.disable:
            raise ValueError("disabling ddp, zero2 and zero3 leaves no way to hold the model states")
        for name in ("search_batch_size", "baselines", "token_means"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "calibration", load_calibration(self.calibration))

    @classmethod
    def of(cls, options: SearchOptions | Mapping[str, Any] | None = None, **overrides: Any) -> SearchOptions:
        """``options`` (a :class:`SearchOptions`, a dict of its fields, or ``None`` for the defaults) with
        ``overrides`` (fields by name) applied."""
        known = {f.name for f in dataclasses.fields(cls)}
        if options is not None and not isinstance(options, (cls, Mapping)):
            raise ValueError(f"search options must be a SearchOptions or a dict of its fields, got {options!r}")
        given = dict(options) if isinstance(options, Mapping) else {}
        unknown = (set(given) | set(overrides)) - known
        if unknown:
            raise ValueError(f"unknown search options {sorted(unknown)}; known: {sorted(known)}")
        if isinstance(options, cls):
            return dataclasses.replace(options, **overrides) if overrides else options
        return cls(**{**given, **overrides})


__all__ = ["DISABLE_CHOICES", "SearchOptions"]
