"""A snapshot file: ``[8 bytes: where the header starts][the shards][the JSON header]``, each shard's
bytes copied in, each piece's share of its array's fingerprint, and reading it back."""

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
from jax.sharding import SingleDeviceSharding

from nnx_shard._base import cached, in_threads, is_key, is_variable
from nnx_shard._checkpoint._fingerprint_shares import block_fingerprint
from nnx_shard._checkpoint._format import leaf_paths, storable

HEADER = 8  # bytes saying where the JSON header starts; the shards follow them
ALIGN = 64  # each piece starts at a multiple of this (after HEADER)
Shard = tuple[str, list[list[int]], Any, tuple[int, ...]]  # path, [[start, stop], ...], data, global shape
Place = tuple[int, int, str, list[list[int]], tuple[int, ...]]  # leaf, its shard, path, index, global shape


def own_shards(states: Any) -> list[Shard]:
    """``(path, [[start, stop], ...], data, global shape)`` of every shard this process owns (replica 0);
    ``data`` is the shard's single-device ``jax.Array``."""
    values = _values(states)
    return _shards(values, _places(states))


class Layouts:
    """:func:`own_shards` and :func:`layout` of a state, with the last layout remembered: a snapshot of a
    state laid out as the one before flattens it once and builds no path (66 arrays on a 2-core CPU: 0.16
    ms of the step's path instead of 1.2 ms). A layout follows from the state's structure and each array's
    shape, dtype and sharding: the key it is remembered by."""

    def __init__(self) -> None:
        self._last: tuple[Any, bool, list[Place], list[dict[str, Any]], int] | None = None

    def __call__(self, states: Any) -> tuple[list[Shard], list[dict[str, Any]], int, Any]:
        """``(shards, pieces, size, key)``: the shards as :func:`own_shards` gives them, their pieces (new
        dicts) and size as :func:`layout` gives them, and the layout's key (equal for equal layouts)."""
        values, treedef = jax.tree.flatten(states)  # a Variable's leaf is its value
        key = (
            treedef,
            tuple((x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else None for x in values),
        )
        if self._last is None or self._last[0] != key:
            exact = _values(states)
            plain = len(exact) == len(values) and all(a is b for a, b in zip(exact, values, strict=True))
            places = _places(states)
            self._last = (key, plain, places, *layout(_shards(exact, places)))
        _, plain, places, pieces, size = self._last
        shards = _shards(values if plain else _values(states), places)
        return shards, [dict(p) for p in pieces], size, key


def _values(states: Any) -> list[Any]:
    """The leaves' values (a Variable's value), in the order of ``leaf_paths``."""
    return [x.get_value() if is_variable(x) else x for x in jax.tree.leaves(states, is_leaf=is_variable)]


def _places(states: Any) -> list[Place]:
    """Where each shard this process owns (replica 0) is among the leaves of :func:`_values`, with its path,
    index and global shape (a typed PRNG key's as saved: its key data's)."""
    out = []  # leaf_paths walks the same leaves in the same order
    for k, (path, value) in enumerate(leaf_paths(storable(states)[0]).items()):
        if not isinstance(value, jax.Array):
            continue
        for j, shard in enumerate(value.addressable_shards):
            if shard.replica_id != 0:
                continue
            index = [
                [s.start or 0, dim if s.stop is None else s.stop]
                for s, dim in zip(shard.index, value.shape, strict=True)
            ]
            out.append((k, j, path, index, tuple(value.shape)))
    return out


def _shards(values: list[Any], places: list[Place]) -> list[Shard]:
    data = [jax.random.key_data(x) if isinstance(x, jax.Array) and is_key(x) else x for x in values]
    return [(path, index, data[k].addressable_shards[j].data, shape) for k, j, path, index, shape in places]


def snapshot_own_bytes(states: Any) -> int:
    """Bytes of the shards this process owns (replica 0 of its addressable shards): one snapshot's arrays."""
    leaves = [x for x in jax.tree.leaves(states) if isinstance(x, jax.Array)]
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.replica_id == 0)


