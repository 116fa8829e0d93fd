"""Content fingerprints of arrays, computed where the arrays lie and independent of the sharding.

A fingerprint is a 32-bit sum over the array's 32-bit words, each weighted by an
odd function of its global position: the same however the array is sharded (a
checkpoint saved on 8 devices verifies on 4, or on 2 processes), changed by any
single changed word, and by several only by a 1 in 2**32 chance. The sum is written twice in
``_fingerprint_shares``: the device program and its NumPy reference. Where it runs (:func:`route`):
- GPUs, TPUs: each device over its shard in one fused pass, then one psum; every array's program queued
  before any is read, compiled ahead of a read (:func:`compile_ahead`);
- CPU devices across processes: the same in 64 KiB row blocks (XLA's CPU backend does not fuse the weighting);
- this process's CPU devices: NumPy over each block's buffer where it lies (8-byte words take the programs);
- small arrays this process holds: NumPy on the host, on any backend (no compile).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._base import CompiledAhead, cached, entry_axes, holding_processes, in_threads, is_key
from nnx_shard._checkpoint._fingerprint_shares import block_fingerprint, block_share, word_shape, word_strides
from nnx_shard._cluster import gather_json, recorded

# More than CHUNK arrays of one signature, each at most this size, are fingerprinted CHUNK per call.
SMALL_BYTES = 2**20
CHUNK = 64


@cached(maxsize=None)
def _program() -> Any:
    """Whole arrays' sums, each one block of itself, in one program."""
    return jax.jit(lambda arrays: jnp.stack([block_share(x, jnp.uint32(0), x.shape) for x in arrays]))


HOST_BYTES = 2**16  # arrays up to this size, whose values this process holds, are summed on the host


def _whole_words(x: jax.Array) -> bool:
    """Whether NumPy can sum ``x``'s words as :func:`as_words` makes them: bytes of 1, 2 or 4, no key."""
    return not is_key(x) and jax.dtypes.itemsize_bits(x.dtype) % 8 == 0 and jnp.dtype(x.dtype).itemsize <= 4


def _on_host(x: jax.Array) -> bool:
    """Whether ``x`` is small and readable here: summed by :func:`_host_sum`, not by a program."""
    if x.nbytes > HOST_BYTES or not _whole_words(x):
        return False
    if x.is_fully_addressable:
        return True
    return x.sharding.is_fully_replicated and bool(x.sharding.addressable_devices)


def _host_sum(value: np.ndarray) -> int:
    """The sum over an array already on the host: :func:`block_fingerprint` of its one block."""
    return block_fingerprint(value, [0] * value.ndim, value.shape)


def _host_fingerprints(arrays: Sequence[jax.Array]) -> list[str]:
    """:func:`fingerprints` of small arrays, read to the host together (a replicated one from one copy)."""
    local = [x if x.is_fully_addressable else x.addressable_data(0) for x in arrays]
    return [f"{_host_sum(np.asarray(value)):08x}" for value in jax.device_get(local)]


def _in_place(x: jax.Array) -> bool:
    """Whether ``x`` is summed where it lies by :func:`block_fingerprint`: on this process's CPUs, whole
    bytes of at most 4 (8-byte words take the programs)."""
    if x.ndim == 0 or not x.is_fully_addressable or not _whole_words(x):
        return False
    return _platform(x) == "cpu"


@cached(maxsize=256)
def _starts(shape: tuple[int, ...], sharding: Any) -> dict[Any, list[int]]:
    """Each block's first element, on one device per block (a shard's own index is not cached)."""
    starts, seen = {}, set()
    for device, index in sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id):
        first = tuple(i.start or 0 for i in index)
        if first not in seen:
            seen.add(first)
            starts[device] = list(first)
    return starts


