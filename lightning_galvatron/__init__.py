"""lightning_galvatron: automatic hybrid parallelism for PyTorch Lightning.

``import lightning_galvatron`` makes ``Trainer(strategy="galvatron")`` available in ``lightning`` and,
when installed, ``pytorch_lightning`` (registered as soon as Lightning is imported, so that the
offline parts -- plans, search, CLI -- never load Lightning).
"""

from typing import Any

from lightning_galvatron._registry import install as _install
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError

_install()

__all__ = ["GalvatronStrategy", "LayerStrategy", "ParallelPlan", "PlanError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "GalvatronStrategy":  # imported on first use: it needs Lightning
        from lightning_galvatron.strategy import GalvatronStrategy

        return GalvatronStrategy
    raise AttributeError(f"module 'lightning_galvatron' has no attribute {name!r}")
