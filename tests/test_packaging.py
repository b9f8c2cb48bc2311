"""Installing the package must not change a user's Lightning project (issue 16)."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _requirement_closure(distribution: str) -> set[str]:
    """Names of the distributions a plain ``pip install distribution`` installs (no extras), recursively."""
    seen: set[str] = set()
    todo = [distribution]
    while todo:
        name = re.split(r"[\s<>=!~;\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo.extend(r for r in requirements if "extra ==" not in r)
    return seen


def test_no_hard_dependency_switches_lightnings_defaults():
    """Lightning makes Rich its default progress bar and model summary whenever ``rich`` is installed
    (``_RICH_AVAILABLE``); the package must not be what installs it."""
    ours = _requirement_closure("lightning_galvatron")
    assert "lightning" in ours and "torch" in ours  # the walk sees the real metadata
    assert "rich" not in ours - _requirement_closure("lightning"), sorted(ours)


def test_the_package_imports_only_what_it_declares():
    declared = {"torch", "lightning", "lightning_utilities", "torchmetrics", "numpy", "yaml"}  # yaml: pyyaml
    optional = {"transformers", "pytorch_lightning", "matplotlib"}  # imported inside functions that need them
    imported = set()
    for path in (REPO / "lightning_galvatron").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "lightning_galvatron"}
    assert third_party <= declared | optional, sorted(third_party - declared - optional)
    import tomllib

    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    distributions = {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].replace("-", "_") for r in requirements}
    assert {"pyyaml" if module == "yaml" else module for module in declared} == distributions


def test_license_and_type_marker_are_shipped():
    assert (REPO / "LICENSE").read_text().startswith(" " * 33 + "Apache License")
    assert (REPO / "lightning_galvatron" / "py.typed").is_file()
    assert metadata.metadata("lightning_galvatron")["License-Expression"] == "Apache-2.0"


def test_reference_profiles_are_package_data():
    """``estimate --hardware a100`` reads them from the installed package: the wheel must carry every one."""
    import tomllib

    from lightning_galvatron import reference_profiles

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "lightning_galvatron"
    ]
    package = REPO / "lightning_galvatron"
    shipped = {path for pattern in globs for path in package.glob(pattern)}
    files = set((package / "reference_profiles").glob("*.json"))
    assert files and files <= shipped
    assert {path.stem for path in files} == set(reference_profiles.names())
    for name in reference_profiles.names():
        assert reference_profiles.load(name).device_type == "cuda"
