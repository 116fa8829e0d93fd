"""The transforms of a pretrained weight's key map: parsed without eval, applied to the part of a tensor a
shard needs.

A transform is a chain of ``T``, ``transpose(...)``, ``reshape(...)`` and
``split(axis, n, i)``, joined by ``|`` like tactics. Each step maps a box of
its output back to the box of its input that covers it, so a shard reads only
the bytes under it: a transpose and a split exactly, a reshape by whole units
of the axes it merges or splits (the heads of a ``(heads * head_dim, embed)``
projection, never its whole rows when only some heads are wanted).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import re
from collections.abc import Sequence

import numpy as np

from nnx_shard._base import Block
from nnx_shard.errors import WeightsMismatchError

_CALL = re.compile(r"^\s*(T|transpose|reshape|split)\s*(?:\(([-\d,\s]*)\))?\s*$")


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a transform: ``transpose`` (``args``: the permutation), ``reshape`` (the new shape) or
    ``split`` (axis, parts, which)."""

    name: str
    args: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})"


def parse(text: str | None) -> tuple[Op, ...]:
    """The ops of a transform string; ``None`` or ``""`` is none.

    >>> [str(op) for op in parse("T | reshape(4, 2)")]
    ['transpose(1, 0)', 'reshape(4, 2)']
    >>> parse("__import__('os')")  # never evaluated
    Traceback (most recent call last):
    ...
    nnx_shard.errors.WeightsMismatchError: transform step "__import__('os')" is not one of T, ...
    """
    ops = []
    for part in (text or "").split("|"):
        if not part.strip():
            continue
        m = _CALL.match(part)
        if m is None:
            raise WeightsMismatchError(
                f"transform step {part.strip()!r} is not one of T, transpose(...), reshape(...), "
                f"split(axis, n, i); chain them with '|', e.g. \"T | reshape(4096, 32, 128)\"."
            )
        name, raw = m.group(1), m.group(2)
        args = tuple(int(x) for x in (raw or "").split(",") if x.strip())
        if name == "T":
            name, args = "transpose", (1, 0)
        if name == "split" and len(args) != 3:
            raise WeightsMismatchError(f"split takes (axis, n, i); got {part.strip()!r}.")
        ops.append(Op(name, args))
    return tuple(ops)


