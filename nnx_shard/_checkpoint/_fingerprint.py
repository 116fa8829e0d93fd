"""Content fingerprints of arrays, computed on the devices and independent of the sharding.

A fingerprint is a 32-bit sum over the array's bits, each 32-bit word weighted
by an odd function of its global position. An integer sum modulo 2**32 does
not depend on the order it is added in, so the same array gives the same
fingerprint however it is sharded, on any number of devices or processes: a
checkpoint saved on 8 devices verifies on 4, or on 2 processes. Any single
changed word changes it (an odd weight times a non-zero difference is
non-zero modulo 2**32); several changed words cancel only by a 1 in 2**32
chance.

Where it is computed (:func:`route` names it, per array):
- On GPUs and TPUs, each device sums its own shard in one fused pass (XLA fuses
  the weighting into the reduction there: no temporary), then one psum adds the
  shards; one program compiled per shape, dtype and sharding.
- On CPU devices across processes, the same, block by block (XLA's CPU backend
  does not fuse the weighting: the temporary is one 64 KiB block): one pass,
  memory-bound (about 10 GB/s on a 2-core CPU's simulated devices).
- On this process's CPU devices, each block is summed where it lies, by NumPy
  over a view of its buffer: the weight is linear in the position but for its
  parity, so the sum follows from the block's sums over each dimension (two
  passes), with nothing copied or compiled: about 20 GB/s on the same CPU.
  (8-byte words, and a dimension before the last of odd stride, take the
  programs.)
- Small arrays whose values this process holds (biases, norms, counters) are
  summed in NumPy on the host, on any backend: no program per shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._base import cached, entry_axes, holding_processes, in_threads, is_key
from nnx_shard._cluster import gather_json

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
# More than CHUNK arrays of one signature, each at most this size, are fingerprinted CHUNK per call.
SMALL_BYTES = 2**20
CHUNK = 64
_C1, _C2 = np.uint32(0x9E3779B1), np.uint32(0x7F4A7C15)  # numpy: importing must not start a backend


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (wider types split, narrower ones widened)."""
    if is_key(x):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing dimension of 2
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _one(x: jax.Array) -> jax.Array:
    w = _words(x)
    if w.ndim == 0:
        w = w[None]
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(w.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= w.shape[dim]
    return _weighted_sum(w, index)


def _weighted_sum(words: jax.Array, index: jax.Array) -> jax.Array:
    """The sum of ``words``, each times an odd function of its global ``index``, modulo 2**32."""
    return jnp.sum(words * ((index * _C1 + _C2) | jnp.uint32(1)), dtype=jnp.uint32)


@cached(maxsize=None)
def _program() -> Any:
    return jax.jit(lambda arrays: jnp.stack([_one(x) for x in arrays]))


# Arrays up to this size, whose values this process holds, are summed on the host (no compile).
HOST_BYTES = 2**16


def _whole_words(x: jax.Array) -> bool:
    """Whether NumPy can sum ``x``'s words as :func:`_words` makes them: bytes of 1, 2 or 4, no key."""
    return not is_key(x) and jax.dtypes.itemsize_bits(x.dtype) % 8 == 0 and jnp.dtype(x.dtype).itemsize <= 4


def _word_view(data: np.ndarray) -> np.ndarray:
    """``data``'s words as unsigned integers of its width (a bool as one byte, 0 or 1), no copy."""
    return data.view(np.uint8 if data.dtype == np.bool_ else np.dtype(f"u{data.dtype.itemsize}"))


def _on_host(x: jax.Array) -> bool:
    """Whether ``x`` is small and readable here: summed by :func:`_host_sum`, not by a program."""
    if x.nbytes > HOST_BYTES or not _whole_words(x):
        return False
    if x.is_fully_addressable:
        return True
    return x.sharding.is_fully_replicated and bool(x.sharding.addressable_devices)


def _host_sum(value: np.ndarray) -> int:
    """The sum of :func:`_one` over an array already on the host: one block of one row."""
    return _block_sum(_word_view(value).reshape(-1), 0, [1])


def _host_fingerprints(arrays: Sequence[jax.Array]) -> list[str]:
    """:func:`fingerprints` of small arrays, read to the host together (a replicated one from one copy)."""
    local = [x if x.is_fully_addressable else x.addressable_data(0) for x in arrays]
    return [f"{_host_sum(np.asarray(value)):08x}" for value in jax.device_get(local)]


# On CPU devices, arrays are summed where they lie, by NumPy (False: by the devices' programs).
IN_PLACE = True


def _word_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    """The shape of :func:`_words` of an array: 8-byte values are two words, in a last dimension."""
    return tuple(shape) + ((2,) if jnp.dtype(dtype).itemsize == 8 else ())


def _word_strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def _in_place(x: jax.Array) -> bool:
    """Whether ``x`` is summed in place by :func:`_block_sum`: on this process's CPUs, whole bytes of
    at most 4, and every dimension but the last of even stride (a word's parity is then its last index's)."""
    if not IN_PLACE or x.ndim == 0 or not x.is_fully_addressable or not _whole_words(x):
        return False
    if any(d.platform != "cpu" for d in x.sharding.device_set):
        return False
    return all(stride % 2 == 0 for stride in _word_strides(x.shape)[:-1])


def _index_sum(marginal: np.ndarray) -> int:
    """sum_j j * marginal[j], modulo 2**32."""
    return int((np.arange(marginal.size, dtype=np.uint32) * marginal).sum(dtype=np.uint32))


def _block_sum(words: np.ndarray, base: int, strides: Sequence[int]) -> int:
    """:func:`_one`'s sum over one block (its first word at global index ``base``), in two passes.

    The weight ``(i*C1 + C2) | 1`` equals ``i*C1 + C2 + (i & 1)`` (C1 and C2 are
    odd), which is linear in the index but for its parity. So the sum is
    ``C1 * (base*S + sum_d stride_d * sum_j j*M_d[j]) + C2*S + (the words at odd i)``,
    where ``M_d`` sums the block over every dimension but ``d``: one pass for
    ``M_0``, one for the sum over dimension 0, the rest over that smaller sum.
    """
    if words.ndim == 1 and words.size > 4096 and math.gcd(words.size, 4096) >= 64:
        k = math.gcd(words.size, 4096)  # one long row as rows of k: the same words, strides (k, 1)
        words, strides = words.reshape(-1, k), (k * strides[0], strides[0])
    marginals, rest = [], words
    while rest.ndim > 1:  # einsum, not sum: 20% faster here, mostly its sum over dimension 0
        axes = list(range(rest.ndim))
        marginals.append(np.einsum(rest, axes, [0], dtype=np.uint32))
        rest = np.einsum(rest, axes, axes[1:], dtype=np.uint32)
    marginals.append(rest.astype(np.uint32, copy=False))
    total = int(marginals[-1].sum(dtype=np.uint32))
    linear = sum(stride * _index_sum(m) for stride, m in zip(strides, marginals, strict=True))
    odd = int(marginals[-1][(base + 1) % 2 :: 2].sum(dtype=np.uint32))
    return (int(_C1) * (base * total + linear) + int(_C2) * total + odd) % 2**32


def block_fingerprint(data: np.ndarray, start: Sequence[int], shape: Sequence[int]) -> int:
    """The share of :func:`fingerprints`' sum that a block of an array holds, on the host (nothing compiled).

    ``data`` is the block (C order) whose first element is at ``start`` in an
    array of global ``shape``. The shares of blocks that tile the array add up,
    modulo 2**32, to its fingerprint: a snapshot sums each piece where it is
    written and checks the whole after it is read back onto other devices.

    >>> x = np.arange(24, dtype=np.float32).reshape(4, 6)
    >>> top, bottom = block_fingerprint(x[:2], (0, 0), x.shape), block_fingerprint(x[2:], (2, 0), x.shape)
    >>> f"{(top + bottom) % 2**32:08x}" == fingerprints([jnp.asarray(x)])[0]
    True
    """
    data = np.asarray(data)
    data = data if data.flags.c_contiguous else np.ascontiguousarray(data)  # (which makes a scalar 1-D)
    shape, start = list(shape), list(start)
    if data.dtype.itemsize == 8:  # as _words: two 32-bit words, the low one first, in a last dimension
        words = data.view(np.uint32).reshape(*data.shape, 2)
        shape, start = [*shape, 2], [*start, 0]
    else:
        words = _word_view(data)
    if words.ndim == 0:
        words, shape, start = words.reshape(1), [1], [0]
    strides = _word_strides(shape)
    base = sum(f * stride for f, stride in zip(start, strides, strict=True)) % 2**32
    if words.size == 0:
        return 0
    if all(stride % 2 == 0 for stride in strides[:-1]):
        return _block_sum(words, base, strides)
    index = np.full((), base, np.uint32)  # a word's global index, for any strides (small arrays, mostly)
    for d, stride in enumerate(strides):
        axis = [1] * words.ndim
        axis[d] = words.shape[d]
        index = index + np.arange(words.shape[d], dtype=np.uint32).reshape(axis) * np.uint32(stride % 2**32)
    weights = (index * _C1 + _C2) | np.uint32(1)
    return int((words.astype(np.uint32) * weights).sum(dtype=np.uint32))


@cached(maxsize=256)
def _bases(shape: tuple[int, ...], sharding: Any) -> tuple[list[int], dict[Any, int]]:
    """The word strides, and the global index of each block's first word, on one device per block."""
    strides, bases, seen = _word_strides(shape), {}, set()
    for device, index in sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id):
        first = tuple((i.start or 0) for i in index)
        if first not in seen:
            seen.add(first)
            bases[device] = sum(f * stride for f, stride in zip(first, strides, strict=True)) % 2**32
    return strides, bases


