"""Workers of tests/snapshots/: each process writes in-memory snapshots of a sharded
state."""

from __future__ import annotations

import hashlib

import numpy as np


def watched(what: str) -> None:
    """A watchdog over the worker's collectives, as the Trainer's ``step_timeout``: a hang ends the process
    within a minute naming ``what`` and the collective it waits in, not at the harness's deadline."""
    from nnx_shard._trainer._watchdog import Watchdog
    from tests.apps.trainer_app import MULTIPROCESS_STEP_TIMEOUT

    Watchdog().arm(what, MULTIPROCESS_STEP_TIMEOUT, "step_timeout")


def write(folder: str, domain: str = "") -> dict:
    import os

    import jax
    from jax.experimental import multihost_utils

    import nnx_shard as ns
    from nnx_shard._snapshots import SnapshotWriter, _peer, snapshot_own_bytes

    _peer.PART_BYTES = 2**12  # each copy spans several parts: the peer's file is checked byte for byte
    if domain:
        os.environ["NNX_SHARD_FAILURE_DOMAIN"] = f"{domain}{jax.process_index() // 2}"

    watched("the snapshot worker")
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


def delayed(folder: str, slow: str) -> dict:
    """Snapshots every 10 steps of 30 ms, each with process 1's ``slow`` part (its ``packing``, the
    ``receive`` of the peer's copy, or the ``copy`` on the step) delayed by 0.15 s, then a second writer (a
    next ``train()`` call) with one snapshot: this process's journal of collectives, the steps at which the
    copies went to the peer, the peer copies kept, and the copy's programs built and compiled."""
    import time

    import jax

    import nnx_shard as ns
    from nnx_shard._cluster import RECORDER
    from nnx_shard._snapshots import SnapshotWriter, _peer, _writer

    at, sent = [0], []
    real = {"packing": "sum_shares", "receive": "received", "copy": "copy_in"}[slow]
    original, start_exchange = getattr(_writer, real), SnapshotWriter._exchange

    def slowed(*args):
        time.sleep(0.15)
        return original(*args)

    def exchange(writer, snapshot):
        sent.append(at[0])
        return start_exchange(writer, snapshot)

    watched("the delayed snapshot worker")
    states = _states(ns.create_mesh((jax.device_count(),), ("fsdp",)))
    # the copy's program compiled and its communicator made first, as a job's first snapshot does beside its
    # steps: on a loaded machine that first time can outlast the 9 steps to the next snapshot, then skipped
    warm = SnapshotWriter(f"{folder}-warm", keep=1)
    warm.write(0, states, {"pad": ""})
    warm.close(remove=True)
    if jax.process_index() == 1:
        setattr(_writer, real, slowed)
    SnapshotWriter._exchange = exchange
    RECORDER.keep_journal()
    taken = []
    for calls in ((1, 51), (51, 66)):  # the second: the next train() call's writer, its steps going on
        writer = SnapshotWriter(folder, keep=2)
        for step in range(*calls):
            at[0] = step - 1
            writer.poll(step - 1)  # before the step, as the Trainer's loop
            time.sleep(0.03)
            if step % 10 == 0 and step not in (50,):
                # headers of different lengths: the copies' lengths differ by a few bytes
                taken.append(writer.write(step, states, {"pad": "x" * step}, skip_if_busy=True))
        writer.wait()
        peers = sorted(p.name for p in writer.folder.glob("step-*/peer-*.bin"))
        writer.close(remove=calls[0] == 51)
    sends = _peer._ppermute(tuple(writer.dest))[0]
    return {
        "journal": RECORDER.journal,
        "taken": taken,
        "sent": sent,
        "peers": peers,
        "skipped": writer.skipped,
        "programs": [_peer._ppermute.cache_info().misses, sends._cache_size()],
    }


def beside_a_steps_ppermute(folder: str) -> dict:
    """Snapshots every 5 steps of a job of one device per process whose steps are 10 ``ppermute``s each over
    every device in process order (as a pipeline's or a ring attention's), of 1 MiB and 1 KiB in turn, while
    each copy goes to the peer in 4 KiB parts from the writer's thread: the steps whose values came back
    wrong, and the steps of the snapshots kept."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import nnx_shard as ns
    from nnx_shard._snapshots import SnapshotWriter, _peer

    _peer.PART_BYTES = 2**12  # each copy in 256 parts
    watched("the worker whose steps ppermute")
    n, me = jax.process_count(), jax.process_index()
    mesh = ns.create_mesh((n,), ("fsdp",))
    states, spec, ring = _states(mesh), PartitionSpec("fsdp"), [(i, (i + 1) % n) for i in range(n)]
    send = jax.jit(
        jax.shard_map(lambda x: jax.lax.ppermute(x, "fsdp", ring), mesh=mesh, in_specs=spec, out_specs=spec)
    )
    writer, wrong = SnapshotWriter(folder, keep=2, every=5), []
    for step in range(1, 31):
        writer.poll(step - 1)
        for k in range(10):
            mine = np.full((1, 2**18 if k % 2 else 256), me * 1000 + k, np.float32)
            x = jax.make_array_from_single_device_arrays(
                (n, mine.shape[1]), NamedSharding(mesh, spec), [jax.device_put(mine, jax.local_devices()[0])]
            )
            if not (np.asarray(send(x).addressable_shards[0].data) == (me - 1) % n * 1000 + k).all():
                wrong.append(step)
        if step % 5 == 0:
            writer.write(step, states)
    writer.wait()
    kept = sorted(int(p.name.split("-")[1]) for p in writer.folder.glob("step-*"))
    writer.close(remove=False)
    return {"wrong": wrong, "kept": kept}


def restore_onto_more(folder: str) -> dict:
    """Process 0 held the snapshot of a 1-process run; process 1 is new: both restore it onto 2 x 2
    devices."""
    from pathlib import Path

    import jax
    from jax.experimental import multihost_utils

    import nnx_shard as ns
    from nnx_shard._snapshots import restore_from_snapshots

    watched("the restore worker")
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
