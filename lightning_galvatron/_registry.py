"""Make ``strategy="galvatron"`` work in ``lightning`` and, when installed, ``pytorch_lightning``.

The two packages have separate class hierarchies and registries: a ``pytorch_lightning.Trainer``
only accepts subclasses of ``pytorch_lightning.strategies.Strategy``. The Lightning-facing modules
are written once against ``lightning.pytorch``; for ``pytorch_lightning`` they are loaded again
with the imports renamed -- the same source mapping Lightning uses to build its mirror package.

Registration itself is the strategy's (``GalvatronStrategy.register_strategies``, Lightning's pattern); this
module only calls it, once the user's program has imported Lightning (a ``sys.meta_path`` hook), so
that ``import lightning_galvatron`` stays light: the offline search and the CLI never load Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable

# Modules that import Lightning, in dependency order.
_GLUE_MODULES = ("precision", "data", "trials", "strategy")
_MIRROR_PACKAGE = "lightning_galvatron._pytorch_lightning"


def install() -> None:
    """Register now for each Lightning package already imported, else right after it is imported."""
    for package, register in (("lightning.pytorch", register_lightning), ("pytorch_lightning", register_pytorch_lightning)):
        if package in sys.modules:
            register()
        elif importlib.util.find_spec(package.split(".")[0]) is not None:
            sys.meta_path.insert(0, _CallAfterImport(package, register))


class _CallAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once the module ``name`` has finished executing."""

    def __init__(self, name: str, callback: Callable[[], object]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        callback = self.callback

        def exec_then_register(module: types.ModuleType) -> None:
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def register_lightning() -> type | None:
    importing = sys.modules.get("lightning_galvatron.strategy")
    if importing is not None and not hasattr(importing, "GalvatronStrategy"):
        return None  # the strategy module is importing Lightning right now; it registers itself when done
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_galvatron.strategy import GalvatronStrategy

    GalvatronStrategy.register_strategies(StrategyRegistry)
    return GalvatronStrategy


def register_pytorch_lightning() -> type | None:
    """Register the ``pytorch_lightning`` twin of the strategy; ``None`` if that package is absent."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return None
    strategy_module = _mirror_glue_modules()
    from pytorch_lightning.strategies import StrategyRegistry

    strategy_module.GalvatronStrategy.register_strategies(StrategyRegistry)
    return strategy_module.GalvatronStrategy


def _mirror_glue_modules() -> types.ModuleType:
    if f"{_MIRROR_PACKAGE}.strategy" in sys.modules:
        return sys.modules[f"{_MIRROR_PACKAGE}.strategy"]
    package = types.ModuleType(_MIRROR_PACKAGE)
    package.__path__ = []
    sys.modules[_MIRROR_PACKAGE] = package
    for name in _GLUE_MODULES:
        original = importlib.import_module(f"lightning_galvatron.{name}")
        source = inspect.getsource(original)
        source = source.replace("lightning.pytorch", "pytorch_lightning").replace("lightning.fabric", "lightning_fabric")
        for glue in _GLUE_MODULES:
            source = source.replace(f"lightning_galvatron.{glue} ", f"{_MIRROR_PACKAGE}.{glue} ")
        module = types.ModuleType(f"{_MIRROR_PACKAGE}.{name}", original.__doc__)
        module.__file__ = original.__file__
        sys.modules[module.__name__] = module
        exec(compile(source, original.__file__ or name, "exec"), module.__dict__)
        setattr(package, name, module)
    return sys.modules[f"{_MIRROR_PACKAGE}.strategy"]
