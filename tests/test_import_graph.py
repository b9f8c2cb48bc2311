"""Dependencies run one way: no import cycle between the modules of lightning_galvatron, nor between its packages;
no source file grows past 600 lines; and no module reads a private attribute of a strategy (``strategy._name``).

Imports are read with ``ast`` (nothing is imported), function-local ones included: a cycle dodged by importing
inside a function is still a cycle a reader has to untangle. Imports under ``if TYPE_CHECKING:`` are left out
(they never run). The nodes of the package graph are the subpackages (``model``, ``runtime``, ``search``, ...)
and the top-level modules, each its own node.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lightning_galvatron"
PACKAGE = ROOT.name
MAX_LINES = 600


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except the body of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _owner(name: str) -> str | None:
    """The module of the package that ``name`` (a module or an attribute path) is, or lives in."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports_of(module: str, source: str, is_package: bool = False) -> set[str]:
    """The modules of the package that ``module``'s source imports (other than itself)."""
    found = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the module pkg.sub; ``from mod import name`` imports mod.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        found |= {owner for t in targets if t.split(".")[0] == PACKAGE and (owner := _owner(t)) not in (None, module)}
    return found


def _module_graph() -> dict[str, set[str]]:
    return {
        module: _imports_of(module, path.read_text(), path.name == "__init__.py") for module, path in MODULES.items()
    }


def _node(module: str) -> str:
    """A module's node in the package graph: its subpackage of lightning_galvatron, or itself (a top-level module)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in _module_graph().items():
        graph.setdefault(_node(module), set()).update(_node(t) for t in targets if _node(t) != _node(module))
    return graph


def _cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan), as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, component) for component in components]


def _cycle_through(graph: Mapping[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle from the component's first node back to itself, inside the component."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def _describe(cycles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(name.removeprefix(f"{PACKAGE}.") for name in cycle) for cycle in cycles)


def test_the_walk_sees_every_kind_of_import():
    """The walker must see what the assertions below rely on: function-local, relative and ``from pkg import mod``
    imports, and no ``TYPE_CHECKING`` one (checked on a source written here, resolved against the real modules)."""
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from lightning_galvatron import plan\n"
        "from . import units\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_galvatron.jsonfile import read_json_object\n"
        "def f():\n"
        "    from lightning_galvatron.search.cost import resolve_precision\n"
        "    import lightning_galvatron.profiles.model\n"
    )
    found = _imports_of(f"{PACKAGE}.errors", source)  # a top-level module: ``from .`` is the package itself
    assert found == {f"{PACKAGE}.plan", f"{PACKAGE}.units", f"{PACKAGE}.search.cost", f"{PACKAGE}.profiles.model"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    cycles = _cycles(_module_graph())
    assert not cycles, f"import cycles between modules: {_describe(cycles)}"


def test_no_import_cycle_between_packages():
    cycles = _cycles(_package_graph())
    assert not cycles, f"import cycles between packages: {_describe(cycles)}"


def _too_long(relatives: list[str]) -> list[str]:
    counts = {relative: len((ROOT / relative).read_text().splitlines()) for relative in relatives}
    return [f"{relative} ({lines} lines)" for relative, lines in counts.items() if lines > MAX_LINES]


def test_no_source_file_over_600_lines():
    files = [str(path.relative_to(ROOT)) for path in MODULES.values()]
    too_long = _too_long(files)
    assert not too_long, f"split these by concept (at most {MAX_LINES} lines): {', '.join(too_long)}"


# ---------------------------------------------------------------------------------------------- strategy boundary
_STRATEGY_NAMES = frozenset({"strategy", "_strategy"})


def _private_strategy_reads(source: str) -> list[str]:
    """``strategy._name``, ``self._strategy._name``, ``trainer.strategy._name``, ...: a private attribute read through
    a name or attribute called ``strategy`` (dunders aside), as ``line: expression``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name in _STRATEGY_NAMES:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_strategy_check_sees_private_reads():
    source = (
        "strategy._plan_source\n"
        "self._strategy._applied.gradients\n"
        "trainer.strategy._progress('x')\n"
        "strategy.plan, self._meshes, strategy.__class__, self.strategy.applied\n"
    )
    assert _private_strategy_reads(source) == [
        "1: strategy._plan_source",
        "2: self._strategy._applied",
        "3: trainer.strategy._progress",
    ]


def test_no_module_reads_a_private_strategy_attribute():
    """What another module needs of a strategy is public (``applied``, ``reapply_plan``, ...) or handed over (the
    ``PlanningContext`` of ``plan="auto"``): the strategies can change their internals without breaking a reader."""
    reads = {
        str(path.relative_to(ROOT)): found
        for path in MODULES.values()
        if (found := _private_strategy_reads(path.read_text()))
    }
    assert not reads, f"private strategy attributes read outside the strategy: {reads}"


# ---------------------------------------------------------------------------------------------- Lightning boundary
#: Every module that imports Lightning (``lightning``, ``pytorch_lightning``) itself: the strategies and what only they
#: run, the commands that read LightningCLI configs or launch Fabric, the dry run's model and rank (which build a
#: LightningModule and run the strategy's precision plugin), and the registration hook. A new name here is a decision.
LIGHTNING_MODULES = frozenset(
    f"{PACKAGE}.{name}"
    for name in (
        "_registry",
        "cli.calibrate",
        "cli.profile",
        "dryrun.models",
        "dryrun.rank",
        "strategy.auto_setup",
        "strategy.data",
        "strategy.fabric_strategy",
        "strategy.metrics",
        "strategy.micro_batches",
        "strategy.monitor",
        "strategy.precision",
        "strategy.preparation",
        "strategy.replan",
        "strategy.setup_steps",
        "strategy.step_logs",
        "strategy.trainer_strategy",
        "strategy.trials",
    )
)
#: The packages above the boundary: they may import Lightning, or a module that does. Below it (the plan, the
#: search, profiles, the profiler, the model's discovery, the runtime, measured selection) nothing reaches Lightning,
#: so the offline tools and the runtime work without it and a Lightning change touches only these packages.
ABOVE_THE_BOUNDARY = frozenset(f"{PACKAGE}.{name}" for name in ("cli", "dryrun", "strategy", "_registry"))


def _imports_lightning(source: str) -> bool:
    for node in _import_nodes(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if node.__class__ is ast.ImportFrom and node.level:
            continue
        if any(name.split(".")[0] in ("lightning", "pytorch_lightning") for name in names):
            return True
    return False


def test_only_the_named_modules_import_lightning():
    importing = {module for module, path in MODULES.items() if _imports_lightning(path.read_text())}
    assert importing == LIGHTNING_MODULES, (
        f"import Lightning without being named: {sorted(importing - LIGHTNING_MODULES)}; "
        f"named but no longer import it: {sorted(LIGHTNING_MODULES - importing)}"
    )


def test_nothing_below_the_boundary_reaches_lightning():
    """Transitively, through the package's own imports (function-local ones included)."""
    graph = _module_graph()
    reaching = set(LIGHTNING_MODULES)
    changed = True
    while changed:
        changed = False
        for module, targets in graph.items():
            if module not in reaching and targets & reaching:
                reaching.add(module)
                changed = True
    below = {m for m in reaching if _node(m) not in ABOVE_THE_BOUNDARY and m != PACKAGE}
    paths = {m: sorted(graph[m] & reaching) for m in sorted(below)}
    assert not below, f"below the Lightning boundary but reaching Lightning through: {paths}"
