"""Plans and the rules they must follow: the torch-free core that the search writes and the runtime reads.

``parallel_plan`` is the plan itself (re-exported here: ``from lightning_galvatron.plan import ParallelPlan``),
``layout`` how its ranks form meshes, ``rules`` what each kind of parallelism needs of a model. Nothing in this
package imports torch or Lightning: plans are built, checked and stored offline.
"""

from lightning_galvatron.plan.parallel_plan import (
    DP_TYPES,
    PLAN_FORMAT,
    PLAN_VERSION,
    SCHEDULES,
    SP_KINDS,
    LayerStrategy,
    ParallelPlan,
    PlanError,
    check_plan_source,
    divisors,
    even_partition,
    is_galvatron_format,
    load_plan,
    world_size_mismatch,
)

__all__ = [
    "DP_TYPES",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "SCHEDULES",
    "SP_KINDS",
    "LayerStrategy",
    "ParallelPlan",
    "PlanError",
    "check_plan_source",
    "divisors",
    "even_partition",
    "is_galvatron_format",
    "load_plan",
    "world_size_mismatch",
]
