"""The ``lightning-galvatron`` command: ``app`` parses and dispatches, one module per command beside it (``profile``,
``estimate``, ``dry_run``, ``calibrate``, the file commands) with the options they share (``options``). Commands
sit on top of everything else; nothing outside this package imports it.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The console script's entry point (``lightning_galvatron.cli:main``)."""
    from lightning_galvatron.cli.app import main as run

    return run(argv)
