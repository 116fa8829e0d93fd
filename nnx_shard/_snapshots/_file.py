"""A snapshot file: ``[8 bytes: where the header starts][the shards][the JSON header]``.

Each shard this process owns (replica 0 of its addressable shards) is a :class:`Piece` of the file, aligned
to 64 bytes, with its share of its array's content fingerprint: the pieces of one array add up to the
fingerprint of the step, so that a piece is checked where it is read and the whole once placed.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._base import in_threads, is_key, is_variable
from nnx_shard._checkpoint import block_fingerprint, leaf_paths, storable

HEADER = 8  # bytes saying where the JSON header starts; the shards follow them
ALIGN = 64  # each piece starts at a multiple of this (after HEADER)


@dataclasses.dataclass
class Shard:
    """A shard this process owns: its leaf's path, where it sits in the array, its data, the array's shape."""

    path: str
    index: list[list[int]]  # [[start, stop], ...] per dimension
    data: jax.Array  # single-device
    shape: tuple[int, ...]


@dataclasses.dataclass
class Piece:
    """A shard's place in a snapshot file, and its share of its array's fingerprint (once summed)."""

    path: str
    index: list[list[int]]
    shape: list[int]  # the array's
    dtype: str
    offset: int  # from the end of the first HEADER bytes
    nbytes: int
    share: int | None = None

    @property
    def start(self) -> list[int]:
        return [a for a, _ in self.index]

    def view(self, buf: np.ndarray) -> np.ndarray:
        """The piece's bytes in ``buf`` (a whole file) as an array of its block's shape."""
        raw = buf[HEADER + self.offset : HEADER + self.offset + self.nbytes]
        return raw.view(jnp.dtype(self.dtype)).reshape([b - a for a, b in self.index])


@dataclasses.dataclass
class Header:
    """What a snapshot file says of itself: its step, the process that wrote it, its pieces, the data
    position."""

    step: int
    process: int
    pieces: list[Piece]
    data_state: Any = None

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Header:
        header = json.loads(raw)
        pieces = [Piece(**p) for p in header.pop("pieces")]
        return cls(pieces=pieces, **header)

    def bound(self, pieces_bytes: int | None = None) -> int:
        """The most bytes :meth:`to_bytes` gives once every piece's share is summed; ``pieces_bytes``, the
        length of the pieces' JSON with each share at its widest, when known (:attr:`Layouts.widest`)."""
        if pieces_bytes is None:
            pieces_bytes = widest_bytes(self.pieces)
        rest = {"step": self.step, "process": self.process, "pieces": [], "data_state": self.data_state}
        return len(json.dumps(rest).encode()) - 2 + pieces_bytes  # the pieces' JSON in place of "[]"


def widest_bytes(pieces: Sequence[Piece]) -> int:
    """The length of ``pieces``' JSON (as :meth:`Header.to_bytes` writes it) with each share at its widest."""
    return len(
        json.dumps([dataclasses.asdict(dataclasses.replace(p, share=2**32 - 1)) for p in pieces]).encode()
    )


class Layouts:
    """The shards this process owns in a state, and their pieces, with the last layout remembered: a
    snapshot of a state laid out as the one before builds no path. A layout follows from the state's
    structure and each array's shape, dtype and sharding: the key it is remembered by."""

    def __init__(self) -> None:
        self._last: tuple[Any, bool, list[tuple[int, int, str, list[list[int]], tuple[int, ...]]], list, int]
        self._last = None  # type: ignore[assignment]
        self.widest = 0  # the last layout's pieces' JSON length, each share at its widest (Header.bound)

    def __call__(self, states: Any) -> tuple[list[Shard], list[Piece], int, Any]:
        """``(shards, pieces, size, key)``: the shards, their pieces (new ones) and the file's size up to the
        header, and the layout's key (equal for equal layouts)."""
        flat, treedef = jax.tree.flatten(states)  # a Variable's leaf is its value (one C call)
        key = (
            treedef,
            tuple((x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else None for x in flat),
        )
        if self._last is None or self._last[0] != key:
            values = _values(states)
            # the plain flatten gives the values themselves unless a Variable holds no leaf (None)
            plain = len(values) == len(flat) and all(a is b for a, b in zip(values, flat, strict=True))
            places = _places(states)
            self._last = (key, plain, places, *layout(_shards(values, places)))
            self.widest = widest_bytes(self._last[3])
        _, plain, places, pieces, size = self._last
        shards = _shards(flat if plain else _values(states), places)
        return shards, [dataclasses.replace(p) for p in pieces], size, key


def _values(states: Any) -> list[Any]:
    """The leaves' values (a Variable's value), in the order of ``leaf_paths``."""
    return [x.get_value() if is_variable(x) else x for x in jax.tree.leaves(states, is_leaf=is_variable)]


def _places(states: Any) -> list[tuple[int, int, str, list[list[int]], tuple[int, ...]]]:
    """``(leaf, shard, path, index, global shape)`` of each shard this process owns (replica 0), in the
    order of the leaves (a typed PRNG key's as saved: its key data's)."""
    out = []
    for k, (path, value) in enumerate(leaf_paths(storable(states)[0]).items()):
        if not isinstance(value, jax.Array):
            continue
        for j, shard in enumerate(value.addressable_shards):
            if shard.replica_id == 0:
                index = [
                    [s.start or 0, n if s.stop is None else s.stop]
                    for s, n in zip(shard.index, value.shape, strict=True)
                ]
                out.append((k, j, path, index, tuple(value.shape)))
    return out


def _shards(
    values: list[Any], places: Sequence[tuple[int, int, str, list[list[int]], tuple[int, ...]]]
) -> list[Shard]:
    data = [jax.random.key_data(x) if isinstance(x, jax.Array) and is_key(x) else x for x in values]
    return [
        Shard(path, index, data[k].addressable_shards[j].data, shape) for k, j, path, index, shape in places
    ]


def own_shards(states: Any) -> list[Shard]:
    """Every shard this process owns (replica 0 of its addressable shards)."""
    return Layouts()(states)[0]


def snapshot_own_bytes(states: Any) -> int:
    """Bytes of the shards this process owns: one snapshot's arrays."""
    leaves = [x for x in jax.tree.leaves(states) if isinstance(x, jax.Array)]
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.replica_id == 0)


