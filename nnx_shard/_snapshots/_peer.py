"""A snapshot's copy to one peer process: the peers (a ring over failure domains), the copy sent in parts
through JAX ``ppermute``s over a mesh of one device per process, and what came back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import cached
from nnx_shard._cluster import process_mesh, recorded

ROW_STEP = 2**20  # a row's width is rounded up to this
# A row travels in parts of at most this many bytes, one ``ppermute`` each (faster than one whole row on CPUs:
# benchmarks/RESULTS.md).
PART_BYTES = 2**23
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
    after the other, padded to ``width``; None when they do not fit (the peer then gets no copy). Made and
    :func:`place`-d while the steps run, so that the step that sends it only runs the ``ppermute``s."""
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


def place(row: np.ndarray) -> list[Any]:
    """The row in parts of at most ``PART_BYTES``, each placed on this process's device of the process mesh
    and waited for, off the step's path: the step that sends them finds them ready on every process, and a
    CPU then runs each ``ppermute`` inline, in order. With one process, the parts as they are (its own
    peer)."""
    parts = [row[:, a : a + PART_BYTES] for a in range(0, row.shape[1], PART_BYTES)]
    if jax.process_count() == 1:
        return parts
    device = list(process_mesh().devices.flat)[jax.process_index()]
    return jax.block_until_ready([jax.device_put(part, device) for part in parts])


def exchange(parts: Sequence[Any], dest: Sequence[int], step: int) -> list[Any]:
    """Sends a :func:`place`-d row to process ``dest[me]``, one JAX ``ppermute`` a part (collectives, called
    by every process in the same order, with rows of the width they agreed); :func:`received` gives what
    came here."""
    n = jax.process_count()
    if n == 1:
        return list(parts)  # its own peer: written twice, never changed
    mesh = process_mesh()
    sharding, send = NamedSharding(mesh, PartitionSpec("p")), _ppermute(mesh, tuple(int(d) for d in dest))
    sent = []
    for part in parts:
        whole = jax.make_array_from_single_device_arrays((n, part.shape[1]), sharding, [part])
        with recorded("snapshot.exchange", step, whole.shape):
            sent.append(send(whole))
    return sent


@cached(maxsize=None)
def _ppermute(mesh: Mesh, to: tuple[int, ...]) -> Callable[[jax.Array], jax.Array]:
    """The jitted ``ppermute`` from each process ``i`` to ``to[i]`` over the process mesh, made once (built
    afresh, it would be traced and compiled at each snapshot). The part sent is donated: what comes back
    takes its buffer, not new pages."""
    spec = PartitionSpec("p")

    def send(x: jax.Array) -> jax.Array:
        return jax.lax.ppermute(x, "p", list(enumerate(to)))

    return jax.jit(jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec), donate_argnums=0)


def received(sent: Sequence[Any]) -> np.ndarray:
    """The bytes an :func:`exchange` brought here (waits for them; dispatches nothing); empty when the peer
    sent none."""
    parts = [p if isinstance(p, np.ndarray) else np.asarray(p.addressable_shards[0].data) for p in sent]
    size = int.from_bytes(bytes(parts[0][0, :PREFIX]), "little")
    row = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return row[0, PREFIX : PREFIX + size]