def _in_place_fingerprints(arrays: Sequence[jax.Array]) -> list[str]:
    """:func:`fingerprints` of arrays on this process's CPUs: each block summed where it lies (a NumPy
    view of its buffer, nothing copied or compiled), in one thread per core (NumPy lets go of the GIL),
    each thread given blocks of about equal bytes."""
    blocks = []  # (array number, words, base, strides)
    for n, x in enumerate(arrays):
        strides, bases = _bases(tuple(x.shape), x.sharding)
        for shard in x.addressable_shards:
            if shard.device in bases:  # each block once
                blocks.append((n, _word_view(np.asarray(shard.data)), bases[shard.device], strides))
    if not blocks:
        return ["00000000"] * len(arrays)  # nothing to sum: empty arrays
    parts = in_threads(
        lambda k: _block_sum(blocks[k][1], blocks[k][2], blocks[k][3]), [b[1].nbytes for b in blocks]
    )
    sums = [0] * len(arrays)
    for (n, _, _, _), value in zip(blocks, parts, strict=True):
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
    """The same sum as :func:`_one`, each device over its own shard, then one ``psum``.

    With ``blocks`` (CPU devices), the shard is summed in 64 KiB blocks by a
    loop: XLA's CPU backend does not fuse the weighting into the reduction, so
    a whole-shard sum would hold a weighted copy of it. Without (GPUs, TPUs),
    in one pass that XLA fuses: a loop there costs a kernel launch and a host
    round trip per block.
    """
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    words_shape = _word_shape(shape, dtype)
    strides = [s % 2**32 for s in _word_strides(words_shape)]
    sharded = tuple(a for entry in spec for a in entry_axes(entry))

    def local(x: jax.Array) -> jax.Array:
        shard = x.shape + words_shape[len(shape) :]  # the shard's words
        base = jnp.uint32(0)
        for d, entry in enumerate(spec):
            if entry is not None:
                first = jax.lax.axis_index(entry_axes(entry)).astype(jnp.uint32) * jnp.uint32(shard[d])
                base = base + first * jnp.uint32(strides[d])
        rest = jnp.zeros(shard[1:], jnp.uint32)
        for d in range(1, len(shard)):
            rest = rest + jax.lax.broadcasted_iota(jnp.uint32, shard[1:], d - 1) * jnp.uint32(strides[d])
        rows = shard[0]
        block = max(1, min(rows, BLOCK_WORDS // max(1, int(np.prod(shard[1:], dtype=np.int64)))))
        block = block if blocks else rows

        def block_sum(start: jax.Array, size: int) -> jax.Array:
            # Slice first, then reinterpret: the words of one block, never of the whole shard.
            part = _words(jax.lax.dynamic_slice_in_dim(x, start, size, 0))
            row = jax.lax.broadcasted_iota(jnp.uint32, part.shape, 0) + start.astype(jnp.uint32)
            index = base + row * jnp.uint32(strides[0]) + rest[None]
            return _weighted_sum(part, index)

        full = rows // block
        total = jax.lax.fori_loop(0, full, lambda i, acc: acc + block_sum(i * block, block), jnp.uint32(0))
        if rows % block:
            total = total + block_sum(jnp.int32(full * block), rows % block)
        total = jax.lax.psum(total, sharded) if sharded else total
        return total[None]

    return jax.jit(
        jax.shard_map(
            local, mesh=sharding.mesh, in_specs=(sharding.spec,), out_specs=PartitionSpec(), check_vma=False
        )
    )


@cached(maxsize=256)
def _block_program(shape: tuple[int, ...], dtype: Any, global_shape: tuple[int, ...]) -> Any:
    """``(block, base) -> share``: :func:`block_fingerprint` of a block of ``global_shape`` whose first word
    is at global index ``base``, on the block's own device, in one fused pass (``base`` is an argument: one
    program for every block of one shape)."""
    words_shape = _word_shape(shape, dtype)
    strides = [s % 2**32 for s in _word_strides(_word_shape(global_shape, dtype))]

    def share(x: jax.Array, base: jax.Array) -> jax.Array:
        words = _words(x).reshape(words_shape) if words_shape else _words(x).reshape(1)
        index = jnp.full(words.shape, base, jnp.uint32)
        for d in range(len(words_shape)):
            index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(strides[d])
        return _weighted_sum(words, index)

    return jax.jit(share)


def device_shares(blocks: Sequence[tuple[jax.Array, Sequence[int], Sequence[int]]]) -> list[jax.Array]:
    """Each ``(block, start, global shape)``'s share of its array's fingerprint, dispatched on the block's own
    device and not waited for (a uint32 scalar each; ``int()`` reads it). The shares of blocks tiling an
    array add up to :func:`fingerprints`' value, as :func:`block_fingerprint`'s do.

    >>> x = jnp.arange(24.0).reshape(4, 6)
    >>> shares = device_shares([(x[:2], (0, 0), (4, 6))])
    >>> [int(s) for s in shares] == [block_fingerprint(np.asarray(x[:2]), (0, 0), (4, 6))]
    True
    """
    out = []
    for data, start, shape in blocks:
        strides = _word_strides(_word_shape(shape, data.dtype))
        base = sum(int(f) * st for f, st in zip(start, strides, strict=False)) % 2**32
        program = _block_program(tuple(data.shape), data.dtype, tuple(shape))
        device = next(iter(data.devices()))
        out.append(program(data, jax.device_put(np.uint32(base), device)))
    return out


def _host(sums: jax.Array) -> np.ndarray:
    if not sums.is_fully_addressable:
        from jax.experimental import multihost_utils

        sums = multihost_utils.process_allgather(sums, tiled=True)
    return np.asarray(sums)  # also waits: one collective program runs at a time


def _signature(x: jax.Array) -> Any:
    return (x.shape, x.dtype, x.sharding)


def fingerprints(arrays: Sequence[Any]) -> list[str]:
    """One 8-hex-digit fingerprint per array, computed on the arrays' own devices.

    Small arrays this process holds are summed on the host, and arrays on this
    process's CPU devices where they lie (see the module's docstring). Other
    arrays of one shape, dtype and sharding share a compiled program, one call
    per array, or per 64 arrays when more than 64 small ones share it (a deep
    model). Calls run one after the other (XLA's CPU collectives must not
    interleave).

    >>> a = jnp.arange(8.0)
    >>> fingerprints([a]) == fingerprints([a + 0]), fingerprints([a]) == fingerprints([a.at[3].set(-1.0)])
    (True, False)
    """
    arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in arrays]
    holders = holding_processes(arrays) if jax.process_count() > 1 else set()
    if holders and len(holders) < jax.process_count():  # a mesh that leaves processes out (Trainer.resize)
        mine = _fingerprints(arrays) if jax.process_index() in holders else None
        return gather_json(mine)[min(holders)]  # the processes holding them sum; every process hears it
    return _fingerprints(arrays)


def _fingerprints(arrays: list[jax.Array]) -> list[str]:
    out = [""] * len(arrays)
    small = [i for i, x in enumerate(arrays) if _on_host(x)]
    for i, value in zip(small, _host_fingerprints([arrays[i] for i in small]), strict=True):
        out[i] = value
    here = [i for i, x in enumerate(arrays) if not out[i] and _in_place(x)]
    for i, value in zip(here, _in_place_fingerprints([arrays[i] for i in here]), strict=True):
        out[i] = value
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(arrays):
        if not out[i]:
            groups.setdefault(_signature(x), []).append(i)
    for members in groups.values():
        first = arrays[members[0]]
        how = route(first, len(members))
        step = CHUNK if how == "batched" else 1
        for k in range(0, len(members), step):
            chunk = members[k : k + step]
            if how in ("blocks", "fused"):  # a large array: each device over its shard, one psum
                program = _shard_program(first.shape, first.dtype, first.sharding, how == "blocks")
                sums = _host(program(arrays[chunk[0]]))
            else:
                sums = _host(_program()([arrays[i] for i in chunk]))
            for i, value in zip(chunk, sums, strict=True):
                out[i] = f"{int(value):08x}"
    return out


def route(x: Any, count: int = 1) -> str:
    """How :func:`fingerprints` sums ``x`` (one of ``count`` arrays of its shape, dtype and sharding):
    ``"host"`` (small, in NumPy), ``"in_place"`` (NumPy over this process's CPU buffers), ``"blocks"`` (a
    program, 64 KiB blocks per shard: CPU devices), ``"fused"`` (a program, one pass per shard: GPUs and
    TPUs), ``"whole"`` (a program over the whole array: a sharding that does not divide it) or ``"batched"``
    (64 small arrays per program call).

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
