"""The device copy, on GPUs and TPUs: each device copies its own shards within its own memory and sums each
piece's fingerprint share, in one program per device (the path the H100 run measured; see RESULTS.md).

The step after a snapshot donates the live buffers. A copy in the device's
memory is one pass at its bandwidth, queued like a step, and is never donated:
its transfer to the host's pinned memory then runs beside the steps, in chunks
(:meth:`Staged.write_into`), and the shares (:func:`block_share`) are ready
with it.

Staging needs room for the copies: where a device's allocator says it lacks it
(``memory_stats()``), or keeps no statistics, :meth:`Staging.stage` returns None
and the snapshot copies from the live buffers on the step, as on CPUs.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from nnx_shard._base import CompiledAhead, cached
from nnx_shard._checkpoint import block_base, block_share, word_shape, word_strides
from nnx_shard._snapshots._file import HEADER, Piece, Shard

logger = logging.getLogger("nnx_shard")
# The copies may take this share of a device's free memory, at most.
HEADROOM = 0.8
# A shard leaves its device in chunks of whole rows of at most this many bytes (or one row), two at a time.
CHUNK_BYTES = 2**25
# Each device's program for a layout, compiled ahead: kept for the process, as a jit's are, so that each
# ``train()`` call's writer finds them.
_COMPILED = CompiledAhead("snapshot")


@cached(maxsize=16)
def _program(blocks: tuple[tuple[tuple[int, ...], int, tuple[range, ...]], ...]) -> Any:
    """``(shards) -> (chunks, shares)`` for one device's shards, each given as (global shape, base, row
    ranges): each shard's copy in chunks of whole rows (contiguous bytes of it), and each shard's share.

    A share is summed over the chunks, not over the shard: XLA then makes each chunk and its sum in one
    fusion, and the shard is read once (compiled for a TPU, a separate sum read every shard a second time).
    """

    def stage(shards: list[jax.Array]) -> tuple[list[list[jax.Array]], jax.Array]:
        # new buffers (XLA copies a parameter it returns, and a slice)
        chunks = [
            [jnp.copy(x) if len(rows) == 1 else x[r.start : r.stop] for r in rows]
            for x, (_, _, rows) in zip(shards, blocks, strict=True)
        ]
        shares = []
        for x, pieces, (shape, base, rows) in zip(shards, chunks, blocks, strict=True):
            row_words = word_strides(word_shape(shape, x.dtype))[0] if shape else 0
            starts = [(base + r.start * row_words) % 2**32 for r in rows]
            shares.append(
                sum(block_share(c, jnp.uint32(a), shape) for c, a in zip(pieces, starts, strict=True))
            )
        return chunks, jnp.stack(shares)

    return jax.jit(stage)


def _rows(shape: tuple[int, ...], itemsize: int) -> tuple[range, ...]:
    """Row ranges of a shard of ``shape``, each at most ``CHUNK_BYTES`` (or one row).

    >>> _rows((10, 2**22), 4)  # 16 MiB rows: two to a chunk
    (range(0, 2), range(2, 4), range(4, 6), range(6, 8), range(8, 10))
    """
    if len(shape) == 0:
        return (range(0, 1),)
    per = max(1, CHUNK_BYTES // max(1, _row_bytes(shape, itemsize)))
    return tuple(range(a, min(a + per, shape[0])) for a in range(0, max(shape[0], 1), per))


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one row (along the first dimension) of a C-order array of ``shape``; 0 for a scalar."""
    return math.prod(shape[1:]) * itemsize if shape else 0


def _device(data: jax.Array) -> Any:
    return next(iter(data.devices()))


def _groups(shards: Sequence[Shard]) -> dict[Any, list[int]]:
    """The shards' positions, by device."""
    out: dict[Any, list[int]] = {}
    for k, s in enumerate(shards):
        out.setdefault(_device(s.data), []).append(k)
    return out


def _key(shards: Sequence[Shard], members: Sequence[int]) -> tuple[Any, ...]:
    out = []
    for k in members:
        s = shards[k]
        base = block_base([a for a, _ in s.index], s.shape, s.data.dtype)
        out.append((tuple(s.shape), base, _rows(tuple(s.data.shape), s.data.dtype.itemsize)))
    return tuple(out)


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


def stage_programs(shards: Sequence[Shard]) -> dict[Any, tuple[Any, tuple[Any, ...]]]:
    """``{(device, layout): (jitted program, abstract arguments)}``: what each device runs to stage
    ``shards``, ready to compile (the arguments hold no buffer of the live state)."""
    return _programs(shards, _plan(shards))


def _programs(shards: Sequence[Shard], plan: _Plan) -> dict[Any, tuple[Any, tuple[Any, ...]]]:
    def abstract(data: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=data.sharding)

    work = {}
    for device, members, key, _ in plan.work:
        work[(device, key)] = (_program(key), ([abstract(shards[k].data) for k in members],))
    return work


