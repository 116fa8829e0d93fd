"""Several processes and TPU pods: the distributed runtime, the launcher, barriers, data per process,
TPU topologies. ``barrier_sync`` is also at the top level."""

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

__all__ = [
    "CompileReport",
    "DataShard",
    "LaunchInfo",
    "barrier_sync",
    "data_shard",
    "data_sharding",
    "host_local_to_global",
    "initialize_distributed",
    "launch",
    "launch_info",
    "tpu_devices",
]
