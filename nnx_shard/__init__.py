"""nnx_shard: where every array of a Flax NNX training state lives.

The primary API is an ordered list of ``(regex, tactic)`` rules turned into a
``NamedSharding`` per leaf by :func:`infer_sharding`, then placement
(:func:`create_sharded`, :func:`place_like_target`), resharding
(:func:`reshard`), checkpoints (:class:`Checkpointer`,
:func:`restore_and_reshard`), :class:`ShardingHooks` and the :class:`Trainer`.
Every exception is also under :mod:`nnx_shard.errors`. The seeds' API
(eformer's rules and analyzer, big_vision's local-slice helpers) lives in
:mod:`nnx_shard.compat`; its names still resolve here, with a warning naming
their new home.
"""

# _base's face checks the jax/flax pair first: a pair that cannot import is named before flax is imported
from nnx_shard import errors, key_maps, sources
from nnx_shard._base import (
    Kind,
    Leaf,
    TrainingState,
    calculate_host_mesh_shape,
    clear_caches,
    create_mesh,
    describe_mesh,
    flatten_state,
    format_bytes,
    mesh_from_string,
    parse_mesh_dims,
)
from nnx_shard._checkpoint import Checkpointer, RestoreOptions, RestoreReport, abstract_target
from nnx_shard._cluster import (
    CompileReport,
    DataShard,
    LaunchInfo,
    barrier_sync,
    data_shard,
    data_sharding,
    host_local_to_global,
    initialize_distributed,
    launch,
    launch_info,
    tpu_devices,
)
from nnx_shard._live import (
    ResizeReport,
    ShardingHooks,
    create_sharded,
    place_like_target,
    restore_and_reshard,
    sharded_init_fn,
)
from nnx_shard._reshard import (
    LeafReshard,
    ReshardPlan,
    Route,
    find_intermediate_sharding,
    plan_reshard,
    reshard,
)
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
from nnx_shard._suggest import Suggestion, suggest
from nnx_shard._trainer import Trainer, default_config
from nnx_shard._version import __version__
from nnx_shard._weights import LoadReport, load_safetensors, save_peft_adapters, save_safetensors
from nnx_shard.errors import *  # noqa: F403  (every exception and warning, also under ns.errors)
from nnx_shard.errors import __all__ as _ERRORS

__all__ = [
    *_ERRORS,
    "compat",
    "errors",
    "key_maps",
    "sources",
    "Checkpointer",
    "CompileReport",
    "DataShard",
    "LaunchInfo",
    "Kind",
    "Leaf",
    "LeafPlacement",
    "LeafReshard",
    "LoadReport",
    "ReshardPlan",
    "ResizeReport",
    "RestoreOptions",
    "RestoreReport",
    "Route",
    "ShardingHooks",
    "ShardingPlan",
    "Tactic",
    "Suggestion",
    "Trainer",
    "TrainingState",
    "__version__",
    "abstract_target",
    "annotated",
    "auto_axes",
    "barrier_sync",
    "calculate_host_mesh_shape",
    "clear_caches",
    "create_mesh",
    "create_sharded",
    "data_shard",
    "data_sharding",
    "default_config",
    "describe_mesh",
    "find_intermediate_sharding",
    "flatten_state",
    "format_bytes",
    "fsdp",
    "host_local_to_global",
    "infer_sharding",
    "initialize_distributed",
    "launch",
    "launch_info",
    "load_safetensors",
    "logical_to_mesh",
    "mesh_from_string",
    "parse_mesh_dims",
    "parse_tactic",
    "place_like_target",
    "plan_reshard",
    "plan_sharding",
    "register_tactic",
    "replicate",
    "reshard",
    "restore_and_reshard",
    "save_peft_adapters",
    "save_safetensors",
    "shard_dim",
    "suggest",
    "sharded_init_fn",
    "spec",
    "stacked",
    "tpu_devices",
    "unregister_tactic",
]


# The seeds' names (eformer, big_vision, the NNX sharding-utils module) live in nnx_shard.compat;
# from the top level they still work, with one warning each naming where they moved.
from nnx_shard import compat

_COMPAT = frozenset(compat.__all__)  # the seeds' names, from the top level with a warning
_warned: set[str] = set()


def __getattr__(name: str) -> object:
    if name in _COMPAT:
        import warnings

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


def __dir__() -> list[str]:  # the compatibility names are not listed: tools that walk dir() warn on none
    return sorted(__all__)
