"""Make ``strategy="galvatron"`` work in ``lightning`` (the Trainer's and Fabric's), and say why not in
``pytorch_lightning``.

The two packages have separate class hierarchies and registries: a ``pytorch_lightning.Trainer``
only accepts subclasses of ``pytorch_lightning.strategies.Strategy``, and LightningModules of
its own. The strategy is written against ``lightning.pytorch`` only; in ``pytorch_lightning`` the
name is registered to an error that says to import ``lightning.pytorch`` instead.

Registration itself is the strategy's (``GalvatronStrategy.register_strategies``, Lightning's pattern); this
module only calls it, once the user's program has imported Lightning (a ``sys.meta_path`` hook), so
that ``import lightning_galvatron`` stays light: the offline search and the CLI never load Lightning.
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
    for package, register in (
        ("lightning.pytorch", register_lightning),
        ("pytorch_lightning", register_pytorch_lightning),
    ):
        if package in sys.modules:
            register()
        elif importlib.util.find_spec(package.split(".")[0]) is not None:
            sys.meta_path.insert(0, _CallAfterImport(package, register))


class _CallAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once the module ``name`` has finished executing."""

    def __init__(self, name: str, callback: Callable[[], object]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
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
    register_fabric()
    importing = sys.modules.get("lightning_galvatron.strategy.trainer_strategy")
    if importing is not None and not hasattr(importing, "GalvatronStrategy"):
        return None  # the strategy module is importing Lightning right now; it registers itself when done
    from lightning.pytorch.strategies import StrategyRegistry

    if _module_still_importing():
        if "galvatron" not in StrategyRegistry:
            StrategyRegistry.register("galvatron", _trainer_strategy, description=_DESCRIPTION)
        return None
    from lightning_galvatron.strategy.trainer_strategy import GalvatronStrategy

    GalvatronStrategy.register_strategies(StrategyRegistry)
    return GalvatronStrategy


def register_fabric() -> None:
    """``Fabric(strategy="galvatron")``: Fabric has a registry of its own (``lightning.fabric.strategies``)."""
    importing = sys.modules.get("lightning_galvatron.strategy.fabric_strategy")
    if importing is not None and not hasattr(importing, "GalvatronFabricStrategy"):
        return  # the Fabric strategy's module is importing Lightning right now; it registers itself when done
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if _module_still_importing():
        if "galvatron" not in STRATEGY_REGISTRY:
            STRATEGY_REGISTRY.register("galvatron", _fabric_strategy, description=_DESCRIPTION)
        return
    from lightning_galvatron.strategy.fabric_strategy import GalvatronFabricStrategy

    GalvatronFabricStrategy.register_strategies(STRATEGY_REGISTRY)


def _module_still_importing() -> bool:
    """Whether a module of this package imported Lightning and is still executing
    (``import lightning_galvatron.strategy.data`` as the first import): importing the strategies now would read its
    names before they exist. The name then gets a factory that imports the strategy when a Trainer or Fabric asks for
    it (the strategy module registers its class over it as it finishes importing)."""
    return any(
        getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
        if name.startswith("lightning_galvatron.") and name != __name__
    )


def _trainer_strategy(**kwargs: Any) -> Any:
    from lightning_galvatron.strategy.trainer_strategy import GalvatronStrategy

    return GalvatronStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any) -> Any:
    from lightning_galvatron.strategy.fabric_strategy import GalvatronFabricStrategy

    return GalvatronFabricStrategy(**kwargs)


def register_pytorch_lightning() -> None:
    """``pytorch_lightning`` is a separate copy of Lightning whose Trainer accepts only its own classes; the
    strategy is built on ``lightning``. The name gets a clear error there instead of "invalid strategy name"."""
    from pytorch_lightning.strategies import StrategyRegistry

    if "galvatron" not in StrategyRegistry:
        StrategyRegistry.register(
            "galvatron", _not_in_pytorch_lightning, description=_DESCRIPTION + " (lightning only)"
        )


def _not_in_pytorch_lightning(**_: Any) -> None:
    raise ValueError(PYTORCH_LIGHTNING_MESSAGE)


PYTORCH_LIGHTNING_MESSAGE = (
    'strategy="galvatron" runs with the `lightning` package, not `pytorch_lightning`: they are two copies of '
    "Lightning, and a Trainer accepts only its own package's strategies, modules and callbacks. Import Lightning as "
    "`import lightning.pytorch as pl` (same API and version) in your LightningModule, callbacks and Trainer code"
)