def shape_after(ops: Sequence[Op], shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a tensor of ``shape`` has after ``ops``; WeightsMismatchError when one does not fit."""
    shape = tuple(shape)
    for op in ops:
        if op.name == "transpose":
            if sorted(op.args) != list(range(len(shape))):
                raise WeightsMismatchError(
                    f"{op} does not permute the {len(shape)} axes of a {shape} tensor."
                )
            shape = tuple(shape[a] for a in op.args)
        elif op.name == "reshape":
            new = list(op.args)
            if new.count(-1) == 1:
                new[new.index(-1)] = math.prod(shape) // max(1, -math.prod(new))
            if math.prod(new) != math.prod(shape):
                raise WeightsMismatchError(
                    f"{op} does not fit a {shape} tensor ({math.prod(shape)} elements)."
                )
            shape = tuple(new)
        else:
            axis, n, i = op.args
            if not (0 <= axis < len(shape) and 0 <= i < n and shape[axis] % n == 0):
                raise WeightsMismatchError(f"{op} does not fit a {shape} tensor.")
            shape = shape[:axis] + (shape[axis] // n,) + shape[axis + 1 :]
    return shape


def full_ops(ops: Sequence[Op], file_shape: Sequence[int], target_shape: Sequence[int]) -> tuple[Op, ...]:
    """``ops`` and the implied reshape to ``target_shape``: allowed only where it splits or merges adjacent
    axes in order (``(4096, 4096)`` -> ``(4096, 32, 128)``), never a same-size reshape that scrambles the
    tensor (a ``(128, 64)`` weight into a ``(64, 128)`` kernel is a missing transpose).

    >>> [str(op) for op in full_ops(parse("T"), (8, 4), (4, 2, 4))]
    ['transpose(1, 0)', 'reshape(4, 2, 4)']
    >>> full_ops((), (128, 64), (64, 128))
    Traceback (most recent call last):
    ...
    nnx_shard.errors.WeightsMismatchError: a (128, 64) tensor is not a (64, 128) leaf with axes split or
      merged in order; ...
    """
    after = shape_after(ops, file_shape)
    if after == tuple(target_shape):
        return tuple(ops)
    done = f" after {' | '.join(map(str, ops))}" if ops else ""
    if math.prod(after) != math.prod(target_shape):
        raise WeightsMismatchError(
            f"a {tuple(file_shape)} tensor{done} holds {math.prod(after)} elements, the "
            f"{tuple(target_shape)} "
            f"leaf {math.prod(target_shape)}."
        )
    if not is_split_or_merge(after, tuple(target_shape)):
        hint = (
            ' (add "T" to the rule: the file stores it transposed)'
            if after == tuple(target_shape)[::-1]
            else ""
        )
        raise WeightsMismatchError(
            f"a {after} tensor{done} is not a {tuple(target_shape)} leaf with axes split or merged in order; "
            f'reshaping it would scramble its values{hint}. Give the rule a transform, e.g. "T" or '
            f'"T | reshape(...)".'
        )
    return (*ops, Op("reshape", tuple(target_shape)))


def is_split_or_merge(old: tuple[int, ...], new: tuple[int, ...]) -> bool:
    """Whether ``old`` -> ``new`` only splits axes or merges adjacent ones, in order (axes of 1 aside).

    >>> is_split_or_merge((64, 128), (64, 2, 64)), is_split_or_merge((128, 64), (64, 128))
    (True, False)
    """
    old, new = tuple(d for d in old if d != 1), tuple(d for d in new if d != 1)
    return all(len(a) <= 1 or len(b) <= 1 for a, b in _groups(old, new))


def _groups(old: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Runs of axes of ``old`` and ``new`` with equal products (a reshape merges or splits within each)."""
    out, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        a, b = [i], [j]
        pa, pb = (old[i] if i < len(old) else 1), (new[j] if j < len(new) else 1)
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= old[i]
                a.append(i)
                i += 1
            else:
                pb *= new[j]
                b.append(j)
                j += 1
        out.append(([x for x in a if x < len(old)], [y for y in b if y < len(new)]))
    return out


def _cover(op: Op, in_shape: tuple[int, ...], out_box: Block) -> tuple[Block, Block]:
    """The input box that covers ``out_box`` and the output box that input becomes (covering ``out_box``)."""
    if op.name == "transpose":
        inverse = np.argsort(op.args)
        return tuple(out_box[k] for k in inverse), out_box
    if op.name == "split":
        axis, n, i = op.args
        off = i * in_shape[axis] // n
        lo, hi = out_box[axis]
        return out_box[:axis] + ((lo + off, hi + off),) + out_box[axis + 1 :], out_box
    new = shape_after([op], in_shape)
    in_box, cover = [None] * len(in_shape), [None] * len(new)
    for a, b in _groups(in_shape, new):
        if len(a) == 1 and len(b) == 1:
            in_box[a[0]] = cover[b[0]] = out_box[b[0]]
            continue
        # whole units of the group's first output axis: the rest of the group in full
        inner = math.prod(new[y] for y in b[1:])
        lo, hi = out_box[b[0]] if b else (0, 1)
        flat_lo, flat_hi = lo * inner, hi * inner
        rest_in = math.prod(in_shape[x] for x in a[1:])
        if a and flat_lo % rest_in == 0 and flat_hi % rest_in == 0:
            in_box[a[0]] = (flat_lo // rest_in, flat_hi // rest_in)
            for x in a[1:]:
                in_box[x] = (0, in_shape[x])
            if b:
                cover[b[0]] = (lo, hi)
        else:  # the whole group
            for x in a:
                in_box[x] = (0, in_shape[x])
            if b:
                cover[b[0]] = (0, new[b[0]])
        for y in b[1:]:
            cover[y] = (0, new[y])
    return tuple(in_box), tuple(cover)  # type: ignore[arg-type]


def source_box(ops: Sequence[Op], file_shape: Sequence[int], box: Block) -> Block:
    """The box of the file tensor that ``ops`` turn into data covering ``box`` of the result."""
    shapes = [tuple(file_shape)]
    for op in ops:
        shapes.append(shape_after([op], shapes[-1]))
    for op, in_shape in zip(reversed(ops), reversed(shapes[:-1]), strict=True):
        box = _cover(op, in_shape, box)[0]
    return box


def apply(
    ops: Sequence[Op], file_shape: Sequence[int], data: np.ndarray, read: Block, want: Block
) -> np.ndarray:
    """``want`` of the transformed tensor, from ``data``: the file tensor's box ``read`` (see
    :func:`source_box`)."""
    shapes = [tuple(file_shape)]
    for op in ops:
        shapes.append(shape_after([op], shapes[-1]))
    # the box each step's output must cover, from the last step back
    wants = [want]
    for op, in_shape in zip(reversed(ops), reversed(shapes[:-1]), strict=True):
        wants.append(_cover(op, in_shape, wants[-1])[0])
    wants.reverse()
    box = read
    for k, op in enumerate(ops):
        if op.name == "transpose":
            data, box = data.transpose(op.args), tuple(box[a] for a in op.args)
        elif op.name == "split":
            axis, n, i = op.args
            off = i * shapes[k][axis] // n
            box = box[:axis] + ((box[axis][0] - off, box[axis][1] - off),) + box[axis + 1 :]
        else:  # by whole units of the merged or split axes, then cut to what the next step needs
            box = _cover(op, shapes[k], wants[k + 1])[1]
            data = data.reshape([hi - lo for lo, hi in box])
            data = data[
                tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(wants[k + 1], box, strict=True))
            ]
            box = wants[k + 1]
    return data[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(want, box, strict=True))]