@dataclasses.dataclass
class Staged:
    """A snapshot's copies: each shard's chunks (with their byte offsets in it), in the shards' order, and
    each device's shares with the positions of the shards they are of."""

    chunks: list[list[tuple[int, jax.Array]]]
    shares: list[tuple[jax.Array, list[int]]]

    def write_into(self, buf: np.ndarray, pieces: Sequence[Piece]) -> None:
        """Moves the chunks to the host into their places in ``buf``, two in flight at a time (in the
        background). A step's own small reads from its devices (its counters, its metrics) queue behind
        the transfers in flight: two chunks, not the whole snapshot."""
        queue = collections.deque(
            (pieces[k].offset + at, chunk) for k, chunks in enumerate(self.chunks) for at, chunk in chunks
        )
        self.chunks = []  # a device chunk is freed once its bytes have left
        flight: collections.deque[tuple[int, Any]] = collections.deque()
        while queue:
            offset, chunk = queue.popleft()
            flight.append((offset, host_memory(chunk)))
            del chunk
            if len(flight) == 2:
                _land(buf, *flight.popleft())
        while flight:
            _land(buf, *flight.popleft())

    def share_values(self) -> list[int]:
        """Each shard's fingerprint share (waits for the devices)."""
        out: dict[int, int] = {}
        for values, members in self.shares:
            for k, value in zip(members, np.asarray(values), strict=True):
                out[k] = int(value)
        return [out[k] for k in range(len(out))]


def _land(buf: np.ndarray, offset: int, host: Any) -> None:
    """Copies a chunk on its way to the host (waits for it) to ``offset`` in the file's shards."""
    raw = np.asarray(host).reshape(-1).view(np.uint8)
    buf[HEADER + offset : HEADER + offset + raw.size] = raw


def host_memory(data: jax.Array) -> Any:
    """An asynchronous copy of a single-device array into its device's ``pinned_host`` memory (the array
    itself where the device has no host memory kinds)."""
    pinned = _pinned(_device(data))
    return data if pinned is None else jax.device_put(data, pinned)


@cached(maxsize=None)
def _pinned(device: Any) -> SingleDeviceSharding | None:
    """``device``'s ``pinned_host`` memory as a sharding (None where it has none), looked up once."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        kinds = set()
    return SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None


@dataclasses.dataclass
class _Plan:
    """What staging a layout takes: each device's shards, its program's key and each shard's chunk offsets;
    the programs once looked up."""

    groups: dict[Any, list[int]]
    work: list[tuple[Any, list[int], Any, list[list[int]]]]  # device, members, program key, offsets
    programs: list[Any] | None = None


def _plan(shards: Sequence[Shard]) -> _Plan:
    work = []
    groups = _groups(shards)
    for device, members in groups.items():
        key = _key(shards, members)
        offsets = [
            [r.start * _row_bytes(tuple(shards[k].data.shape), shards[k].data.dtype.itemsize) for r in rows]
            for k, (_, _, rows) in zip(members, key, strict=True)
        ]
        work.append((device, members, key, offsets))
    return _Plan(groups, work)


class Staging:
    """Stages snapshots (:meth:`stage`); :meth:`prepare` compiles the programs ahead, in the background."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._told = False  # that a device lacked the room (once)
        self._last: tuple[Any, _Plan] | None = None  # the last layout's key and plan

    def prepare(self, shards: Sequence[Shard], layout: Any = None) -> None:
        """Compiles each device's program for ``shards``' layout in a thread (:class:`CompiledAhead`); the
        plan is kept for the first snapshot of that ``layout`` (:meth:`stage`)."""
        self._last = (layout, _plan(shards))
        self._thread = _COMPILED.start(_programs(shards, self._last[1]))

    def stage(self, shards: Sequence[Shard], layout: Any = None) -> Staged | None:
        """Queues each device's copies and shares; None where a device lacks room for them. ``layout``, the
        key of ``shards``' layout (:class:`Layouts`), lets a snapshot laid out as the last reuse its plan."""
        if not shards:
            return None
        if layout is None or self._last is None or self._last[0] != layout:
            self._last = (layout, _plan(shards))
        plan = self._last[1]
        if not has_room(shards, plan.groups):
            if not self._told:
                self._told = True
                logger.info("snapshots copy from the live buffers: a device lacks room for their copies")
            return None
        if self._thread is not None:  # the programs compiled ahead (long done by the first snapshot)
            self._thread.join()
            self._thread = None
        if plan.programs is None:
            plan.programs = [_COMPILED.get((d, key)) or _program(key) for d, _, key, _ in plan.work]
        chunks: list[Any] = [None] * len(shards)
        shares = []
        for program, (_, members, _, offsets) in zip(plan.programs, plan.work, strict=True):
            out, values = program([shards[k].data for k in members])
            for k, pieces, at in zip(members, out, offsets, strict=True):
                chunks[k] = list(zip(at, pieces, strict=True))
            shares.append((values, members))
        return Staged(chunks, shares)
