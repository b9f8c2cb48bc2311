"""The Lightning side: the Trainer's and Fabric's strategies, and everything they run that knows of Lightning.

``trainer_strategy.GalvatronStrategy`` (``Trainer(strategy=...)``) and ``fabric_strategy.GalvatronFabricStrategy``
(``Fabric(strategy=...)``) are the glue; beside them, what they share: putting a model under a plan
(``preparation``), the automatic plan as a strategy runs it (``auto_setup`` is its recipe: ``autoplan``,
``trials``, ``prediction``), the data and micro-batch loop (``data``, ``micro_batches``, ``token_means``), sharded
checkpoints, metrics, the monitor and re-planning. Below this package nothing imports Lightning (the import-graph
test names every module that does).

``lightning_galvatron.strategy.GalvatronStrategy`` stays the class path a LightningCLI YAML can name; the classes
are imported on first use so that importing one module here does not load both strategies.
"""

from typing import Any

__all__ = ["GalvatronFabricStrategy", "GalvatronStrategy"]


def __getattr__(name: str) -> Any:
    if name == "GalvatronStrategy":
        from lightning_galvatron.strategy.trainer_strategy import GalvatronStrategy

        return GalvatronStrategy
    if name == "GalvatronFabricStrategy":
        from lightning_galvatron.strategy.fabric_strategy import GalvatronFabricStrategy

        return GalvatronFabricStrategy
    raise AttributeError(f"module 'lightning_galvatron.strategy' has no attribute {name!r}")
