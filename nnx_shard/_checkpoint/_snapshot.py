"""In-memory snapshots: each process's own shards in host memory, and a copy of one peer's that travels through JAX.

Every ``snapshot_every`` steps each process packs the shards it owns (the
replica-0 copy of every addressable shard of model, optimizer and EMA) into
one buffer with a JSON header, and writes it to its own folder under the
snapshot directory (``/dev/shm`` where it exists: host memory). The same
buffer goes to one peer through a ``ppermute`` over a mesh of one device per
process, so that a host's death loses no snapshot data: the peer is on another
failure domain (the host name, or ``NNX_SHARD_FAILURE_DOMAIN``). Each process
reads and writes only its own sub-folder, as on separate hosts. The newest
``keep`` snapshots are kept.

Restoring from them on the survivors is in ``_snapshot_read``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._checkpoint._format import leaf_paths, storable, tree_fingerprints
from nnx_shard.errors import ConfigError

DOMAIN = "NNX_SHARD_FAILURE_DOMAIN"
HEADER = 8  # bytes of the header's length, then the header, then the shards


def default_snapshot_dir(job: str) -> Path:
    """``/dev/shm/nnx_shard-<job>`` where ``/dev/shm`` exists (host memory), else under the temp dir."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"nnx_shard-{job}"


def snapshot_folder(directory: Path, run: int | None, process: int) -> Path:
    """A process's own folder: ``process-<id>``, under ``run-<restart>`` in a job of ``nnx-shard launch``
    (ids are renumbered on a restart, so each run has its own folders)."""
    return (directory if run is None else directory / f"run-{run}") / f"process-{process}"


def own_shards(states: Any) -> list[tuple[str, list[list[int]], np.ndarray, tuple[int, ...]]]:
    """``(path, [[start, stop], ...], data, global shape)`` of every shard this process owns (replica 0)."""
    out = []
    for path, value in leaf_paths(storable(states)[0]).items():
        if not isinstance(value, jax.Array):
            continue
        for shard in value.addressable_shards:
            if shard.replica_id != 0:
                continue
            index = [
                [s.start or 0, dim if s.stop is None else s.stop]
                for s, dim in zip(shard.index, value.shape, strict=True)
            ]
            out.append((path, index, np.asarray(shard.data), tuple(value.shape)))
    return out


def snapshot_own_bytes(states: Any) -> int:
    """Bytes of the shards this process owns (replica 0 of its addressable shards): one snapshot's arrays."""
    leaves = [x for x in jax.tree.leaves(states) if isinstance(x, jax.Array)]
    return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.replica_id == 0)


def pack(
    step: int,
    shards: Sequence[tuple[str, list[list[int]], np.ndarray, tuple[int, ...]]],
    fingerprints: dict[str, str] | None = None,
    out: np.ndarray | None = None,
    data_state: Any = None,
) -> np.ndarray:
    """One uint8 buffer: the header's length, the JSON header (step, pieces, CRC32s, the arrays' content
    fingerprints, as checkpoints carry, this process's data-iterator state), then the shards' bytes."""
    pieces, raws, offset = [], [], 0
    for path, index, data, shape in shards:
        raw = np.ascontiguousarray(data).view(np.uint8).ravel()
        raws.append(raw)
        pieces.append(
            {
                "path": path,
                "index": index,
                "shape": list(shape),
                "dtype": str(data.dtype),
                "offset": offset,
                "nbytes": int(raw.size),
                "crc32": zlib.crc32(raw),
            }
        )
        offset += raw.size
    header = {
        "step": step,
        "process": jax.process_index(),
        "pieces": pieces,
        "fingerprints": fingerprints or {},
        "data_state": data_state,
    }
    header = json.dumps(header).encode()
    size = HEADER + len(header) + offset
    # A buffer reused from an earlier snapshot: no fresh pages to fault in (half the cost at 64 MB).
    buf = out[:size] if out is not None and out.size >= size else np.empty(size, np.uint8)
    buf[:HEADER] = np.frombuffer(len(header).to_bytes(HEADER, "little"), np.uint8)
    buf[HEADER : HEADER + len(header)] = np.frombuffer(header, np.uint8)
    at = HEADER + len(header)
    for raw, piece in zip(raws, pieces, strict=True):
        buf[at + piece["offset"] : at + piece["offset"] + piece["nbytes"]] = raw
    return buf


def unpack(buf: np.ndarray) -> tuple[dict[str, Any], dict[tuple[str, str], np.ndarray]]:
    """The header and ``{(path, index as JSON): shard}``; a piece whose CRC32 differs raises ValueError."""
    size = int.from_bytes(bytes(buf[:HEADER]), "little")
    header = json.loads(bytes(buf[HEADER : HEADER + size]))
    at, out = HEADER + size, {}
    for p in header["pieces"]:
        raw = buf[at + p["offset"] : at + p["offset"] + p["nbytes"]]
        if zlib.crc32(raw) != p["crc32"]:
            raise ValueError(f"snapshot piece {p['path']} {p['index']} differs from what was written")
        shape = [stop - start for start, stop in p["index"]]
        out[(p["path"], json.dumps(p["index"]))] = raw.view(jnp.dtype(p["dtype"])).reshape(shape)
    return header, out


