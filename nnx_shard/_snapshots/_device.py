"""The device copy on GPUs and TPUs (the path the H100 run measured): each device copies its shards and sums
their shares in one program, queued before the next step donates them; the copies go to the host later."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._base import cached
from nnx_shard._checkpoint import block_base, block_share, word_shape
from nnx_shard._snapshots._file import HEADER, Piece, Shard

logger = logging.getLogger("nnx_shard")
HEADROOM = 0.8  # the copies may take this share of a device's free memory, at most
CHUNK_BYTES = 2**25  # a shard is copied in chunks of whole rows of at most this many bytes (or one row)


@cached(maxsize=16)
def _program(key: tuple[tuple[tuple[int, ...], int, tuple[range, ...]], ...]) -> Any:
    """``(shards) -> (chunks, shares)`` for one device's shards keyed (global shape, base, row ranges): each
    copied in chunks of rows, its share summed over them in one read (a TPU's whole copy and sum: two)."""

    def stage(shards: list[jax.Array]) -> tuple[list[list[jax.Array]], jax.Array]:
        chunks, shares = [], []
        for x, (shape, base, rows) in zip(shards, key, strict=True):
            chunks.append([jnp.copy(x)] if len(rows) == 1 else [x[r.start : r.stop] for r in rows])
            row = math.prod(word_shape(shape, x.dtype)[1:]) if shape else 0
            starts = [jnp.uint32((base + r.start * row) % 2**32) for r in rows]
            shares.append(sum(block_share(c, a, shape) for c, a in zip(chunks[-1], starts, strict=True)))
        return chunks, jnp.stack(shares)

    return jax.jit(stage)


def _rows(shape: tuple[int, ...], itemsize: int) -> tuple[range, ...]:
    """Row ranges of a shard of ``shape``, each at most ``CHUNK_BYTES`` (or one row).

    >>> _rows((10, 2**22), 4)  # 16 MiB rows: two to a chunk
    (range(0, 2), range(2, 4), range(4, 6), range(6, 8), range(8, 10))
    """
    if not shape:
        return (range(0, 1),)
    per = max(1, CHUNK_BYTES // max(1, math.prod(shape[1:]) * itemsize))
    return tuple(range(a, min(a + per, shape[0])) for a in range(0, max(shape[0], 1), per))


def _work(shards: Sequence[Shard]) -> list[tuple[Any, list[int], Any]]:
    """``(device, shard positions, program key)`` of each device holding some of ``shards``."""
    groups: dict[Any, list[int]] = {}
    keys = []
    for k, s in enumerate(shards):
        groups.setdefault(next(iter(s.data.devices())), []).append(k)
        base = block_base([a for a, _ in s.index], s.shape, s.data.dtype)
        keys.append((tuple(s.shape), base, _rows(s.data.shape, s.data.dtype.itemsize)))
    return [(device, members, tuple(keys[k] for k in members)) for device, members in groups.items()]


def has_room(shards: Sequence[Shard], work: Sequence[tuple[Any, list[int], Any]] | None = None) -> bool:
    """Whether every device's allocator has room for copies of its shards (never on CPUs: no statistics)."""
    for device, members, _ in work if work is not None else _work(shards):
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            return False
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if sum(int(shards[k].data.nbytes) for k in members) > HEADROOM * free:
            return False
    return True


def to_host(chunk: jax.Array) -> np.ndarray:
    """A chunk's bytes on the host (waits for the transfer)."""
    return np.asarray(chunk).reshape(-1).view(np.uint8)


@dataclasses.dataclass
class Staged:
    """A snapshot's copies (each shard's chunks) and each device's shares with the shards they are of."""

    chunks: list[Any]
    shares: list[tuple[jax.Array, list[int]]]

    def write_into(self, buf: np.ndarray, pieces: Sequence[Piece]) -> None:
        """Reads each shard's chunks into its piece of ``buf``, freeing them, and sets the pieces' shares."""
        chunks, self.chunks = self.chunks, []
        for k, p in enumerate(pieces):
            at = HEADER + p.offset
            for chunk in chunks[k]:
                raw = to_host(chunk)
                buf[at : at + raw.size] = raw
                at += raw.size
            chunks[k] = None
        for values, members in self.shares:
            for k, v in zip(members, np.asarray(values), strict=True):
                pieces[k].share = int(v)


class Staging:
    """Stages snapshots, the work of the last layout kept."""

    def __init__(self) -> None:
        self._told = False  # that a device lacked the room (once)
        self._last: tuple[Any, list[Any]] = (None, [])  # a layout's key and its work

    def stage(self, shards: Sequence[Shard], layout: Any = None) -> Staged | None:
        """Queues each device's copies and shares; None on CPU devices or where a device lacks room.
        ``layout``, the key of ``shards``' layout, lets a snapshot laid out as the last reuse its work."""
        if layout is None or self._last[0] != layout:
            self._last = (layout, _work(shards))
        work = self._last[1]
        if not work or not has_room(shards, work):
            if not self._told and any(device.platform != "cpu" for device, _, _ in work):
                self._told = True
                logger.info("snapshots copy from the live buffers: a device lacks room for their copies")
            return None
        staged = Staged([None] * len(shards), [])
        for _, members, key in work:
            out, values = _program(key)([shards[k].data for k in members])
            for k, chunks in zip(members, out, strict=True):
                staged.chunks[k] = chunks
            staged.shares.append((values, members))
        return staged
