"""Which processes hold a mesh or arrays (the collectives between processes are ``_cluster``'s)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh


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