def peers(domains: Sequence[str]) -> list[int]:
    """Where each process sends its copy: a ring over the processes grouped by failure domain.

    The shift is the largest domain's size, so a copy leaves its domain when
    the domains are equal in size; with one domain it is plain ring order.

    >>> peers(["a", "a", "b", "b"]), peers(["h"] * 3)
    ([2, 3, 0, 1], [1, 2, 0])
    """
    n = len(domains)
    order = sorted(range(n), key=lambda i: (domains[i], i))
    largest = max(sum(1 for d in domains if d == x) for x in set(domains))
    shift = largest if largest < n else 1
    dest = [0] * n
    for k, i in enumerate(order):
        dest[i] = order[(k + shift) % n]
    return dest


def process_mesh() -> Mesh:
    """A 1-D mesh ``("p",)`` of one device per process (its lowest id): for collectives between processes."""
    n = jax.process_count()
    return Mesh(
        np.array(
            [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(n)]
        ),
        ("p",),
    )


def exchange(buf: np.ndarray, dest: Sequence[int]) -> np.ndarray:
    """Sends ``buf`` to process ``dest[me]`` and returns the buffer received, through a JAX ``ppermute``."""
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return buf  # its own peer: written twice, never changed
    lengths = np.asarray(multihost_utils.process_allgather(np.array([buf.size], np.int64))).ravel()
    width = int(lengths.max())
    mesh = process_mesh()
    devices = list(mesh.devices.flat)
    row = np.zeros((1, width), np.uint8)
    row[0, : buf.size] = buf
    local = jax.device_put(row, devices[me])
    spec = PartitionSpec("p")
    whole = jax.make_array_from_single_device_arrays((n, width), NamedSharding(mesh, spec), [local])
    perm = [(i, int(dest[i])) for i in range(n)]
    moved = jax.jit(
        jax.shard_map(lambda x: jax.lax.ppermute(x, "p", perm), mesh=mesh, in_specs=spec, out_specs=spec)
    )(whole)
    source = perm[[d for _, d in perm].index(me)][0]
    return np.asarray(moved.addressable_shards[0].data)[0, : int(lengths[source])]


class SnapshotWriter:
    """Writes each snapshot (own + one peer's shards) to this process's folder; keeps the newest ``keep``."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 2,
        run: int | None = None,
        discard: Sequence[Path] = (),
    ):
        self.directory = Path(directory)
        self.keep = keep
        domain = os.environ.get(DOMAIN) or socket.gethostname()
        all_domains = [str(d) for d in gather_json(domain)]
        self.dest = peers(all_domains)
        self.folder = snapshot_folder(self.directory, run, jax.process_index())
        self._discard = list(discard)  # folders of the run before, removed once this run has a snapshot
        self._thread: threading.Thread | None = None
        self._spare: np.ndarray | None = None  # the last snapshot's buffer, reused once it is written
        self.last_bytes = (0, 0)

    def check_space(self, own_bytes: int) -> int:
        """Bytes the kept snapshots need here (own + peer, times ``keep``); ConfigError when the folder lacks them."""
        sizes = np.asarray(multihost_utils.process_allgather(np.array([own_bytes], np.int64))).ravel()
        source = self.dest.index(jax.process_index())
        need = int((own_bytes + sizes[source]) * self.keep)
        self.directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise ConfigError(
                f"snapshots need {need / 2**20:.1f} MiB in {self.directory} (own and a peer's shards, "
                f"{self.keep} kept) and {free / 2**20:.1f} MiB are free; set config.snapshot_dir to a "
                f"larger tmpfs, or snapshot_every=0."
            )
        return need

    def write(self, step: int, states: Any, data_state: Any = None) -> None:
        """Packs this process's shards, sends a copy to the peer (a collective: every process calls it), writes both."""
        self.wait()
        spare, self._spare = self._spare, None
        fingerprints = tree_fingerprints(storable(states)[0])
        own = pack(step, own_shards(states), fingerprints, out=spare, data_state=data_state)
        self._spare = own.base if own.base is not None and own.base is spare else own
        peer = exchange(own, self.dest)
        self.last_bytes = (int(own.size), int(peer.size))
        self._thread = threading.Thread(target=self._write, args=(step, own, peer), daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, step: int, own: np.ndarray, peer: np.ndarray) -> None:
        source = int(
            json.loads(bytes(peer[HEADER : HEADER + int.from_bytes(bytes(peer[:HEADER]), "little")]))[
                "process"
            ]
        )
        final = self.folder / f"step-{step}"
        tmp = self.folder / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        own.tofile(tmp / "own.bin")
        if source != jax.process_index():  # one process is its own peer: nothing more to keep
            peer.tofile(tmp / f"peer-{source}.bin")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # complete, or not there
        steps = sorted(int(p.name.split("-")[1]) for p in self.folder.glob("step-*"))
        for old in steps[: -self.keep]:
            shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
        for old in self._discard:  # a restart's: the snapshots of the run before are superseded
            shutil.rmtree(old, ignore_errors=True)
        self._discard = []

    def close(self, *, remove: bool) -> None:
        """Waits for the last write; ``remove`` frees this process's snapshots (a finished run needs none)."""
        self.wait()
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)


def gather_json(value: Any) -> list[Any]:
    """Every process's ``value`` (anything JSON holds), in process order: a collective."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    if jax.process_count() == 1:
        return [json.loads(data.tobytes())]
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).ravel()
    raw = np.zeros((int(sizes.max()),), np.uint8)
    raw[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(raw)).reshape(len(sizes), -1)
    return [json.loads(r[:size].tobytes()) for r, size in zip(rows, sizes, strict=True)]
