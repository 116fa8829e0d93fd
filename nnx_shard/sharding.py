"""Rules to shardings, in detail: the tactics, their registry, the leaves a tactic sees and what a plan
says of each. The everyday ``infer_sharding``, ``plan_sharding`` and ``ShardingPlan`` are also at the top
level.

>>> import nnx_shard as ns
>>> ns.sharding.fsdp(axis="fsdp", min_size_to_shard_mb=0)
fsdp(axis='fsdp', min_size_to_shard_mb=0)
"""

from nnx_shard._base import Kind, Leaf, flatten_state
from nnx_shard._sharding import (
    LeafPlacement,
    ShardingPlan,
    Tactic,
    annotated,
    auto_axes,
    fsdp,
    infer_sharding,
    logical_to_mesh,
    parse_tactic,
    plan_sharding,
    register_tactic,
    replicate,
    shard_dim,
    spec,
    stacked,
    unregister_tactic,
)

__all__ = [
    "Kind",
    "Leaf",
    "LeafPlacement",
    "ShardingPlan",
    "Tactic",
    "annotated",
    "auto_axes",
    "flatten_state",
    "fsdp",
    "infer_sharding",
    "logical_to_mesh",
    "parse_tactic",
    "plan_sharding",
    "register_tactic",
    "replicate",
    "shard_dim",
    "spec",
    "stacked",
    "unregister_tactic",
]
