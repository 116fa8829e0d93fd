"""A snapshot's copy to one peer process: the peers (a ring over failure domains), the copy sent in parts
through JAX ``ppermute``s over a mesh of one device per process in reverse process order (XLA keys a
communicator by its devices in order, and a step's meshes run in process order: the copy, which may go
while a step runs, has a communicator of its own), and what came back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import cached
from nnx_shard._cluster import process_mesh, recorded

ROW_STEP = 2**20  # a row's width is rounded up to this
PART_BYTES = 2**23  # a row travels in parts of at most this, one ``ppermute`` each (faster on CPUs: RESULTS)
PREFIX = 8  # bytes before the copy in a row: its length


def peers(domains: Sequence[str]) -> list[int]:
    """Where each process sends its copy: a ring over the processes grouped by failure domain, shifted by
    the largest domain's size, so that a copy leaves its domain.

    >>> peers(["a", "a", "b", "b"]), peers(["h"] * 3)
    ([2, 3, 0, 1], [1, 2, 0])
    """
    n = len(domains)
    order = sorted(range(n), key=lambda i: (domains[i], i))
    largest = max(domains.count(x) for x in set(domains))
    shift = largest if largest < n else 1
    return [dest for _, dest in sorted((i, order[(k + shift) % n]) for k, i in enumerate(order))]


def row_width(nbytes: int) -> int:
    """The width of the row that carries a copy of up to ``nbytes``, rounded up to ``ROW_STEP`` (so that
    the ``ppermute`` compiles once for snapshots of about one size)."""
    return -(-(PREFIX + nbytes) // ROW_STEP) * ROW_STEP


def outgoing(parts: Sequence[np.ndarray], width: int) -> np.ndarray:
    """The row :func:`exchange` sends: the length of ``parts`` (a snapshot file's bytes; none from a process
    whose snapshot failed), then the parts, zeros to ``width``; ValueError when they do not fit."""
    size = sum(int(p.size) for p in parts)
    if PREFIX + size > width:
        raise ValueError(f"the copy for the peer ({size} bytes) is wider than the {width} bytes agreed")
    row = np.zeros((1, width), np.uint8)
    row[0, :PREFIX] = np.frombuffer(size.to_bytes(PREFIX, "little"), np.uint8)
    at = PREFIX
    for p in parts:
        row[0, at : at + p.size] = p
        at += p.size
    return row


def place(row: np.ndarray) -> list[Any]:
    """The row in parts of at most ``PART_BYTES``, placed on this process's device and waited for, off the
    step's path: each ``ppermute``'s input is ready on every process (a CPU runs it inline, in order)."""
    parts = [row[:, a : a + PART_BYTES] for a in range(0, row.shape[1], PART_BYTES)]
    if jax.process_count() == 1:
        return parts
    return jax.block_until_ready(jax.device_put(parts, process_mesh().devices.flat[jax.process_index()]))


def exchange(parts: Sequence[Any], dest: Sequence[int], step: int) -> list[Any]:
    """Sends a :func:`place`-d row to process ``dest[me]``, one ``ppermute`` a part (collectives every process
    calls in the same order, with rows of the agreed width); :func:`received` gives what came here."""
    if (n := jax.process_count()) == 1:
        return list(parts)  # its own peer
    (send, sharding), sent = _ppermute(tuple(int(d) for d in dest)), []
    for part in parts:
        whole = jax.make_array_from_single_device_arrays((n, part.shape[1]), sharding, [part])
        with recorded("snapshot.exchange", step, whole.shape, stream="snapshot"):
            sent.append(send(whole).addressable_shards[0].data)  # what came here
    return sent


@cached(maxsize=None)
def _ppermute(dest: tuple[int, ...]) -> tuple[Callable[[jax.Array], jax.Array], NamedSharding]:
    """The jitted ``ppermute`` of process ``p``'s row to ``dest[p]`` (its input donated: no new pages) and
    the rows' sharding, over one device per process in reverse process order (a communicator of its own)."""
    n, mesh, spec = len(dest), Mesh(process_mesh().devices[::-1], ("p",)), PartitionSpec("p")

    def send(x: jax.Array) -> jax.Array:  # process p is at place n - 1 - p
        return jax.lax.ppermute(x, "p", [(n - 1 - p, n - 1 - d) for p, d in enumerate(dest)])

    program = jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(program, donate_argnums=0), NamedSharding(mesh, spec)


def received(sent: Sequence[Any]) -> np.ndarray:
    """The bytes an :func:`exchange` brought here (waits for them); empty when the peer sent none."""
    row = np.concatenate(sent, axis=1)
    return row[0, PREFIX : PREFIX + int.from_bytes(bytes(row[0, :PREFIX]), "little")]
