"""Make ``strategy="galvatron"`` work in ``lightning``, and say why not in ``pytorch_lightning``.

The two packages have separate class hierarchies and registries: a ``pytorch_lightning.Trainer``
only accepts subclasses of ``pytorch_lightning.strategies.Strategy``, and LightningModules of
its own. The strategy is written against ``lightning.pytorch`` only; in ``pytorch_lightning`` the
name is registered to an error that says to import ``lightning.pytorch`` instead.

Registration waits until the user's program imports Lightning (a ``sys.meta_path`` hook), so that
``import lightning_galvatron`` stays light: the offline search and the CLI never load Lightning.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

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


def register_pytorch_lightning() -> None:
    """``pytorch_lightning`` is a separate copy of Lightning whose Trainer accepts only its own classes; the
    strategy is built on ``lightning``. The name gets a clear error there instead of "invalid strategy name"."""
    from pytorch_lightning.strategies import StrategyRegistry

    if "galvatron" not in StrategyRegistry:
        StrategyRegistry.register("galvatron", _not_in_pytorch_lightning, description=_DESCRIPTION + " (lightning only)")


def _not_in_pytorch_lightning(**_: Any) -> None:
    raise ValueError(PYTORCH_LIGHTNING_MESSAGE)


PYTORCH_LIGHTNING_MESSAGE = (
    'strategy="galvatron" runs with the `lightning` package, not `pytorch_lightning`: they are two copies of '
    "Lightning, and a Trainer accepts only its own package's strategies, modules and callbacks. Import Lightning as "
    "`import lightning.pytorch as pl` (same API and version) in your LightningModule, callbacks and Trainer code"
)
