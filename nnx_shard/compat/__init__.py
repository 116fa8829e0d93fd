"""The seeds' API, built on the core and never imported by it.

Users coming from eformer (escale), big_vision or the original NNX
sharding-utils module find their names here (and, re-exported, in
``nnx_shard`` itself): ``ShardingRule`` and the automatic rules,
``ShardingAnalyzer``, ``create_monitored_function``, ``MeshPartitionHelper``,
big_vision's local-slice helpers, eformer's mesh helpers and pathwaysutils'
``reshard_with_intermediate_sharding``. The primary API
is the regex-tactic strategy of :func:`nnx_shard.infer_sharding`; a
``ShardingRule`` instance may stand as a tactic in it.

>>> import nnx_shard.compat as compat
>>> from nnx_shard import create_mesh
>>> rule = compat.AutoShardingRule(create_mesh((8,), ("fsdp",)))
>>> rule.apply(jax.ShapeDtypeStruct((16, 4), "float32"))
P('fsdp', None)
"""

import jax  # noqa: F401  (used by the doctest above)

from nnx_shard.compat._analysis import ShardingAnalyzer, create_monitored_function
from nnx_shard.compat._eformer_mesh import (
    cpu_context,
    create_cpu_mesh,
    create_device_mesh,
    force_cpu,
    parse_mesh_from_string,
)
from nnx_shard.compat._local_slice import get_local_slice_from_fsarray, make_fsarray_from_local_slice
from nnx_shard.compat._partition_helper import MeshPartitionHelper
from nnx_shard.compat._pathways import reshard_with_intermediate_sharding
from nnx_shard.compat._rules import (
    AutoShardingRule,
    CompositeShardingRule,
    MemoryConstrainedShardingRule,
    RuleTactic,
    ShapeBasedShardingRule,
    ShardingRule,
    map_arrays,
)

__all__ = [
    "AutoShardingRule",
    "CompositeShardingRule",
    "MemoryConstrainedShardingRule",
    "MeshPartitionHelper",
    "RuleTactic",
    "ShapeBasedShardingRule",
    "ShardingAnalyzer",
    "ShardingRule",
    "cpu_context",
    "create_cpu_mesh",
    "create_device_mesh",
    "create_monitored_function",
    "force_cpu",
    "get_local_slice_from_fsarray",
    "make_fsarray_from_local_slice",
    "map_arrays",
    "parse_mesh_from_string",
    "reshard_with_intermediate_sharding",
]
