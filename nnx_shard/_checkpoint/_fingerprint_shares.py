"""The fingerprint's sum over a block of an array, written twice: traced for the block's own device
(:func:`block_share`, the one device program) and in NumPy (:func:`block_fingerprint`, the one reference).
The shares of blocks that tile an array add up, modulo 2**32, to its fingerprint (``_fingerprint``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._base import is_key

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_C1, _C2 = np.uint32(0x9E3779B1), np.uint32(0x7F4A7C15)  # numpy: importing must not start a backend


def as_words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (wider types split, narrower ones widened)."""
    if is_key(x):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing dimension of 2
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def word_view(data: np.ndarray) -> np.ndarray:
    """``data``'s words as unsigned integers of its width (a bool as one byte, 0 or 1), no copy."""
    return data.view(np.uint8 if data.dtype == np.bool_ else np.dtype(f"u{data.dtype.itemsize}"))


def word_shape(shape: Sequence[int], dtype: Any) -> tuple[int, ...]:
    """The shape of :func:`as_words` of an array: 8-byte values are two words, in a last dimension."""
    return tuple(shape) + ((2,) if jnp.dtype(dtype).itemsize == 8 else ())


def word_strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def block_base(start: Sequence[int], global_shape: Sequence[int], dtype: Any) -> int:
    """The global word index of a block's first word (what :func:`block_share` takes as ``base``)."""
    strides = word_strides(word_shape(global_shape, dtype))
    return sum(int(f) * st for f, st in zip(start, strides, strict=False)) % 2**32


def block_share(x: jax.Array, base: Any, global_shape: Sequence[int]) -> jax.Array:
    """Traced: the sum over a block ``x`` of an array of ``global_shape`` whose first word is at global index
    ``base`` (a uint32, traced or constant), in one pass that XLA fuses on GPUs and TPUs."""
    words_shape = word_shape(x.shape, x.dtype)
    strides = [s % 2**32 for s in word_strides(word_shape(global_shape, x.dtype))]
    words = as_words(x).reshape(words_shape) if words_shape else as_words(x).reshape(1)
    index = jnp.full(words.shape, base, jnp.uint32)
    for d in range(len(words_shape)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(strides[d])
    return jnp.sum(words * ((index * _C1 + _C2) | jnp.uint32(1)), dtype=jnp.uint32)


def _index_sum(marginal: np.ndarray) -> int:
    """sum_j j * marginal[j], modulo 2**32."""
    return int((np.arange(marginal.size, dtype=np.uint32) * marginal).sum(dtype=np.uint32))


def block_fingerprint(data: np.ndarray, start: Sequence[int], shape: Sequence[int]) -> int:
    """The share of an array's fingerprint that a block of it holds, on the host (nothing compiled).

    ``data`` is the block (C order) whose first element is at ``start`` in an
    array of global ``shape``. The weight ``(i*C1 + C2) | 1`` equals
    ``i*C1 + C2 + (i & 1)`` (C1 and C2 are odd): linear in the word's index
    but for its parity. So the sum follows from the block's sums over each
    dimension (``M_d``, one pass for the first, the rest over smaller sums):
    ``C1 * (base*S + sum_d stride_d * sum_j j*M_d[j]) + C2*S + (the words at odd i)``,
    the last summed over the dimensions of odd stride.

    >>> x = np.arange(24, dtype=np.float32).reshape(4, 6)
    >>> top, bottom = block_fingerprint(x[:2], (0, 0), x.shape), block_fingerprint(x[2:], (2, 0), x.shape)
    >>> (top + bottom) % 2**32 == block_fingerprint(x, (0, 0), x.shape)
    True
    """
    data, shape, start = np.asarray(data), list(shape), list(start)
    if data.ndim == 0:  # a scalar: one element at index 0
        data, shape, start = data.reshape(1), [1], [0]
    data = data if data.flags.c_contiguous else np.ascontiguousarray(data)
    if data.dtype.itemsize == 8:  # as words: two 32-bit words, the low one first, in a last dimension
        words = data.view(np.uint32).reshape(*data.shape, 2)
        shape, start = [*shape, 2], [*start, 0]
    else:
        words = word_view(data)
    if words.size == 0:
        return 0
    strides = word_strides(shape)
    base = sum(f * stride for f, stride in zip(start, strides, strict=True)) % 2**32
    if words.ndim == 1 and words.size > 4096 and math.gcd(words.size, 4096) >= 64:
        k = math.gcd(words.size, 4096)  # one long row as rows of k: the same words, strides (k, 1)
        words, strides = words.reshape(-1, k), [k * strides[0], strides[0]]
    marginals, rest = [], words
    while rest.ndim > 1:  # einsum, not sum: 20% faster here, mostly its sum over dimension 0
        axes = list(range(rest.ndim))
        marginals.append(np.einsum(rest, axes, [0], dtype=np.uint32))
        rest = np.einsum(rest, axes, axes[1:], dtype=np.uint32)
    marginals.append(rest.astype(np.uint32, copy=False))
    total = int(marginals[-1].sum(dtype=np.uint32))
    linear = sum(stride * _index_sum(m) for stride, m in zip(strides, marginals, strict=True))
    odd_dims = [d for d, stride in enumerate(strides) if stride % 2]  # a word's parity: base's and theirs
    if odd_dims == [words.ndim - 1]:
        summed = marginals[-1]
    else:
        summed = np.einsum(words, list(range(words.ndim)), odd_dims, dtype=np.uint32)
    parity = np.full(summed.shape, base % 2, np.uint32)
    for k in range(summed.ndim):
        axis = [1] * summed.ndim
        axis[k] = summed.shape[k]
        parity = parity + np.arange(summed.shape[k], dtype=np.uint32).reshape(axis)
    odd = int((summed * (parity % 2)).sum(dtype=np.uint32))
    return (int(_C1) * (base * total + linear) + int(_C2) * total + odd) % 2**32
