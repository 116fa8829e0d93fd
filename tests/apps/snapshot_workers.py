"""Workers of tests/checkpoint/test_snapshot.py: each process writes in-memory snapshots of a sharded
state."""

from __future__ import annotations

import hashlib

import numpy as np


def write(folder: str, domain: str = "") -> dict:
    import os

    import jax
    from jax.experimental import multihost_utils

    import nnx_shard as ns
    from nnx_shard._checkpoint import SnapshotWriter, snapshot_own_bytes

    if domain:
        os.environ["NNX_SHARD_FAILURE_DOMAIN"] = f"{domain}{jax.process_index() // 2}"

    states = _states(ns.create_mesh((jax.device_count(),), ("fsdp",)))
    writer = SnapshotWriter(folder, keep=2)
    need = writer.check_space(snapshot_own_bytes(states))
    for step in (3, 6, 9):
        writer.write(step, states)
    writer.wait()
    digests = {}
    for path, x in ns.sharding.flatten_state(states):
        whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        digests[path] = hashlib.sha256(whole.tobytes()).hexdigest()
    return {"dest": writer.dest, "need": need, "bytes": list(writer.last_bytes), "digests": digests}


def restore_onto_more(folder: str) -> dict:
    """Process 0 held the snapshot of a 1-process run; process 1 is new: both restore it onto 2 x 2
    devices."""
    from pathlib import Path

    import jax
    from jax.experimental import multihost_utils

    import nnx_shard as ns
    from nnx_shard._checkpoint._snapshot_read import restore_from_snapshots

    mesh = ns.create_mesh((jax.device_count(),), ("fsdp",))
    target = _states(mesh, seed=7)
    mine = Path(folder) / "process-0" if jax.process_index() == 0 else None
    got = restore_from_snapshots(mine, 1, target, after=-1)
    digests = {}
    for path, x in ns.sharding.flatten_state(got.states):
        whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        digests[path] = hashlib.sha256(whole.tobytes()).hexdigest()
    devices = {path: len(x.sharding.device_set) for path, x in ns.sharding.flatten_state(got.states)}
    return {"step": got.step, "digests": digests, "devices": devices}


def _states(mesh, seed: int = 0) -> dict:
    import optax
    from flax import nnx

    import nnx_shard as ns

    def create():
        model = nnx.Sequential(
            nnx.Linear(8, 64, rngs=nnx.Rngs(seed)), nnx.Linear(64, 8, rngs=nnx.Rngs(seed + 1))
        )
        return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)}

    objects, _ = ns.create_sharded(create, [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh)
    return {k: nnx.state(v) for k, v in objects.items()}
