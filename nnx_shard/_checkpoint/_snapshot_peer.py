"""A snapshot's copy to one peer process: the peers (a ring over failure domains), the copy sent through a
JAX ``ppermute`` over a mesh of one device per process, and what came back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import cached
from nnx_shard._cluster import process_mesh

ROW_STEP = 2**20  # a copy's length is rounded up to this, so that its program compiles once


def peers(domains: Sequence[str]) -> list[int]:
    """Where each process sends its copy: a ring over the processes grouped by failure domain.

    The shift is the largest domain's size, so a copy leaves its domain when
    the domains are equal in size; with one domain it is plain ring order.

    >>> peers(["a", "a", "b", "b"]), peers(["h"] * 3)
    ([2, 3, 0, 1], [1, 2, 0])
    """
    n = len(domains)
    order = sorted(range(n), key=lambda i: (domains[i], i))
    largest = max(sum(1 for d in domains if d == x) for x in set(domains))
    shift = largest if largest < n else 1
    dest = [0] * n
    for k, i in enumerate(order):
        dest[i] = order[(k + shift) % n]
    return dest


def outgoing(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
    """The copy :func:`exchange` sends: ``parts`` (a snapshot file's bytes) one after the other in a row
    padded to a multiple of ``ROW_STEP``, and their length. Made while the steps run (a copy of the whole
    snapshot), so that the step that sends it only places it and queues the ``ppermute``."""
    size = sum(int(p.size) for p in parts)
    row = np.empty((1, -(-size // ROW_STEP) * ROW_STEP), np.uint8)
    at = 0
    for p in parts:
        row[0, at : at + p.size] = p
        at += p.size
    row[0, at:] = 0
    return row, size


def exchange(out: tuple[np.ndarray, int], dest: Sequence[int]) -> Any:
    """Starts sending an :func:`outgoing` copy to process ``dest[me]`` through a JAX ``ppermute`` (a
    collective, called by every process in the same order); :func:`received` gives what came here."""
    local, size = out
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return local[0, :size], size  # its own peer: written twice, never changed
    mine = np.array([size, local.shape[1]], np.int64)
    lengths, widths = np.asarray(multihost_utils.process_allgather(mine)).reshape(n, 2).T
    width = int(widths.max())  # the same shape on every process, and from one snapshot to the next
    mesh = process_mesh()
    if local.shape[1] != width:  # another process's copy is longer: this one is padded to its length
        local = outgoing([local[0, :size], np.zeros(width - size, np.uint8)])[0]
    # placed here, not with the row: a CPU runs a collective whose input is ready inline, so that the step
    # would wait for the transfer (60-85 ms for 32 MB); and a GPU keeps no copy of it for the steps between
    local = jax.device_put(local, list(mesh.devices.flat)[me])
    sharding = NamedSharding(mesh, PartitionSpec("p"))
    whole = jax.make_array_from_single_device_arrays((n, width), sharding, [local])
    to = tuple(int(d) for d in dest)
    moved = _ppermute(mesh, to)(whole)
    source = to.index(me)
    return moved, int(lengths[source])


@cached(maxsize=None)
def _ppermute(mesh: Mesh, to: tuple[int, ...]) -> Callable[[jax.Array], jax.Array]:
    """The jitted ``ppermute`` from each process ``i`` to ``to[i]`` over the process mesh, made once: built
    afresh at each snapshot, it was traced and compiled each time (60-90 ms of the step's path for 32 MB
    on a 2-core CPU)."""
    spec = PartitionSpec("p")

    def send(x: jax.Array) -> jax.Array:
        return jax.lax.ppermute(x, "p", list(enumerate(to)))

    return jax.jit(jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec))


def received(sent: Any) -> np.ndarray:
    """The bytes an :func:`exchange` brought here (waits for them; dispatches nothing)."""
    moved, length = sent
    if isinstance(moved, np.ndarray):
        return moved[:length]
    return np.asarray(moved.addressable_shards[0].data)[0, :length]
