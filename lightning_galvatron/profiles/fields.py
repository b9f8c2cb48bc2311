"""The pieces every part of a profile is made of (a linear fit, a per-degree table) and the checks its reader runs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class ProfileError(ValueError):
    """A profile that is malformed or lacks something the search needs; the message says what."""


@dataclass(frozen=True)
class LinearFit:
    """``time(x) = intercept_s + per_sample_s * x`` for a local batch of ``x`` samples (x may be fractional)."""

    intercept_s: float
    per_sample_s: float

    def __post_init__(self) -> None:
        _finite_nonneg("intercept_s", self.intercept_s)
        _finite_nonneg("per_sample_s", self.per_sample_s)

    def __call__(self, samples: Any) -> Any:
        return self.intercept_s + self.per_sample_s * samples

    @classmethod
    def fit(cls, samples: Sequence[float], times_s: Sequence[float]) -> LinearFit:
        """Least-squares line through measured (batch size, time) points; one point gives a line through 0."""
        xs = [float(x) for x in samples]
        ys = [float(y) for y in times_s]
        if not xs or len(xs) != len(ys):
            raise ProfileError("a linear fit needs as many times as batch sizes, and at least one")
        if len(set(xs)) == 1:
            return cls(0.0, max(sum(ys) / len(ys) / xs[0], 0.0))
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        slope = max(slope, 0.0)
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # a negative fixed cost is noise; refit through the origin
            return cls(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
        return cls(intercept, slope)

    def to_dict(self) -> dict[str, float]:
        return {"intercept_s": self.intercept_s, "per_sample_s": self.per_sample_s}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LinearFit:
        return cls(**_fields(data, where, required=("intercept_s", "per_sample_s")))


@dataclass(frozen=True)
class DegreeTable:
    """Bytes per sample measured at some parallel degrees; other degrees from a ``a + c/g`` fit.

    ``values`` maps a degree ``g`` (the size of the tensor/sequence-parallel group) to bytes per
    sample on one device. A degree that was not measured (3 or 6 on a 12-device cluster, say) is
    interpolated by least squares through ``a + c/g``: the part of the activations the group splits
    plus the part it cannot.
    """

    values: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        items = tuple(sorted((int(g), float(v)) for g, v in dict(self.values).items()))
        if not items:
            raise ProfileError("a per-degree table needs at least one measured degree")
        for g, v in items:
            if g < 1:
                raise ProfileError(f"parallel degrees start at 1, got {g}")
            _finite_nonneg(f"bytes at degree {g}", v)
        object.__setattr__(self, "values", items)

    def at(self, degree: int) -> float:
        table = dict(self.values)
        if degree in table:
            return table[degree]
        if len(table) == 1:
            ((g0, v0),) = table.items()
            return v0 * g0 / degree
        inv = [1.0 / g for g in table]
        ys = list(table.values())
        mean_x, mean_y = sum(inv) / len(inv), sum(ys) / len(ys)
        c = sum((x - mean_x) * (y - mean_y) for x, y in zip(inv, ys)) / sum((x - mean_x) ** 2 for x in inv)
        a = mean_y - c * mean_x
        return max(a + c / degree, 0.0)

    def to_dict(self) -> dict[str, float]:
        return {str(g): v for g, v in self.values}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DegreeTable:
        if not isinstance(data, Mapping) or not data:
            raise ProfileError(f"{where} must be a non-empty object mapping a parallel degree to bytes per sample")
        try:
            return cls(tuple((int(g), float(v)) for g, v in data.items()))
        except (TypeError, ValueError) as err:
            raise ProfileError(f"{where}: {err}") from None


def _fields(data: Any, where: str, cls: type | None = None, required: Sequence[str] = ()) -> dict[str, Any]:
    """Check a JSON object against a dataclass's fields: unknown keys and missing required keys are errors."""
    if not isinstance(data, Mapping):
        raise ProfileError(f"{where} must be a JSON object, got {type(data).__name__}")
    if cls is not None:
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        required = tuple(
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
    else:
        known = set(required)
    unknown = set(data) - known
    if unknown:
        raise ProfileError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ProfileError(f"{where}: missing {missing}")
    return dict(data)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProfileError(f"{name} must be a positive integer, got {value!r}")


def _finite_nonneg(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"{name} must be a finite number >= 0, got {value!r}")
