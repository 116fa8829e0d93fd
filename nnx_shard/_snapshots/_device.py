"""The device copy, on GPUs and TPUs: each device copies its own shards within its own memory and sums each
shard's fingerprint share, in one program per device (the path the H100 run measured: benchmarks/RESULTS.md).

The step after a snapshot donates the live buffers. A copy in the device's memory is one pass at its
bandwidth, queued like a step, and never donated; the background then reads the copies to the host
(:meth:`Staged.write_into`). Where a device's allocator says it lacks room for them, or keeps no statistics,
:meth:`Staging.stage` returns None and the snapshot copies from the live buffers on the step, as on CPUs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._base import CompiledAhead, cached
from nnx_shard._checkpoint import block_base, block_share, word_shape
from nnx_shard._snapshots._file import HEADER, Piece, Shard

logger = logging.getLogger("nnx_shard")
HEADROOM = 0.8  # the copies may take this share of a device's free memory, at most
CHUNK_BYTES = 2**25  # a shard is copied in chunks of whole rows of at most this many bytes (or one row)
# Each device's program for a layout, compiled ahead and kept for the process (as a jit's are).
_COMPILED = CompiledAhead("snapshot")


@cached(maxsize=16)
def _program(key: tuple[tuple[tuple[int, ...], int, tuple[range, ...]], ...]) -> Any:
    """``(shards) -> (chunks, shares)`` for one device's shards, each given as (global shape, base, row
    ranges): each shard's copy in chunks of whole rows, and its share summed over the chunks. XLA then makes
    each chunk and its sum in one fusion: one read of the shard (compiled for a TPU, a whole copy and its
    sum read it twice)."""

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


def _groups(shards: Sequence[Shard]) -> dict[Any, list[int]]:
    """The shards' positions, by device."""
    out: dict[Any, list[int]] = {}
    for k, s in enumerate(shards):
        out.setdefault(next(iter(s.data.devices())), []).append(k)
    return out


def _key(shards: Sequence[Shard]) -> tuple[tuple[tuple[int, ...], int, tuple[range, ...]], ...]:
    return tuple(
        (
            tuple(s.shape),
            block_base([a for a, _ in s.index], s.shape, s.data.dtype),
            _rows(s.data.shape, s.data.dtype.itemsize),
        )
        for s in shards
    )


def has_room(shards: Sequence[Shard], groups: dict[Any, list[int]] | None = None) -> bool:
    """Whether every device's allocator has room for copies of its shards (False where it keeps no
    statistics: the CPU); ``groups``, the shards' positions by device, when known."""
    for device, members in (groups if groups is not None else _groups(shards)).items():
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            return False
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if sum(int(shards[k].data.nbytes) for k in members) > HEADROOM * free:
            return False
    return True


def _work(shards: Sequence[Shard]) -> list[tuple[Any, list[int], Any]]:
    """``(device, shard positions, program key)`` of each device holding some of ``shards``."""
    return [
        (device, members, _key([shards[k] for k in members])) for device, members in _groups(shards).items()
    ]


def stage_programs(shards: Sequence[Shard]) -> dict[Any, tuple[Any, tuple[Any, ...]]]:
    """``{(device, key): (jitted program, abstract arguments)}``: what each device runs to stage ``shards``,
    ready to compile (the arguments hold no buffer of the live state)."""
    args = [jax.ShapeDtypeStruct(s.data.shape, s.data.dtype, sharding=s.data.sharding) for s in shards]
    return {(d, key): (_program(key), ([args[k] for k in members],)) for d, members, key in _work(shards)}


def to_host(chunk: jax.Array) -> np.ndarray:
    """A chunk's bytes on the host (waits for the transfer)."""
    return np.asarray(chunk).reshape(-1).view(np.uint8)


@dataclasses.dataclass
class Staged:
    """A snapshot's copies (each shard's chunks), in the shards' order, and each device's shares with the
    shards they are of."""

    chunks: list[Any]
    shares: list[tuple[jax.Array, list[int]]]

    def write_into(self, buf: np.ndarray, pieces: Sequence[Piece]) -> None:
        """Reads each shard's chunks into its piece of ``buf`` (in the background), freeing them."""
        chunks, self.chunks = self.chunks, []
        for k, p in enumerate(pieces):
            at = HEADER + p.offset
            for chunk in chunks[k]:
                raw = to_host(chunk)
                buf[at : at + raw.size] = raw
                at += raw.size
            chunks[k] = None

    def share_values(self) -> list[int]:
        """Each shard's fingerprint share (waits for the devices)."""
        out: dict[int, int] = {}
        for values, members in self.shares:
            out.update(zip(members, (int(v) for v in np.asarray(values)), strict=True))
        return [out[k] for k in range(len(out))]


class Staging:
    """Stages snapshots (:meth:`stage`); :meth:`prepare` compiles the programs ahead, in the background."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._told = False  # that a device lacked the room (once)
        self._last: tuple[Any, list[Any], list[Any]] = (None, [], [])  # layout, its work, its programs

    def prepare(self, shards: Sequence[Shard]) -> None:
        """Compiles each device's program for ``shards``' layout in a thread (:class:`CompiledAhead`)."""
        self._thread = _COMPILED.start(stage_programs(shards))

    def stage(self, shards: Sequence[Shard], layout: Any = None) -> Staged | None:
        """Queues each device's copies and shares; None where a device lacks room for them. ``layout``, the
        key of ``shards``' layout (``Layouts``), lets a snapshot laid out as the last reuse its programs."""
        if not shards:
            return None
        if layout is None or self._last[0] != layout:
            self._last = (layout, _work(shards), [])
        _, work, programs = self._last
        if not has_room(shards, {device: members for device, members, _ in work}):
            if not self._told:
                self._told = True
                logger.info("snapshots copy from the live buffers: a device lacks room for their copies")
            return None
        if self._thread is not None:  # the programs compiled ahead (long done by the first snapshot)
            self._thread.join()
            self._thread = None
        if not programs:
            programs += [_COMPILED.get((device, key)) or _program(key) for device, _, key in work]
        chunks: list[Any] = [None] * len(shards)
        shares = []
        for program, (_, members, _) in zip(programs, work, strict=True):
            out, values = program([shards[k].data for k in members])
            for k, pieces in zip(members, out, strict=True):
                chunks[k] = pieces
            shares.append((values, members))
        return Staged(chunks, shares)
