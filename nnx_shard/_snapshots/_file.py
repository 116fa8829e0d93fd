"""A snapshot file: ``[8 bytes: where the header starts][the shards][the JSON header]``. Each shard this
process owns is a :class:`Piece`, aligned to 64 bytes, with its share of its array's fingerprint (an array's
pieces add up to it): a piece is checked where it is read, and the whole once placed."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._base import block_of_shard, in_threads, is_key, is_variable
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

    def view(self, buf: np.ndarray) -> np.ndarray:
        """The piece's bytes in ``buf`` (a whole file) as an array of its block's shape."""
        raw = buf[HEADER + self.offset : HEADER + self.offset + self.nbytes]
        return raw.view(jnp.dtype(self.dtype)).reshape([b - a for a, b in self.index])

    def summed(self, buf: np.ndarray) -> int:
        """The piece's share of its array's fingerprint, from its bytes in ``buf``."""
        return block_fingerprint(self.view(buf), [a for a, _ in self.index], self.shape)


@dataclasses.dataclass
class Header:
    """What a snapshot file says of itself: its step, its writer, its pieces, the data position."""

    step: int
    process: int
    pieces: list[Piece]
    data_state: Any = None

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Header:
        header = json.loads(raw)
        return cls(pieces=[Piece(**p) for p in header.pop("pieces")], **header)

    def bound(self, pieces_bytes: int) -> int:
        """The most bytes :meth:`to_bytes` gives, from :func:`widest_bytes` of the pieces."""
        rest = {"step": self.step, "process": self.process, "pieces": [], "data_state": self.data_state}
        return len(json.dumps(rest).encode()) - 2 + pieces_bytes  # the pieces' JSON in place of "[]"


def widest_bytes(pieces: Sequence[Piece]) -> int:
    """The length of ``pieces``' JSON (as in :meth:`Header.to_bytes`) with each share at its widest."""
    widest = [dataclasses.asdict(dataclasses.replace(p, share=2**32 - 1)) for p in pieces]
    return len(json.dumps(widest).encode())


class Layouts:
    """The shards this process owns in a state, their pieces and the file's size up to the header; the last
    layout is kept by its ``key`` (structure, shapes, dtypes, shardings), so a snapshot builds no path."""

    def __init__(self) -> None:
        self.key: Any = None
        self.widest = 0  # the last layout's widest_bytes
        self._last: tuple[list[Any], list[Piece], int] = ([], [], HEADER)  # its places, pieces and size

    def __call__(self, states: Any) -> tuple[list[Shard], list[Piece], int]:
        flat, treedef = jax.tree.flatten(states)
        key = (treedef, [(x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else None for x in flat])
        if key != self.key:
            places = []  # (leaf, shard, path, index, global shape) of each shard owned (replica 0)
            for k, (path, value) in enumerate(leaf_paths(storable(states)[0]).items()):
                for j, shard in enumerate(value.addressable_shards if isinstance(value, jax.Array) else []):
                    if shard.replica_id == 0:
                        index = [list(b) for b in block_of_shard(shard.index, value.shape)]
                        places.append((k, j, path, index, tuple(value.shape)))
            pieces, at = [], 0  # each piece's offset from the end of the first HEADER bytes
            for s in self._shards(states, places):
                n = int(s.data.nbytes)
                pieces.append(Piece(s.path, s.index, list(s.shape), s.data.dtype.name, at, n))
                at += -(-n // ALIGN) * ALIGN
            self._last = (places, pieces, HEADER + at)
            self.key, self.widest = key, widest_bytes(self._last[1])
        places, pieces, size = self._last
        return self._shards(states, places), [dataclasses.replace(p) for p in pieces], size

    @staticmethod
    def _shards(states: Any, places: list[Any]) -> list[Shard]:
        data = [x.get_value() if is_variable(x) else x for x in jax.tree.leaves(states, is_leaf=is_variable)]
        data = [jax.random.key_data(x) if isinstance(x, jax.Array) and is_key(x) else x for x in data]
        return [Shard(p, i, data[k].addressable_shards[j].data, shape) for k, j, p, i, shape in places]


def own_shards(states: Any) -> list[Shard]:
    """Every shard this process owns (replica 0 of its addressable shards)."""
    return Layouts()(states)[0]


def snapshot_own_bytes(states: Any) -> int:
    """Bytes of the shards this process owns: one snapshot's arrays."""
    return sum(int(s.data.nbytes) for s in own_shards(states))


def copy_in(buf: np.ndarray, pieces: Sequence[Piece], sources: Sequence[Any]) -> None:
    """Copies each shard (host-readable) to its piece of ``buf``, a thread per core (NumPy frees the GIL)."""

    def copy(k: int) -> None:
        at = HEADER + pieces[k].offset
        buf[at : at + pieces[k].nbytes] = np.asarray(sources[k]).reshape(-1).view(np.uint8)

    in_threads(copy, [p.nbytes for p in pieces], serial_below=2**22)


def sum_shares(buf: np.ndarray, pieces: Sequence[Piece]) -> None:
    """Each piece's share of its array's fingerprint, from its bytes in ``buf``."""
    for p in pieces:  # in one thread: it runs beside the steps, which have the cores
        p.share = p.summed(buf)


def unpack(buf: np.ndarray) -> tuple[Header, dict[tuple[str, str], np.ndarray]]:
    """The header and ``{(path, index as JSON): shard}``; ValueError for a piece whose share differs."""
    header = Header.from_bytes(bytes(buf[int.from_bytes(bytes(buf[:HEADER]), "little") :]))
    for p in header.pieces:
        if p.summed(buf) != p.share:
            raise ValueError(f"snapshot piece {p.path} {p.index} differs from what was written")
    return header, {(p.path, json.dumps(p.index)): p.view(buf) for p in header.pieces}
