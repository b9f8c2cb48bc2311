"""Reading the JSON files users hand us (plans, profiles, calibrations, configs): one message per way it can fail;
and writing the ones we cache, atomically.

Every message names the file and what is wrong with it (missing, unreadable, not JSON, not a JSON object), so a
typo in a path or a truncated file never surfaces as a traceback from deep inside a parser.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def read_json_object(path: str | os.PathLike, what: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object in ``path``; ``error(message)`` naming ``what`` (e.g. ``"plan file"``) and the path otherwise."""
    name = f"{what} {str(path)!r}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise error(f"{name} does not exist") from None
    except IsADirectoryError:
        raise error(f"{name} is a directory, not a JSON file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"cannot read {name}: {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{name} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise error(f"{name} must hold a JSON object ({{...}}), not a {_json_type(data)}")
    return data


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file in ``path``'s directory (made if missing) and rename it over ``path``: a
    reader (another rank, another run) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )
