"""nnx_shard: where every array of a Flax NNX training state lives.

The everyday names are here, as optax and equinox keep theirs: an ordered list of ``(regex, tactic)``
rules turned into a ``NamedSharding`` per leaf by :func:`infer_sharding` / :func:`plan_sharding`,
sharded creation and placement (:func:`create_sharded`, :func:`place_like_target`), :func:`reshard`,
checkpoints (:class:`Checkpointer`, :func:`restore_and_reshard`), the training state
(:class:`TrainingState`), :class:`ShardingHooks` and the :class:`Trainer`. The rest is in namespaces:
:mod:`nnx_shard.sharding` (tactics and leaves), :mod:`nnx_shard.meshes`, :mod:`nnx_shard.placement`,
:mod:`nnx_shard.resharding`, :mod:`nnx_shard.cluster`, :mod:`nnx_shard.weights`,
:mod:`nnx_shard.key_maps`, :mod:`nnx_shard.sources` (where a restore reads from) and
:mod:`nnx_shard.errors` (every exception, also here). A name that moved into a namespace, and the seeds'
API (:mod:`nnx_shard.compat`), still resolve here, with a warning naming their new home.
"""

# _base's face checks the jax/flax pair first: a pair that cannot import is named before flax is imported
from nnx_shard import cluster, errors, key_maps, meshes, placement, resharding, sharding, sources, weights
from nnx_shard._base import TrainingState, clear_caches, create_mesh, format_bytes
from nnx_shard._checkpoint import Checkpointer, RestoreOptions, RestoreReport
from nnx_shard._cluster import barrier_sync
from nnx_shard._live import (
    ResizeReport,
    ShardingHooks,
    create_sharded,
    place_like_target,
    restore_and_reshard,
)
from nnx_shard._reshard import reshard
from nnx_shard._sharding import ShardingPlan, infer_sharding, plan_sharding
from nnx_shard._suggest import Suggestion, suggest
from nnx_shard._trainer import Trainer, default_config
from nnx_shard._version import __version__
from nnx_shard._weights import load_safetensors, save_safetensors
from nnx_shard.errors import *  # noqa: F403  (every exception and warning, also under ns.errors)
from nnx_shard.errors import __all__ as _ERRORS

__all__ = [
    *_ERRORS,
    "cluster",
    "compat",
    "errors",
    "key_maps",
    "meshes",
    "placement",
    "resharding",
    "sharding",
    "sources",
    "weights",
    "Checkpointer",
    "ResizeReport",
    "RestoreOptions",
    "RestoreReport",
    "ShardingHooks",
    "ShardingPlan",
    "Suggestion",
    "Trainer",
    "TrainingState",
    "__version__",
    "barrier_sync",
    "clear_caches",
    "create_mesh",
    "create_sharded",
    "default_config",
    "format_bytes",
    "infer_sharding",
    "load_safetensors",
    "place_like_target",
    "plan_sharding",
    "reshard",
    "restore_and_reshard",
    "save_safetensors",
    "suggest",
]

# Names that moved from the top level into a namespace (see CHANGELOG): they still resolve here, with one
# warning.
MOVED = {
    name: namespace
    for namespace in (sharding, meshes, placement, resharding, cluster, weights)
    for name in namespace.__all__
    if name not in __all__ and name != "Kind"  # Kind is new: only in nnx_shard.sharding
}

# The seeds' names (eformer, big_vision, the NNX sharding-utils module) live in nnx_shard.compat;
# from the top level they still work, with one warning each naming where they moved.
from nnx_shard import compat  # noqa: E402  (after the core: compat imports it)

_COMPAT = frozenset(compat.__all__)  # the seeds' names, from the top level with a warning
_warned: set[str] = set()


def __getattr__(name: str) -> object:
    import warnings

    if name in MOVED:
        home = MOVED[name].__name__
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"nnx_shard.{name} is now {home}.{name} (the top level keeps the everyday names): "
                f"from {home} import {name}.",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(MOVED[name], name)
    if name in _COMPAT:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"nnx_shard.{name} is a compatibility name of the seeds' API: import it from "
                f"nnx_shard.compat (from nnx_shard.compat import {name}).",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(compat, name)
    raise AttributeError(f"module 'nnx_shard' has no attribute {name!r}")


def __dir__() -> list[str]:  # the moved and compatibility names are not listed: walking dir() warns on none
    return sorted(__all__)
