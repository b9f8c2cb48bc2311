"""The table of tensor-parallel plans by block class, filled by the built-in families and by users.

A module of its own so that the families (``model/families/``) can fill it without importing the module
that loads them (:mod:`lightning_galvatron.model.tensor_parallel_plans`): imports run one way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version

from torch import nn

from lightning_galvatron.runtime.tensor_parallel import BlockTensorParallelPlan

#: A plan for a block, or the reason the block cannot be split.
PlanFactory = Callable[[nn.Module], "BlockTensorParallelPlan | str"]

_REGISTRY: dict[str, PlanFactory] = {}


def class_key(block_class: type | str) -> str:
    """The qualified name a class is registered under (``"package.module.Class"``)."""
    return block_class if isinstance(block_class, str) else f"{block_class.__module__}.{block_class.__qualname__}"


def add_plan(block_class: type | str, plan: PlanFactory) -> None:
    """Register ``plan`` for ``block_class`` (a later registration replaces an earlier one)."""
    _REGISTRY[class_key(block_class)] = plan


def find_plan(classes: Iterable[type]) -> PlanFactory | None:
    """The factory registered for the first of ``classes`` (a block class's MRO) that has one."""
    for cls in classes:
        make = _REGISTRY.get(class_key(cls))
        if make is not None:
            return make
    return None


def library_release(block: nn.Module) -> str:
    """``"transformers 5.25.0"``: the installed release of the package that defines ``block``'s class."""
    package = type(block).__module__.split(".", 1)[0]
    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:  # not an installed distribution (a user's own module)
        return f"the installed {package}"
