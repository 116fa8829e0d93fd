"""Coordination between processes, owned here: the key-value store of JAX's coordination service with every
key space nnx_shard writes, and the small collectives over one device per process (JSON values gathered,
bytes sent to each process).

Everything that talks to another process goes through this module: barriers (``_multihost``), the Trainer's
watchdog and standby relay, the snapshots' exchanges and the fingerprints' sums.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import distributed_client
from nnx_shard._cluster._collectives import agree, recorded

PREFIX = 8  # bytes before each row of all_to_all: its length


class Keys:
    """The key spaces nnx_shard writes in the coordination service, each ``prefix + ...``."""

    WAITING = "nnx_shard_waiting/"  # + process: the barrier it waits at ("" after, "gave up:<id>")
    ARRIVED = "nnx_shard_arrived/"  # + barrier id / process: it arrived
    WATCHDOG = "nnx_shard/watchdog/"  # + process: the section it entered last
    STANDBY = "nnx_shard/standby/"  # + resize generation / n: the leader's n-th message to standby processes
    FLIGHT = "nnx_shard/flight/"  # + process: its last collectives, written when its watchdog fires
    FLIGHT_DONE = "nnx_shard/flight_done/"  # + process: it wrote its timeout's message


class KeyValueStore:
    """JAX's coordination service's key-value store, with string keys and values.

    Raises :class:`~nnx_shard.errors.DistributedNotInitializedError` when made without
    ``jax.distributed.initialize``; the service's own errors (``jax.errors.JaxRuntimeError``, whose
    ``error_code`` says a deadline passed) come through as they are, for the caller to name.
    """

    def __init__(self) -> None:
        self._client = distributed_client()

    def set(self, key: str, value: str, *, overwrite: bool = True) -> None:
        if overwrite:
            self._client.key_value_set(key, value, allow_overwrite=True)
        else:
            self._client.key_value_set(key, value)

    def get(self, key: str, timeout_ms: int) -> str:
        """The value of ``key``, waiting up to ``timeout_ms`` for a process to set it."""
        return self._client.blocking_key_value_get(key, timeout_ms)

    def directory(self, prefix: str) -> dict[str, str]:
        """Every key under ``prefix`` with its value."""
        return dict(self._client.key_value_dir_get(prefix))

    def barrier(self, barrier_id: str, timeout_ms: int) -> None:
        """Waits until every process reached ``barrier_id``, or ``timeout_ms`` passed."""
        self._client.wait_at_barrier(barrier_id, timeout_ms)


def gather_json(value: Any, *, site: str = "gather_json", step: int = -1) -> list[Any]:
    """Every process's ``value`` (anything JSON holds), in process order: a collective of every process,
    its lengths agreed through :func:`agree` (``site`` and ``step`` name it there and in the flight record).

    >>> gather_json({"step": 3})  # one process
    [{'step': 3}]
    """
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    if jax.process_count() == 1:
        with recorded(site, step, data.shape):
            return [json.loads(data.tobytes())]
    sizes = agree(site, [data.size], step=step)[:, 0]
    raw = np.zeros((int(sizes.max()),), np.uint8)
    raw[: data.size] = data
    with recorded(f"{site}:bytes", step, raw.shape):
        rows = np.asarray(multihost_utils.process_allgather(raw)).reshape(len(sizes), -1)
    return [json.loads(r[:size].tobytes()) for r, size in zip(rows, sizes, strict=True)]


def process_mesh() -> Mesh:
    """A 1-D mesh ``("p",)`` of one device per process (its lowest id): for collectives between processes."""
    n = jax.process_count()
    first = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(n)]
    return Mesh(np.array(first), ("p",))


def all_to_all(chunks: list[bytes], *, site: str = "all_to_all", step: int = -1) -> list[np.ndarray]:
    """Sends ``chunks[q]`` to process ``q`` and returns what each process sent here, by one JAX all_to_all
    (a collective of every process).

    >>> [bytes(b) for b in all_to_all([b"to myself"])]  # one process
    [b'to myself']
    """
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return [np.frombuffer(chunks[0], np.uint8)]
    width = int(agree(site, [max(len(c) for c in chunks) + PREFIX], step=step).max())
    rows = np.zeros((n, width), np.uint8)
    for q, chunk in enumerate(chunks):  # each row: its length, then its bytes
        rows[q, :PREFIX] = np.frombuffer(len(chunk).to_bytes(PREFIX, "little"), np.uint8)
        rows[q, PREFIX : PREFIX + len(chunk)] = np.frombuffer(chunk, np.uint8)
    mesh, spec = process_mesh(), PartitionSpec("p")
    local = jax.device_put(rows, list(mesh.devices.flat)[me])
    whole = jax.make_array_from_single_device_arrays((n * n, width), NamedSharding(mesh, spec), [local])
    program = jax.shard_map(
        lambda x: jax.lax.all_to_all(x, "p", 0, 0, tiled=True), mesh=mesh, in_specs=spec, out_specs=spec
    )
    with recorded(f"{site}:bytes", step, (n, width)):
        got = np.asarray(jax.jit(program)(whole).addressable_shards[0].data)
    lengths = [int.from_bytes(bytes(r[:PREFIX]), "little") for r in got]
    return [got[s, PREFIX : PREFIX + lengths[s]] for s in range(n)]
