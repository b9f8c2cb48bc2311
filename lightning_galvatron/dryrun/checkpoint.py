"""A dry run's checkpoint phases: a sharded save, and the load of another plan's save, planned as DCP plans them,
through the code the strategy runs; nothing is written or read.

* ``checkpoint`` (:func:`plan_save`): the state dicts ``GalvatronStrategy.save_checkpoint`` hands DCP (the model's
  and the optimizer's, sharded, strided shards whole) and this rank's save plan. :func:`saved_index` combines every
  rank's plan as DCP's coordinator does -- refusing shards that overlap or leave part of a tensor out -- into the
  index (``.metadata``) the save would write.
* ``load`` (:func:`plan_load`): :func:`~lightning_galvatron.strategy.checkpoint.load_sharded_states`, what
  ``Trainer.fit(ckpt_path=...)`` runs for a sharded checkpoint, from another plan's index, each rank's reads planned
  against it instead of made: the entries, shapes and dtypes this plan asks for must be those the other plan saved
  (DCP refuses a missing entry or another shape), every read must fall inside its holder, and on a simulated GPU
  every holder must be on the rank's own GPU (:meth:`~lightning_galvatron.dryrun.nccl_rules.NcclRules.checkpoint_load`).

DCP's exchange of plans between the ranks (object collectives on the default group, alike on every rank by
construction) needs the other ranks' plans, which a simulated rank does not have: it is left out, with the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, SavePlan
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from lightning_galvatron.runtime.mesh import local_tensor
from lightning_galvatron.strategy.checkpoint import MODEL_KEY, load_sharded_states, whole_strided_tensors


def plan_save(module: nn.Module, optimizer: torch.optim.Optimizer) -> SavePlan:
    """This rank's part of a sharded save of ``module`` and ``optimizer``, as the strategy saves them."""
    options = StateDictOptions(full_state_dict=False, cpu_offload=True)  # as ModelParallelStrategy collects them
    state = {
        MODEL_KEY: get_model_state_dict(module, options=options),
        "optimizer_0": get_optimizer_state_dict(module, optimizer, options=options),
    }
    planner = DefaultSavePlanner()
    planner.set_up_planner(whole_strided_tensors(state), storage_meta=None, is_coordinator=dist.get_rank() == 0)
    return planner.create_local_plan()


def saved_index(plans: Sequence[SavePlan]) -> Metadata:
    """The index of the save whose ranks planned ``plans`` (every rank's, in rank order), as DCP's coordinator makes
    it (``ValueError`` for shards that overlap or leave part of a tensor out)."""
    _, index = DefaultSavePlanner().create_global_plan(list(plans))
    return index


def plan_load(module: nn.Module, optimizer: torch.optim.Optimizer, index: Metadata, rules: Any = None) -> int:
    """Load the checkpoint of ``index`` into ``module`` and ``optimizer`` as the strategy loads it, each read planned
    instead of made; ``rules``: the rank's :class:`~lightning_galvatron.dryrun.nccl_rules.NcclRules` on a simulated
    GPU. Returns how many reads were planned."""
    planned = [0]

    def read(holders: dict[str, Any], planner: Any) -> None:
        planner.set_up_planner(holders, index, is_coordinator=dist.get_rank() == 0)
        reads = planner.create_local_plan()
        planned[0] += len(reads.items)
        if rules is not None:
            flat = planner.state_dict.items()
            rules.checkpoint_load({fqn: local_tensor(v) for fqn, v in flat if isinstance(v, torch.Tensor)})
        for item in reads.items:
            if item.type != LoadItemType.BYTE_IO:
                planner.resolve_tensor(item)  # the part of its holder the read fills: DCP narrows it to fit

    load_sharded_states(
        read, set(index.state_dict_metadata), module, [optimizer], strict=True, name="saved by another plan"
    )
    return planned[0]
