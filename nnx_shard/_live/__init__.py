"""Live state: placement and sharded creation, the owner (ShardingHooks), restore_and_reshard, resize."""

from nnx_shard._live._hooks import ShardingHooks
from nnx_shard._live._placement import create_sharded, place_like_target, sharded_init_fn
from nnx_shard._live._resize import ResizeReport
from nnx_shard._live._restore_objects import restore_and_reshard, restore_options

__all__ = [
    "ResizeReport",
    "ShardingHooks",
    "create_sharded",
    "place_like_target",
    "restore_and_reshard",
    "restore_options",
    "sharded_init_fn",
]
