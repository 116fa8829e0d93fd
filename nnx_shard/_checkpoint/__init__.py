"""Checkpoints: the Checkpointer, reads, plain Orbax, faults, fingerprints, snapshots, and restores onto shardings."""

from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._faults import quiet
from nnx_shard._checkpoint._format import (
    abstract_target,
    storable,
    tree_fingerprints,
)
from nnx_shard._checkpoint._plain import plain_source
from nnx_shard._checkpoint._restore import RestoreOptions, RestoreReport, restore_onto
from nnx_shard._checkpoint._snapshot import SnapshotWriter, default_snapshot_dir, snapshot_folder
from nnx_shard._checkpoint._snapshot_file import snapshot_own_bytes
from nnx_shard._checkpoint._snapshot_read import Restored, restore_from_snapshots
from nnx_shard._checkpoint._workdir import WorkdirLock

__all__ = [
    "Checkpointer",
    "RestoreOptions",
    "RestoreReport",
    "Restored",
    "SnapshotWriter",
    "WorkdirLock",
    "abstract_target",
    "default_snapshot_dir",
    "plain_source",
    "quiet",
    "restore_from_snapshots",
    "restore_onto",
    "snapshot_folder",
    "snapshot_own_bytes",
    "storable",
    "tree_fingerprints",
]
