"""Every error once: the rank that reports it prints it; the others end quietly.

When a plan is refused, a checkpoint is incomplete or a rank dies, every rank raises, and each would print the
same traceback (one per rank, prefixed ``[rankN]:`` by ``torch.distributed``). The strategy picks one reporting
rank (rank 0 before the processes can talk to each other, else the first rank that failed) and, on the others,
lets the exception end the process without printing it: an ``sys.excepthook`` wrapper that swallows exactly that
exception when it reaches the top of the program uncaught. Code that catches the exception sees it unchanged, on
every rank. Set ``LIGHTNING_GALVATRON_DEBUG=1`` to have every rank print its own traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

DEBUG_ENV = "LIGHTNING_GALVATRON_DEBUG"


def debug_enabled() -> bool:
    """``LIGHTNING_GALVATRON_DEBUG`` is set (to anything but ``0``): every rank prints its own errors."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def leave_to_reporting_rank(exception: BaseException) -> None:
    """If ``exception`` ends this process uncaught, print nothing: another rank prints it (unless debugging)."""
    if debug_enabled() or getattr(exception, "_galvatron_silenced", False):
        return
    try:
        exception._galvatron_silenced = True  # type: ignore[attr-defined]
    except AttributeError:  # exceptions without a __dict__ cannot be marked; print them
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        if not _caused_by(value, exception):
            previous(kind, value, traceback)

    sys.excepthook = hook


@contextmanager
def reported_by_rank_zero(rank: int) -> Iterator[None]:
    """Errors that every process finds alike before they can talk (its arguments, its devices): rank 0 prints them.
    ``rank``: this process's global rank (under ``torchrun`` every process makes the strategy)."""
    try:
        yield
    except Exception as error:
        if rank != 0:
            leave_to_reporting_rank(error)
        raise


def _caused_by(value: BaseException | None, exception: BaseException) -> bool:
    """``value`` is ``exception`` or was raised while handling it (a wrapper re-raised by user code)."""
    seen = 0
    while value is not None and seen < 16:
        if value is exception:
            return True
        value, seen = value.__cause__ or value.__context__, seen + 1
    return False


def note_cause(exception: BaseException, note: str | None) -> None:
    """Add ``note`` to ``exception`` (shown with its traceback, wherever it is printed or caught; Python 3.11+)."""
    if note and hasattr(exception, "add_note"):
        exception.add_note(note)
