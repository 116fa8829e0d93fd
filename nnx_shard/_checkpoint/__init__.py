"""Checkpoints: the Checkpointer, reads, plain Orbax, faults, fingerprints, snapshots, and restores onto
shardings."""

from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._faults import quiet
from nnx_shard._checkpoint._format import (
    abstract_target,
    storable,
    tree_fingerprints,
)
from nnx_shard._checkpoint._restore import restore_onto
from nnx_shard._checkpoint._restore_options import RestoreOptions, RestoreReport, renamed

# the kinds of source, registered in the order a restore asks them (a path no other takes is plain Orbax's)
from nnx_shard._checkpoint._source_checkpoint import CheckpointSource  # isort: skip
from nnx_shard._checkpoint._source_safetensors import SafetensorsFolder  # isort: skip
from nnx_shard._checkpoint._source_loaded import LoadedState, check_keys  # isort: skip
from nnx_shard._checkpoint._source_snapshots import Snapshots  # isort: skip
from nnx_shard._checkpoint._source_orbax import OrbaxSource  # isort: skip
from nnx_shard._checkpoint._snapshot import SnapshotWriter, default_snapshot_dir, snapshot_folder
from nnx_shard._checkpoint._snapshot_file import snapshot_own_bytes
from nnx_shard._checkpoint._snapshot_read import Restored, restore_from_snapshots
from nnx_shard._checkpoint._sources import (
    ReadRequest,
    Source,
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
    "Restored",
    "SafetensorsFolder",
    "SnapshotWriter",
    "Snapshots",
    "Source",
    "WorkdirLock",
    "abstract_target",
    "as_source",
    "check_keys",
    "default_snapshot_dir",
    "quiet",
    "register_source",
    "registered",
    "renamed",
    "restore_from_snapshots",
    "restore_onto",
    "snapshot_folder",
    "snapshot_own_bytes",
    "storable",
    "tree_fingerprints",
    "unregister_source",
]
