"""Resharding across meshes and device counts on plain JAX: a planner with typed routes and its executor.

Each leaf takes one :class:`Route`. The collective route runs one SPMD program
over the source and target devices that sends every piece a target device
lacks exactly once (``jax.lax.ppermute``), so bytes moved equal the ideal,
nothing is gathered onto one device and nothing goes through the host.
"""

from nnx_shard._reshard._executor import plan_reshard, reshard
from nnx_shard._reshard._host import from_host
from nnx_shard._reshard._intermediate import find_intermediate_sharding
from nnx_shard._reshard._planner import LeafReshard, ReshardPlan, Route

__all__ = [
    "LeafReshard",
    "ReshardPlan",
    "Route",
    "find_intermediate_sharding",
    "from_host",
    "plan_reshard",
    "reshard",
]
