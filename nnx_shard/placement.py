"""State onto its shardings without a whole array on one device: sharded creation, placement of
loaded values, abstract targets. ``create_sharded`` and ``place_like_target`` are also at the top level."""

from nnx_shard._checkpoint import abstract_target
from nnx_shard._live import create_sharded, place_like_target, sharded_init_fn

__all__ = ["abstract_target", "create_sharded", "place_like_target", "sharded_init_fn"]
