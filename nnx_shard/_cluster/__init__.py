"""Processes and pods: the distributed runtime, the launcher, barriers, host-local data, TPU topologies."""

from nnx_shard._cluster._collectives import RECORDER, FlightRecorder, agree, first_divergence, recorded
from nnx_shard._cluster._coordination import (
    Keys,
    KeyValueStore,
    all_to_all,
    gather_json,
    process_mesh,
)
from nnx_shard._cluster._distributed import (
    FAILED_AT,
    PREVIOUS_PROCESSES,
    STOPPED_AT,
    LaunchInfo,
    initialize_distributed,
    launch_info,
)
from nnx_shard._cluster._launch import launch
from nnx_shard._cluster._multihost import (
    DATA_AXES,
    DEADLINE_EXCEEDED,
    DataShard,
    barrier_sync,
    data_shard,
    data_sharding,
    host_local_to_global,
)
from nnx_shard._cluster._tpu import CompileReport, compile_program, hbm_bytes, tpu_devices

__all__ = [
    "DATA_AXES",
    "DEADLINE_EXCEEDED",
    "FAILED_AT",
    "PREVIOUS_PROCESSES",
    "RECORDER",
    "STOPPED_AT",
    "CompileReport",
    "DataShard",
    "FlightRecorder",
    "KeyValueStore",
    "Keys",
    "LaunchInfo",
    "agree",
    "all_to_all",
    "barrier_sync",
    "compile_program",
    "data_shard",
    "data_sharding",
    "first_divergence",
    "gather_json",
    "hbm_bytes",
    "host_local_to_global",
    "initialize_distributed",
    "launch",
    "launch_info",
    "process_mesh",
    "recorded",
    "tpu_devices",
]
