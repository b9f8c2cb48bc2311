"""Make ``strategy="galvatron"`` work in ``lightning`` and, when installed, ``pytorch_lightning``.

The two packages have separate class hierarchies and registries: a ``pytorch_lightning.Trainer``
only accepts subclasses of ``pytorch_lightning.strategies.Strategy``. The Lightning-facing modules
are written once against ``lightning.pytorch``; for ``pytorch_lightning`` they are loaded again
with the imports renamed -- the same source mapping Lightning uses to build its mirror package.

Registration waits until the user's program imports Lightning (a ``sys.meta_path`` hook), so that
``import lightning_galvatron`` stays light: the offline search and the CLI never load Lightning.
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
from typing import Any

# Modules that import Lightning, in dependency order.
_GLUE_MODULES = ("precision", "data", "strategy")
_MIRROR_PACKAGE = "lightning_galvatron._pytorch_lightning"
_DESCRIPTION = "Hybrid parallelism with a per-layer plan searched by Galvatron"


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

    if "galvatron" not in StrategyRegistry:
        StrategyRegistry.register("galvatron", GalvatronStrategy, description=_DESCRIPTION)
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from lightning_galvatron.precision import check_precision

    _check_our_precision_first(_AcceleratorConnector, GalvatronStrategy, check_precision)
    return GalvatronStrategy


def _check_our_precision_first(connector: type, strategy: type, check: Callable[[str], None]) -> None:
    """Have the Trainer refuse a precision we do not run with our message, before Lightning's own check (which, for
    any ``ModelParallelStrategy``, speaks of ``Fabric(...)`` and suggests ``16-true``). Only our strategy's checks
    change; the connector validates every other strategy as before."""
    original = connector._validate_precision_choice
    if getattr(original, "_galvatron_strategy", None) is strategy:
        return

    def validate_precision_choice(self: Any) -> None:
        if isinstance(getattr(self, "strategy", None), strategy) or isinstance(self._strategy_flag, strategy):
            check(self._precision_flag)
        original(self)

    validate_precision_choice._galvatron_strategy = strategy  # type: ignore[attr-defined]
    connector._validate_precision_choice = validate_precision_choice


def register_pytorch_lightning() -> type | None:
    """Register the ``pytorch_lightning`` twin of the strategy; ``None`` if that package is absent."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return None
    strategy_module = _mirror_glue_modules()
    from pytorch_lightning.strategies import StrategyRegistry

    if "galvatron" not in StrategyRegistry:
        StrategyRegistry.register("galvatron", strategy_module.GalvatronStrategy, description=_DESCRIPTION)
    from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

    precision_module = sys.modules[f"{_MIRROR_PACKAGE}.precision"]
    _check_our_precision_first(_AcceleratorConnector, strategy_module.GalvatronStrategy, precision_module.check_precision)
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
