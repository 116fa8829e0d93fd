"""A snapshot's copy to one peer process: the peers (a ring over failure domains), the copy sent through a
JAX ``ppermute`` over a mesh of one device per process, and what came back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import cached
from nnx_shard._cluster import process_mesh, recorded

ROW_STEP = 2**20  # a row's width is rounded up to this
PREFIX = 8  # bytes before the copy in a row: its length


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


def row_width(nbytes: int) -> int:
    """The width of the row that carries a copy of up to ``nbytes``: its length first, then the bytes, rounded
    up to ``ROW_STEP`` (so that the ``ppermute`` compiles once for snapshots of about one size)."""
    return -(-(PREFIX + nbytes) // ROW_STEP) * ROW_STEP


def outgoing(parts: Sequence[np.ndarray], width: int) -> np.ndarray | None:
    """The row :func:`exchange` sends: the length of ``parts`` (a snapshot file's bytes), then the parts one
    after the other, padded to ``width``; None when they do not fit (the peer then gets no copy). Made while
    the steps run, so that the step that sends it only places it and queues the ``ppermute``."""
    size = sum(int(p.size) for p in parts)
    if PREFIX + size > width:
        return None
    row = np.empty((1, width), np.uint8)
    row[0, :PREFIX] = np.frombuffer(size.to_bytes(PREFIX, "little"), np.uint8)
    at = PREFIX
    for p in parts:
        row[0, at : at + p.size] = p
        at += p.size
    row[0, at:] = 0
    return row


def empty(width: int) -> np.ndarray:
    """The row of a process with no copy to send (its snapshot failed): length 0."""
    return np.zeros((1, width), np.uint8)


def exchange(row: np.ndarray, dest: Sequence[int], step: int) -> Any:
    """Starts sending an :func:`outgoing` row to process ``dest[me]`` through a JAX ``ppermute`` (a
    collective, called by every process in the same order, with rows of the width they agreed);
    :func:`received` gives what came here."""
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return row  # its own peer: written twice, never changed
    mesh = process_mesh()
    # placed and waited for before the ppermute on every process, so that it runs the same way on each (a
    # CPU runs a collective whose input is ready inline, one whose input is still coming later, when
    # another collective may already have been queued)
    local = jax.device_put(row, list(mesh.devices.flat)[me]).block_until_ready()
    sharding = NamedSharding(mesh, PartitionSpec("p"))
    whole = jax.make_array_from_single_device_arrays((n, row.shape[1]), sharding, [local])
    with recorded("snapshot.exchange", step, row.shape):
        return _ppermute(mesh, tuple(int(d) for d in dest))(whole)


@cached(maxsize=None)
def _ppermute(mesh: Mesh, to: tuple[int, ...]) -> Callable[[jax.Array], jax.Array]:
    """The jitted ``ppermute`` from each process ``i`` to ``to[i]`` over the process mesh, made once (built
    afresh, it would be traced and compiled at each snapshot)."""
    spec = PartitionSpec("p")

    def send(x: jax.Array) -> jax.Array:
        return jax.lax.ppermute(x, "p", list(enumerate(to)))

    return jax.jit(jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec))


def received(sent: Any) -> np.ndarray:
    """The bytes an :func:`exchange` brought here (waits for them; dispatches nothing); empty when the peer
    sent none."""
    row = sent if isinstance(sent, np.ndarray) else np.asarray(sent.addressable_shards[0].data)
    size = int.from_bytes(bytes(row[0, :PREFIX]), "little")
    return row[0, PREFIX : PREFIX + size]
