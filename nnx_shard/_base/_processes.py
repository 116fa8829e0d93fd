"""What each process says, heard by all: small JSON values gathered across the job's processes."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh


def gather_json(value: Any) -> list[Any]:
    """Every process's ``value`` (anything JSON holds), in process order: a collective of every process.

    >>> gather_json({"step": 3})  # one process
    [{'step': 3}]
    """
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    if jax.process_count() == 1:
        return [json.loads(data.tobytes())]
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).ravel()
    raw = np.zeros((int(sizes.max()),), np.uint8)
    raw[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(raw)).reshape(len(sizes), -1)
    return [json.loads(r[:size].tobytes()) for r, size in zip(rows, sizes, strict=True)]


def mesh_processes(mesh: Mesh) -> list[int]:
    """The processes holding devices of ``mesh``, in order (fewer than ``jax.process_count()`` when it leaves
    some out, after a resize).

    >>> from nnx_shard import create_mesh
    >>> mesh_processes(create_mesh((8,), ("fsdp",)))
    [0]
    """
    return sorted({d.process_index for d in mesh.devices.flat})


def holding_processes(arrays: Any) -> set[int]:
    """The processes holding a device of any of ``arrays``' shardings."""
    return {d.process_index for x in jax.tree.leaves(arrays) for d in x.sharding.device_set}
