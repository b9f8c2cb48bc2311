"""Human-readable byte sizes: ``"36GB"`` in, ``"35.2 GiB"`` out.

Memory budgets are given by users as strings on the command line, in YAML and in Python, so
one parser serves them all. Decimal (``GB``) and binary (``GiB``) prefixes both mean what they
say; a bare number is bytes.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_LARGEST = 1e18  # an exabyte: anything above is a typo, and float rounding would make nonsense of it
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str) -> int:
    """Return a byte count from ``36GB``, ``1.5GiB``, ``512MB``, ``2e9`` or an int."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"expected a byte size such as '36GB' or a number of bytes, got {value!r}")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read {value!r} as a byte size; write e.g. '36GB', '1.5GiB', '512MB' or a number of bytes"
            )
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        number = value
    if not math.isfinite(number) or number >= _LARGEST:
        raise ValueError(f"{value!r} is not a byte size a device can have (at most {_LARGEST:.0e} bytes)")
    if number < 0:
        raise ValueError(f"a byte size cannot be negative, got {value!r}")
    return int(number)


def format_bytes(num_bytes: float) -> str:
    """Binary-prefixed size with three significant digits, e.g. ``35.2 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