def invert(ops: Sequence[Op], file_shape: Sequence[int], value: np.ndarray) -> np.ndarray:
    """The file tensor (of ``file_shape``) that ``ops`` turn into ``value``; splits are joined by the
    caller."""
    shapes = [tuple(file_shape)]
    for op in ops:
        shapes.append(shape_after([op], shapes[-1]))
    for op, in_shape in zip(reversed(ops), reversed(shapes[:-1]), strict=True):
        if op.name == "transpose":
            value = value.transpose(np.argsort(op.args))
        elif op.name == "reshape":
            value = value.reshape(in_shape)
    return value


_OWN_MAPPING = 2**20  # bytes from which a block gets a memory mapping of its own
_TILE = (256, 64)  # elements along (the source's contiguous axis, the result's last axis): 64 KiB of float32


def aligned_empty(shape: Sequence[int], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary, which a CPU device takes as its buffer
    without a copy (``numpy.empty`` gives 16 bytes: placing it copies every byte into new memory).

    >>> aligned_empty((3, 5), np.float32).ctypes.data % 64
    0
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes >= _OWN_MAPPING:  # its own pages, given back when the array goes (an arena would keep them)
        private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
        return np.frombuffer(mmap.mmap(-1, nbytes, **private), dtype).reshape(shape)
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def copy_tiled(out: np.ndarray, data: np.ndarray) -> None:
    """``out[...] = data``, tile by tile when ``data``'s smallest stride is not along the last axis.

    numpy's own copy walks ``out``'s rows and so reads one cache line per element of a transposed
    source; a tile of ``_TILE`` elements reads lines that stay in the cache: 0.36-1.09 GB/s become
    2.1-3.6 GB/s for parts of a (2816, 1024) float32 tensor here.

    >>> out = np.empty((3, 2), np.float32)
    >>> copy_tiled(out, np.arange(6.0).reshape(2, 3).T)
    >>> out.tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    """
    last = data.ndim - 1
    strides = [abs(s) if n > 1 else math.inf for s, n in zip(data.strides, data.shape, strict=True)]
    near = int(np.argmin(strides)) if data.ndim > 1 else last
    if near == last or data.size == 0:
        out[...] = data
        return
    index: list[slice] = [slice(None)] * data.ndim
    for i in range(0, data.shape[near], _TILE[0]):
        index[near] = slice(i, i + _TILE[0])
        for j in range(0, data.shape[last], _TILE[1]):
            index[last] = slice(j, j + _TILE[1])
            out[tuple(index)] = data[tuple(index)]
