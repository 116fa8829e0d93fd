"""Every name of the 2026-11-25 surface still imports from ``nnx_shard``; a name that moved warns once."""

from __future__ import annotations

import warnings

import pytest

import nnx_shard as ns

# `nnx_shard.__all__`, `nnx_shard.errors.__all__` and `nnx_shard.compat.__all__` at 2ec5c46 (2026-11-25).
TOP = (
    "compat",
    "errors",
    "key_maps",
    "Checkpointer",
    "CompileReport",
    "LaunchInfo",
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
    "__version__",
    "abstract_target",
    "annotated",
    "auto_axes",
    "barrier_sync",
    "calculate_host_mesh_shape",
    "clear_caches",
    "create_mesh",
    "create_sharded",
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
    "reshard_with_intermediate_sharding",
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
)
ERRORS = (
    "BarrierTimeoutError",
    "BatchStructureError",
    "CLIError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointWarning",
    "CollectiveMismatchError",
    "CompileError",
    "ConfigError",
    "ConflictingArgumentsError",
    "DataPositionWarning",
    "DistributedNotInitializedError",
    "EmptyStateError",
    "EmptyStateKind",
    "IncompatibleVersionsError",
    "IndivisibleShardingError",
    "InvalidRegexError",
    "InvalidStrategyError",
    "LifecycleError",
    "LocalSliceError",
    "MeshAxisError",
    "MeshError",
    "MissingExtraError",
    "NnxShardError",
    "NnxShardWarning",
    "NoCheckpointError",
    "NoIntermediateShardingError",
    "NoIntermediateShardingNeededError",
    "NoLayoutFitsError",
    "PlacementError",
    "ReshardError",
    "ShardingConflictError",
    "ShardingError",
    "StateTypeError",
    "StorageError",
    "TacticArgumentError",
    "TacticError",
    "TacticSyntaxError",
    "TopologyError",
    "UnknownConfigKeyError",
    "UnknownTacticError",
    "UnmatchedLeavesError",
    "UnusedRuleWarning",
    "WeightsMismatchError",
    "WorkdirLockedError",
)
COMPAT = (
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
)


@pytest.mark.parametrize("name", sorted({*TOP, *ERRORS, *COMPAT}))
def test_every_name_of_the_2026_11_25_surface_still_imports(name, monkeypatch):
    monkeypatch.setattr(ns, "_warned", set())  # the warning comes once per process: as if for the first time
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(ns, name)
    assert value is not None
    moved = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    if name in ns.__all__:
        assert not moved, name
    elif name in ns.MOVED:  # into a namespace (ns.sharding, ns.meshes, ...): the warning says which
        home = ns.MOVED[name]
        assert getattr(home, name) is value and name in home.__all__
        assert moved and f"from {home.__name__} import {name}" in str(moved[0].message)
    else:  # a compatibility name, from nnx_shard.compat now: the warning says where
        assert name in ns.compat.__all__ and getattr(ns.compat, name) is value
        assert moved and f"from nnx_shard.compat import {name}" in str(moved[0].message)


def test_the_top_level_keeps_the_everyday_names_and_the_rest_is_in_namespaces():
    """As optax and equinox: a short top level (beside the exceptions), every other name in one namespace."""
    everyday = [n for n in ns.__all__ if n not in ns.errors.__all__]
    assert len(everyday) <= 40, everyday
    namespaces = [ns.sharding, ns.meshes, ns.placement, ns.resharding, ns.cluster, ns.weights, ns.sources]
    homes: dict[str, list[str]] = {}
    for module in namespaces:
        for name in module.__all__:
            homes.setdefault(name, []).append(module.__name__)
            assert getattr(module, name) is not None
    for name in TOP:
        assert name in ns.__all__ or name in homes or name in ns.compat.__all__, name
    assert ns.sharding.fsdp is ns.MOVED["fsdp"].fsdp and ns.meshes.describe_mesh is not None


def test_pathwaysutils_name_lives_in_compat():
    assert "reshard_with_intermediate_sharding" not in ns.__all__
    assert "reshard_with_intermediate_sharding" in ns.compat.__all__