def layout(shards: Sequence[Shard]) -> tuple[list[Piece], int]:
    """Each shard's piece of a snapshot file, and where the header starts (``HEADER`` + the shards' bytes)."""
    pieces, offset = [], 0
    for s in shards:
        nbytes = int(s.data.nbytes)
        pieces.append(Piece(s.path, s.index, list(s.shape), s.data.dtype.name, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return pieces, HEADER + offset


def copy_in(buf: np.ndarray, pieces: Sequence[Piece], sources: Sequence[Any]) -> None:
    """Copies each shard (a ``jax.Array`` the host can read, or NumPy) to its place in ``buf``, in one
    thread per core (NumPy lets go of the GIL while it copies)."""

    def copy(k: int) -> None:
        p = pieces[k]
        buf[HEADER + p.offset : HEADER + p.offset + p.nbytes] = (
            np.asarray(sources[k]).reshape(-1).view(np.uint8)
        )

    in_threads(copy, [p.nbytes for p in pieces], serial_below=2**22)


def sum_shares(buf: np.ndarray, pieces: Sequence[Piece]) -> None:
    """Each piece's share of its array's fingerprint, summed from its bytes in ``buf``."""
    for p in pieces:  # in one thread: it runs beside the steps, which have the cores
        p.share = block_fingerprint(p.view(buf), p.start, p.shape)


def unpack(buf: np.ndarray) -> tuple[Header, dict[tuple[str, str], np.ndarray]]:
    """The header and ``{(path, index as JSON): shard}``; a piece whose fingerprint share differs from the
    one written raises ValueError."""
    header = Header.from_bytes(bytes(buf[int.from_bytes(bytes(buf[:HEADER]), "little") :]))
    out = {}
    for p in header.pieces:
        piece = p.view(buf)
        if block_fingerprint(piece, p.start, p.shape) != p.share:
            raise ValueError(f"snapshot piece {p.path} {p.index} differs from what was written")
        out[(p.path, json.dumps(p.index))] = piece
    return header, out


def mapped(path: Path, size: int, *, resize: bool = True) -> np.ndarray:
    """The first ``size`` bytes of the file at ``path`` (made that long, unless ``resize`` is False) as a
    writable array over its pages, mapped with their page tables filled at once."""
    with open(path, "r+b") as f:
        if resize:
            f.truncate(size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(f.fileno(), size, flags=flags), np.uint8)  # unmapped with the array


class Mappings:
    """The kept snapshot files' mappings (:func:`mapped`), from one write of a file to the next: a writer
    with ``keep`` snapshots writes into the same ``keep`` files in turn, and mapping a file with its page
    tables filled costs about what copying its bytes does. A mapping is known by its file's inode (which
    the mapping holds open), so that a renamed file is found again."""

    def __init__(self) -> None:
        self._maps: dict[int, np.ndarray] = {}

    def pages(self, path: Path, size: int, *, resize: bool = True) -> np.ndarray:
        """``path``'s first ``size`` bytes, mapped: the kept mapping when there is one of that size (the file
        cut to ``size`` when ``resize``), mapped anew otherwise."""
        inode = path.stat().st_ino
        kept = self._maps.get(inode)
        if kept is None or kept.size != size:
            self._maps.pop(inode, None)
            self._maps[inode] = kept = mapped(path, size, resize=resize)
        elif resize:
            os.truncate(path, size)
        return kept

    def keep(self, paths: Sequence[Path]) -> None:
        """Unmaps every file but those at ``paths``."""
        inodes = {p.stat().st_ino for p in paths if p.exists()}
        self._maps = {k: v for k, v in self._maps.items() if k in inodes}

    def clear(self) -> None:
        self._maps = {}

    def __len__(self) -> int:
        return len(self._maps)
