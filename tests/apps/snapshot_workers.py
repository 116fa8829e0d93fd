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


def exchange_when_packed(folder: str) -> dict:
    """Snapshots every 10 steps of 30 ms, each one's packing slowed by 0.15 s in the background, then a
    second writer (a next ``train()`` call) with one snapshot: the step and wait at which each snapshot's
    copy went to the peer, the bytes received, what the steps waited, and the copy's programs built and
    compiled."""
    import time

    import jax

    import nnx_shard as ns
    from nnx_shard._checkpoint import SnapshotWriter, _snapshot, _snapshot_peer
    from nnx_shard._cluster import process_mesh

    real_header, real_exchange = _snapshot.header_bytes, _snapshot.exchange
    at, sent = [0], []

    def slow_header(*args):
        time.sleep(0.15)
        return real_header(*args)

    def exchange(buf, dest):
        sent.append(at[0])
        return real_exchange(buf, dest)

    _snapshot.header_bytes, _snapshot.exchange = slow_header, exchange
    states = _states(ns.create_mesh((jax.device_count(),), ("fsdp",)))
    writer = SnapshotWriter(folder, keep=2)
    taken, waited = [], []
    for step in range(1, 51):
        at[0] = step - 1
        writer.poll(step - 1)  # before the step, as the Trainer's loop
        time.sleep(0.03)
        if step % 10 == 0 and step < 50:
            if writer.phases:  # the last snapshot, finished: what its copy's step waited for the packing
                waited.append(writer.phases["on_the_steps_path"]["packing_waited"])
            # headers of different lengths: the copies' lengths differ by a few bytes
            taken.append(writer.write(step, states, {"pad": "x" * step}, skip_if_busy=True))
    writer.wait()
    waited.append(writer.phases["on_the_steps_path"]["packing_waited"])
    peers = sorted(p.name for p in writer.folder.glob("step-*/peer-*.bin"))
    sends = _snapshot_peer._ppermute(process_mesh(), tuple(writer.dest))
    background, skipped = list(writer.phases["in_the_background"]), writer.skipped
    writer.close(remove=False)
    writer = SnapshotWriter(folder, keep=2)  # the next train() call's: its steps go on
    for step in range(51, 66):
        at[0] = step - 1
        writer.poll(step - 1)
        time.sleep(0.03)
        if step == 60:
            taken.append(writer.write(step, states, skip_if_busy=True))
    writer.close(remove=True)
    return {
        "taken": taken,
        "sent": sent,
        "waited": waited,
        "next_call_waited": writer.phases["on_the_steps_path"]["packing_waited"],
        "peers": peers,
        "skipped": skipped + writer.skipped,
        "programs": [_snapshot_peer._ppermute.cache_info().misses, sends._cache_size()],
        "background": background,
    }


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
