"""Dry runs: apply a plan as any rank of any world size and step it, without the hardware.

``lightning-galvatron dry-run`` and :func:`dry_run` answer, before a cluster is booked, whether a plan
applies and fits on every rank: each simulated rank (its own process, torch's ``fake`` process-group
backend, fake tensors) applies the plan with the runtime's own code and runs one step of training,
validation and a checkpoint save (:mod:`.rank`); it reports the blocks and parameters it holds, its
process groups, its peak memory by category as torch's ``MemTracker`` measured it (:mod:`.memory`),
next to what the cost model (:func:`lightning_galvatron.search.evaluate`) predicts for its stage.
Simulating every rank also proves the collective order (:mod:`.trace`): every member of every group
issued the same operations in the same order, the one rule whose violation hangs a job. Given the dry
run of another plan (``dry_run(..., load_from=)``), each rank also loads that plan's checkpoint as a
resume does, its reads planned against the save's index (:mod:`.checkpoint`).

With ``device="cuda"`` (``--device cuda``) every rank holds fake tensors on its own simulated GPU, its
``torch.cuda`` calls are answered by a simulated device (:mod:`.cuda`), and NCCL's rules are checked on
every collective, host synchronisations counted per step (:mod:`.nccl_rules`).

What is simulated, not observed: values exchanged between ranks (the fake backend moves no data:
object collectives hand each rank its own object, values read back from tensors are placeholders),
and time. Memory is that of the CPU code path (attention through PyTorch's CPU SDPA kernels), without
the allocator's caching and fragmentation or the CUDA context.
"""

from typing import Any

PHASES = ("train", "validate", "checkpoint")

_EXPORTS = {
    "dry_run": "run",
    "DryRunReport": "run",
    "ModelSource": "models",
    "CausalLMModule": "models",
    "check_order": "trace",
    "OrderCheck": "trace",
    "sample_ranks": "driver",
    "shortened_plan": "run",
}
__all__ = [
    "PHASES",
    "CausalLMModule",
    "DryRunReport",
    "ModelSource",
    "OrderCheck",
    "check_order",
    "dry_run",
    "sample_ranks",
    "shortened_plan",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: the CLI registers its subcommand without loading torch and Lightning.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"lightning_galvatron.dryrun.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'lightning_galvatron.dryrun' has no attribute {name!r}")
