"""In-memory snapshots, between the persistent checkpoints (``_checkpoint``) and the live state (``_live``):
the writer, the device copy, the file format, the peer exchange, the reader, and the restore's source."""

from nnx_shard._snapshots._file import own_shards, snapshot_own_bytes, unpack
from nnx_shard._snapshots._reader import restore_from_snapshots
from nnx_shard._snapshots._source import Snapshots
from nnx_shard._snapshots._writer import SnapshotWriter, default_snapshot_dir, snapshot_folder

__all__ = ["SnapshotWriter", "Snapshots", "default_snapshot_dir", "own_shards", "restore_from_snapshots"]
__all__ += ["snapshot_folder", "snapshot_own_bytes", "unpack"]
