"""Persistent checkpoints: the Checkpointer, reads, plain Orbax, faults, fingerprints, and restores onto
shardings (the in-memory snapshots are ``_snapshots``, above this layer)."""

from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._faults import quiet
from nnx_shard._checkpoint._fingerprint_shares import (
    block_base,
    block_fingerprint,
    block_share,
    word_shape,
    word_strides,
)
from nnx_shard._checkpoint._format import abstract_target, leaf_paths, map_leaves, storable, tree_fingerprints
from nnx_shard._checkpoint._restore import restore_onto
from nnx_shard._checkpoint._restore_options import RestoreOptions, RestoreReport, renamed

# the kinds of source, registered in the order a restore asks them (a path no other takes is plain Orbax's)
from nnx_shard._checkpoint._source_checkpoint import CheckpointSource, newest_listed  # isort: skip
from nnx_shard._checkpoint._source_safetensors import SafetensorsFolder  # isort: skip
from nnx_shard._checkpoint._source_loaded import LoadedState, check_keys  # isort: skip
from nnx_shard._checkpoint._source_orbax import OrbaxSource  # isort: skip
from nnx_shard._checkpoint._sources import (
    ReadRequest,
    Source,
    SourceDefaults,
    as_source,
    register_source,
    registered,
    unregister_source,
)
from nnx_shard._checkpoint._workdir import WorkdirLock

__all__ = [
    "CheckpointSource",
    "Checkpointer",
    "LoadedState",
    "OrbaxSource",
    "ReadRequest",
    "RestoreOptions",
    "RestoreReport",
    "SafetensorsFolder",
    "Source",
    "SourceDefaults",
    "WorkdirLock",
    "abstract_target",
    "as_source",
    "block_base",
    "block_fingerprint",
    "block_share",
    "check_keys",
    "leaf_paths",
    "map_leaves",
    "newest_listed",
    "quiet",
    "register_source",
    "registered",
    "renamed",
    "restore_onto",
    "storable",
    "tree_fingerprints",
    "unregister_source",
    "word_shape",
    "word_strides",
]
