"""From one sharding to another, each byte moved once: the plan, its routes, intermediate shardings.
``reshard`` is also at the top level."""

from nnx_shard._reshard import (
    LeafReshard,
    ReshardPlan,
    Route,
    find_intermediate_sharding,
    plan_reshard,
    reshard,
)

__all__ = ["LeafReshard", "ReshardPlan", "Route", "find_intermediate_sharding", "plan_reshard", "reshard"]
