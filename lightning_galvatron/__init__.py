"""lightning_galvatron: automatic hybrid parallelism for PyTorch Lightning.

``import lightning_galvatron`` makes ``Trainer(strategy="galvatron")`` and ``Fabric(strategy="galvatron")`` available
in ``lightning`` (registered as soon as Lightning is imported, so that the offline parts -- plans, search, CLI -- never
load Lightning); in ``pytorch_lightning`` the name says to use ``lightning.pytorch`` instead.
"""

from typing import Any

from lightning_galvatron._registry import install as _install
from lightning_galvatron.plan import LayerStrategy, ParallelPlan, PlanError

_install()

__all__ = [
    "GalvatronFabricStrategy",
    "GalvatronStrategy",
    "LayerStrategy",
    "ParallelPlan",
    "PlanError",
    "dry_run",
    "register_tensor_parallel_plan",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Imported on first use: they need Lightning or torch.distributed, which the offline parts do without.
    if name == "GalvatronStrategy":
        from lightning_galvatron.strategy.trainer_strategy import GalvatronStrategy

        return GalvatronStrategy
    if name == "GalvatronFabricStrategy":
        from lightning_galvatron.strategy.fabric_strategy import GalvatronFabricStrategy

        return GalvatronFabricStrategy
    if name == "dry_run":
        from lightning_galvatron.dryrun.run import dry_run

        return dry_run
    if name == "register_tensor_parallel_plan":
        from lightning_galvatron.model.tensor_parallel_plans import register_tensor_parallel_plan

        return register_tensor_parallel_plan
    raise AttributeError(f"module 'lightning_galvatron' has no attribute {name!r}")
