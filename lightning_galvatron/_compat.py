"""``override`` (PEP 698) without a dependency: ``typing.override`` from Python 3.12, else a stand-in that marks
the method the same way (type checkers read the ``sys.version_info`` branch of their target)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

if sys.version_info >= (3, 12):
    from typing import override
else:

    def override(method: _F) -> _F:
        """Mark ``method`` as overriding a base class's (``__override__``, as ``typing.override`` sets it)."""
        try:
            method.__override__ = True  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            pass
        return method


__all__ = ["override"]
