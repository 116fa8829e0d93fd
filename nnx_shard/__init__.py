"""nnx_shard: where every array of a Flax NNX training state lives."""

from nnx_shard.analysis import ShardingAnalyzer, create_monitored_function
from nnx_shard.errors import (
    IndivisibleShardingError,
    InvalidStrategyError,
    MeshAxisError,
    MeshError,
    ShardingConflictError,
    ShardingError,
    TacticArgumentError,
    TacticError,
    TacticSyntaxError,
    UnknownTacticError,
    UnmatchedLeavesError,
)
from nnx_shard.inference import (
    InvalidRegexError,
    UnusedRuleWarning,
    infer_sharding,
    plan_sharding,
)
from nnx_shard.mesh import (
    calculate_host_mesh_shape,
    cpu_context,
    create_cpu_mesh,
    create_device_mesh,
    create_mesh,
    describe_mesh,
    force_cpu,
    parse_mesh_dims,
    parse_mesh_from_string,
)
from nnx_shard.partition_helper import MeshPartitionHelper
from nnx_shard.paths import Leaf, flatten_state
from nnx_shard.placement import PlacementError, create_sharded, place_like_target, sharded_init_fn
from nnx_shard.plan import LeafPlacement, ShardingPlan
from nnx_shard.rules import (
    AutoShardingRule,
    CompositeShardingRule,
    MemoryConstrainedShardingRule,
    ShapeBasedShardingRule,
    ShardingRule,
)
from nnx_shard.tactics import (
    Tactic,
    annotated,
    fsdp,
    parse_tactic,
    register_tactic,
    replicate,
    shard_dim,
    spec,
)

__version__ = "0.1.0"

__all__ = [
    "AutoShardingRule",
    "CompositeShardingRule",
    "IndivisibleShardingError",
    "InvalidRegexError",
    "InvalidStrategyError",
    "Leaf",
    "LeafPlacement",
    "MemoryConstrainedShardingRule",
    "MeshAxisError",
    "MeshError",
    "MeshPartitionHelper",
    "PlacementError",
    "ShapeBasedShardingRule",
    "ShardingAnalyzer",
    "ShardingConflictError",
    "ShardingError",
    "ShardingPlan",
    "ShardingRule",
    "Tactic",
    "TacticArgumentError",
    "TacticError",
    "TacticSyntaxError",
    "UnknownTacticError",
    "UnmatchedLeavesError",
    "UnusedRuleWarning",
    "__version__",
    "annotated",
    "calculate_host_mesh_shape",
    "cpu_context",
    "create_cpu_mesh",
    "create_device_mesh",
    "create_mesh",
    "create_monitored_function",
    "create_sharded",
    "describe_mesh",
    "flatten_state",
    "force_cpu",
    "fsdp",
    "infer_sharding",
    "parse_mesh_dims",
    "parse_mesh_from_string",
    "parse_tactic",
    "place_like_target",
    "plan_sharding",
    "register_tactic",
    "replicate",
    "shard_dim",
    "sharded_init_fn",
    "spec",
]
