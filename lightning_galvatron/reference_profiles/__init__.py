"""Profiles shipped with the package, by name: ``lightning-galvatron estimate --hardware a100``.

A reference profile describes a kind of GPU cluster someone measured (collectives, overlap, memory overhead) and
the blocks of one model on it, which ``estimate`` scales to other models. Each is built from measurements the
project has (see ``README.md`` next to the files for the commands); none is made up. The search and ``estimate``
say which profile they used.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from lightning_galvatron.profiles import Profile, ProfileError

_DESCRIPTIONS = {
    "a100": "8 x NVIDIA A100 per node, Llama-2-7B blocks in bf16 at sequence 2048 (Hetu-Galvatron's measurements)",
}


def names() -> list[str]:
    """The names of the shipped profiles."""
    return sorted(_DESCRIPTIONS)


def describe() -> str:
    """One line per shipped profile: its name and what was measured."""
    return "; ".join(f"{name}: {_DESCRIPTIONS[name]}" for name in names())


def path(name: str) -> Path:
    """The file of the shipped profile ``name``."""
    if name not in _DESCRIPTIONS:
        raise ProfileError(f"no reference profile named {name!r}; shipped: {describe()}")
    return Path(str(resources.files(__name__).joinpath(f"{name}.json")))


def load(name: str) -> Profile:
    return Profile.load(path(name))


def resolve(text: str) -> str:
    """A profile file's path as given, or the file of the shipped profile of that name."""
    if text in _DESCRIPTIONS and not Path(text).exists():
        return str(path(text))
    if not Path(text).exists() and "/" not in text and not text.endswith(".json"):
        raise ProfileError(f"{text!r} is neither a profile file nor the name of a reference profile ({describe()})")
    return text


__all__ = ["describe", "load", "names", "path", "resolve"]