def _in_place_fingerprints(arrays: Sequence[jax.Array]) -> list[str]:
    """:func:`fingerprints` of arrays on this process's CPUs: each block summed where it lies (a NumPy
    view of its buffer, nothing copied or compiled), in one thread per core (NumPy lets go of the GIL),
    each thread given blocks of about equal bytes."""
    blocks = []  # (array number, data, start, global shape), each block once
    for n, x in enumerate(arrays):
        starts = _starts(tuple(x.shape), x.sharding)
        for shard in x.addressable_shards:
            if shard.device in starts:
                blocks.append((n, np.asarray(shard.data), starts[shard.device], x.shape))
    if not blocks:
        return ["00000000"] * len(arrays)  # nothing to sum: empty arrays
    parts = in_threads(lambda k: block_fingerprint(*blocks[k][1:]), [b[1].nbytes for b in blocks])
    sums = [0] * len(arrays)
    for (n, *_), value in zip(blocks, parts, strict=True):
        sums[n] += value
    return [f"{value % 2**32:08x}" for value in sums]


# Words per block when a shard is fingerprinted block by block (64 KiB of uint32).
BLOCK_WORDS = 2**14


def _by_shard(x: jax.Array) -> bool:
    """Whether ``x`` can be fingerprinted shard by shard: a NamedSharding that divides its shape."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or x.ndim == 0 or is_key(x):
        return False
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
    for dim, entry in zip(x.shape, sharding.spec, strict=False):
        n = int(np.prod([sizes[a] for a in entry_axes(entry)], dtype=np.int64))
        if dim % n:
            return False
    return True


@cached(maxsize=256)
def _shard_program(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding, blocks: bool) -> Any:
    """The sum, each device over its own shard, then one ``psum``. With ``blocks`` (CPU devices) in 64 KiB
    blocks by a loop (a whole-shard sum would hold a weighted copy of it); without (GPUs, TPUs) in one pass
    that XLA fuses (a loop there costs a kernel launch and a host round trip per block)."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    strides = [s % 2**32 for s in word_strides(word_shape(shape, dtype))]
    sharded = tuple(a for entry in spec for a in entry_axes(entry))

    def local(x: jax.Array) -> jax.Array:
        base = jnp.uint32(0)  # the global index of the shard's first word
        for d, entry in enumerate(spec):
            if entry is not None:
                first = jax.lax.axis_index(entry_axes(entry)).astype(jnp.uint32) * jnp.uint32(x.shape[d])
                base = base + first * jnp.uint32(strides[d])
        rows = x.shape[0]
        words_per_row = math.prod(word_shape(x.shape[1:], dtype)) or 1
        block = max(1, min(rows, BLOCK_WORDS // words_per_row)) if blocks else rows

        def rows_sum(start: Any, size: int) -> jax.Array:
            # Slice first, then reinterpret: the words of one block, never of the whole shard.
            part = jax.lax.dynamic_slice_in_dim(x, start, size, 0)
            return block_share(
                part, base + jnp.asarray(start).astype(jnp.uint32) * jnp.uint32(strides[0]), shape
            )

        full = rows // block
        total = jax.lax.fori_loop(0, full, lambda i, acc: acc + rows_sum(i * block, block), jnp.uint32(0))
        if rows % block:
            total = total + rows_sum(full * block, rows % block)
        total = jax.lax.psum(total, sharded) if sharded else total
        return total[None]

    return jax.jit(
        jax.shard_map(
            local, mesh=sharding.mesh, in_specs=(sharding.spec,), out_specs=PartitionSpec(), check_vma=False
        )
    )


# The fused programs of large arrays' signatures, compiled ahead of a verification by :func:`compile_ahead`.
_AHEAD = CompiledAhead("fingerprint")


def compile_ahead(targets: Sequence[Any]) -> threading.Thread | None:
    """Compiles in a thread the fused programs that will fingerprint arrays like ``targets`` (arrays or
    sharded ``jax.ShapeDtypeStruct``) on GPUs and TPUs; the thread, or None when there is nothing to compile.
    """
    work = {}
    for x in targets:
        sharding = getattr(x, "sharding", None)
        if (
            not isinstance(sharding, NamedSharding)
            or _platform(x) == "cpu"
            or is_key(x)
            or _signature(x) in work
        ):
            continue
        if math.prod(x.shape) * jnp.dtype(x.dtype).itemsize > SMALL_BYTES and _by_shard(x):
            work[_signature(x)] = (_shard_program(x.shape, x.dtype, sharding, False), (x,))
    return _AHEAD.start(work)


def _fused(x: jax.Array) -> Any:
    """The fused program for ``x``'s signature: compiled ahead, or the jitted one."""
    return _AHEAD.get(_signature(x)) or _shard_program(x.shape, x.dtype, x.sharding, False)


def _host(sums: jax.Array) -> np.ndarray:
    if not sums.is_fully_addressable:
        from jax.experimental import multihost_utils

        with recorded("fingerprint.sums", -1, sums.shape):
            sums = multihost_utils.process_allgather(sums, tiled=True)
    return np.asarray(sums)  # also waits: one collective program runs at a time


def _signature(x: jax.Array) -> Any:
    return (x.shape, x.dtype, x.sharding)


def fingerprints(arrays: Sequence[Any]) -> list[str]:
    """One 8-hex-digit fingerprint per array, computed where it lies (see the module's docstring). Arrays
    of one shape, dtype and sharding share a compiled program, called per array, or per 64 when more than
    64 small ones share it; calls run one after the other (XLA's CPU collectives must not interleave).

    >>> a = jnp.arange(8.0)
    >>> fingerprints([a]) == fingerprints([a + 0]), fingerprints([a]) == fingerprints([a.at[3].set(-1.0)])
    (True, False)
    """
    arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in arrays]
    holders = holding_processes(arrays) if jax.process_count() > 1 else set()
    if holders and len(holders) < jax.process_count():  # a mesh that leaves processes out (Trainer.resize)
        mine = _fingerprints(arrays) if jax.process_index() in holders else None
        # the processes holding them sum; every process hears it
        return gather_json(mine, site="fingerprint.holders")[min(holders)]
    return _fingerprints(arrays)


def _fingerprints(arrays: list[jax.Array]) -> list[str]:
    out = [""] * len(arrays)
    where = ["host" if _on_host(x) else "in_place" if _in_place(x) else "program" for x in arrays]
    small = [i for i, w in enumerate(where) if w == "host"]
    here = [i for i, w in enumerate(where) if w == "in_place"]
    groups: dict[Any, list[int]] = {}
    for i in (i for i, w in enumerate(where) if w == "program"):
        groups.setdefault(_signature(arrays[i]), []).append(i)
    routes = {sig: route(arrays[members[0]], len(members)) for sig, members in groups.items()}
    # GPUs, TPUs: every fused program queued first, each read after (one wait, not one per array)
    queued = [i for sig, members in groups.items() if routes[sig] == "fused" for i in members]
    fused = {i: _fused(arrays[i])(arrays[i]) for i in queued}
    for i, value in zip(small, _host_fingerprints([arrays[i] for i in small]), strict=True):
        out[i] = value
    for i, value in zip(here, _in_place_fingerprints([arrays[i] for i in here]), strict=True):
        out[i] = value
    for sig, members in groups.items():
        first, how = arrays[members[0]], routes[sig]
        step = CHUNK if how == "batched" else 1
        for k in range(0, len(members), step):
            chunk = members[k : k + step]
            if how == "fused":  # a large array on GPUs, TPUs: each device over its shard, one psum
                sums = _host(fused[chunk[0]])
            elif how == "blocks":  # on CPU devices, block by block; one at a time (CPU collectives)
                program = _shard_program(first.shape, first.dtype, first.sharding, True)
                sums = _host(program(arrays[chunk[0]]))
            else:
                sums = _host(_program()([arrays[i] for i in chunk]))
            for i, value in zip(chunk, sums, strict=True):
                out[i] = f"{int(value):08x}"
    return out


def route(x: Any, count: int = 1) -> str:
    """How :func:`fingerprints` sums ``x`` (one of ``count`` arrays of its shape, dtype and sharding):
    ``"host"``, ``"in_place"``, ``"blocks"`` (CPU devices), ``"fused"`` (GPUs, TPUs), ``"whole"`` (a
    sharding that does not divide it) or ``"batched"`` (64 small arrays a call).

    >>> route(jnp.ones(4)), route(jnp.ones((512, 512)))
    ('host', 'in_place')
    """
    if _on_host(x):
        return "host"
    if _in_place(x):
        return "in_place"
    if x.nbytes <= SMALL_BYTES and count > CHUNK:
        return "batched"
    if not _by_shard(x):
        return "whole"
    return "blocks" if _platform(x) == "cpu" else "fused"


def _platform(x: jax.Array) -> str:
    return next(iter(x.sharding.device_set)).platform