def layout(shards: Sequence[Shard]) -> tuple[list[dict[str, Any]], int]:
    """Each piece's place in a snapshot file, and where the header starts (``HEADER`` + the shards' bytes)."""
    pieces, offset = [], 0
    for path, index, data, shape in shards:
        nbytes = int(data.nbytes)
        pieces.append(
            {
                "path": path,
                "index": index,
                "shape": list(shape),
                "dtype": data.dtype.name,
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return pieces, HEADER + offset


def _piece(buf: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    raw = buf[HEADER + p["offset"] : HEADER + p["offset"] + p["nbytes"]]
    return raw.view(jnp.dtype(p["dtype"])).reshape([b - a for a, b in p["index"]])


def copy_in(buf: np.ndarray, pieces: Sequence[dict[str, Any]], sources: Sequence[Any]) -> None:
    """Copies each shard (a ``jax.Array`` in host-readable memory, or NumPy) to its place in ``buf``, in one
    thread per core (NumPy lets go of the GIL while it copies)."""

    def copy(k: int) -> None:
        p = pieces[k]
        raw = np.asarray(sources[k]).reshape(-1).view(np.uint8)
        buf[HEADER + p["offset"] : HEADER + p["offset"] + p["nbytes"]] = raw

    in_threads(copy, [p["nbytes"] for p in pieces], serial_below=2**22)


def header_bytes(
    buf: np.ndarray,
    step: int,
    pieces: list[dict[str, Any]],
    data_state: Any = None,
    shares: Sequence[int] | None = None,
) -> bytes:
    """The JSON header of a snapshot whose shards are in ``buf``: its step, process, pieces (each with its
    ``share`` of its array's fingerprint: ``shares`` when the devices summed them, else summed from the
    bytes in ``buf``) and this process's data state."""
    for k, p in enumerate(pieces):  # in one thread: it runs beside the steps, which have the cores
        p["share"] = (
            shares[k]
            if shares is not None
            else block_fingerprint(_piece(buf, p), [a for a, _ in p["index"]], p["shape"])
        )
    header = {"step": step, "process": jax.process_index(), "pieces": pieces, "data_state": data_state}
    return json.dumps(header).encode()


def unpack(buf: np.ndarray) -> tuple[dict[str, Any], dict[tuple[str, str], np.ndarray]]:
    """The header and ``{(path, index as JSON): shard}``; a piece whose fingerprint share differs from the
    one written raises ValueError."""
    at = int.from_bytes(bytes(buf[:HEADER]), "little")
    header = json.loads(bytes(buf[at:]))
    out = {}
    for p in header["pieces"]:
        piece = _piece(buf, p)
        if block_fingerprint(piece, [a for a, _ in p["index"]], p["shape"]) != p["share"]:
            raise ValueError(f"snapshot piece {p['path']} {p['index']} differs from what was written")
        out[(p["path"], json.dumps(p["index"]))] = piece
    return header, out


def host_memory(data: jax.Array) -> Any:
    """An asynchronous copy of a single-device array into its device's ``pinned_host`` memory, or the
    array itself on a CPU device (its memory is the host's) or a device without host memory kinds."""
    device = next(iter(data.devices()))
    if device.platform == "cpu":
        return data
    pinned = _pinned(device)
    return data if pinned is None else jax.device_put(data, pinned)


@cached(maxsize=None)
def _pinned(device: Any) -> SingleDeviceSharding | None:
    """``device``'s ``pinned_host`` memory as a sharding (None where it has none), looked up once: a
    snapshot's copies leave in many chunks."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        kinds = set()
    return SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None


def mapped(path: Path, size: int, *, resize: bool = True) -> np.ndarray:
    """The first ``size`` bytes of the file at ``path`` (made that long, unless ``resize`` is False) as a
    writable array over its pages, mapped with their page tables filled at once: touching 64 MiB of
    pages one by one costs more than copying them."""
    with open(path, "r+b") as f:
        if resize:
            f.truncate(size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(f.fileno(), size, flags=flags), np.uint8)  # unmapped with the array


class Mappings:
    """The snapshot files' mappings (:func:`mapped`), kept from one write of a file to the next: a writer
    with ``keep`` snapshots writes into the same ``keep`` files in turn, and mapping a file with its page
    tables filled, then unmapping it, cost about what copying its bytes does (17 MB on a 2-core CPU: 6 ms
    and 4 ms beside a 4 ms copy), each time.

    A mapping is known by its file's inode, which the mapping holds open, so that a renamed file is found
    again and a number is never another file's. :meth:`keep` lets the mappings of files no longer kept go
    (their memory is freed only then), :meth:`clear` all of them. A writer that ends with its snapshots
    kept leaves its mappings to the next writer of its folder (:class:`Left`).
    """

    def __init__(self) -> None:
        self._maps: dict[int, np.ndarray] = {}

    def pages(self, path: Path, size: int, *, resize: bool = True) -> np.ndarray:
        """``path``'s first ``size`` bytes, mapped: the kept mapping when there is one of that size (the file
        cut to ``size`` when ``resize``: what follows them, an old header, goes), mapped anew otherwise."""
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
        """Unmaps every file."""
        self._maps = {}

    def __len__(self) -> int:
        return len(self._maps)


@dataclasses.dataclass
class Left:
    """What a writer that ends with its snapshots kept leaves the next writer of its folder (each
    ``train()`` call has its own): its files' mappings, the step of its last snapshot, and how long that
    one took to pack. With them the next writer's first snapshot neither maps its files afresh nor sends its
    copy to the peer before its packing is likely done (the step before would wait for it)."""

    maps: Mappings = dataclasses.field(default_factory=Mappings)
    last_write: int = 0
    packed_s: float | None = None

    @classmethod
    def take(cls, folder: Path) -> Left:
        """What the last writer of ``folder`` left, or nothing; what was left in another folder goes."""
        left = _LEFT.pop(folder, None)
        _LEFT.clear()
        return left if left is not None else cls()

    def leave(self, folder: Path) -> None:
        """Hands this to the next writer of ``folder`` (one folder's is kept at a time)."""
        _LEFT.clear()
        _LEFT[folder] = self


_LEFT: dict[Path, Left] = {}  # what a closed writer left, by its folder
