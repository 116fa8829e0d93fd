"""In-memory snapshots: each process's own shards in host memory, and a copy of one peer's that travels
through JAX.

Every ``snapshot_every`` steps each process packs the shards it owns (the
replica-0 copy of every addressable shard of model, optimizer and EMA) into
one file with a JSON header, in its own folder under the snapshot directory
(``/dev/shm`` where it exists: host memory). The same bytes go to one peer
through a ``ppermute`` over a mesh of one device per process, so that a host's
death loses no snapshot data: the peer is on another failure domain (the host
name, or ``NNX_SHARD_FAILURE_DOMAIN``). Each process reads and writes only its
own sub-folder, as on separate hosts. The newest ``keep`` snapshots are kept.

Off the step's path: on GPUs and TPUs, the step that takes a snapshot only
queues one program per device that copies its shards within its own memory
and sums each piece's fingerprint share (``_snapshot_stage``); the copies then
leave for the host in chunks, two at a time, in the background, so that the
steps' own small reads are not queued behind the whole snapshot. Where a
device lacks the memory for the copies, the step starts the transfer of the
live shards to host memory (``pinned_host``) and their shares. On CPU devices,
whose memory is the host's, the step makes the one copy straight into the
snapshot's file (needed before the next step may donate the buffers), and the
shares are summed from the bytes in the background. Writing the header and the
peer's copy happen while the next steps run. A snapshot due while the last one is
still being written is skipped and counted (as Orbax skips a save), so the
step never waits on a copy. Each piece carries its share of the array's
content fingerprint, summed from the bytes written: the pieces of one array
add up to the fingerprint of the step the snapshot claims.

A snapshot's folder is written as ``.step-N.tmp`` and renamed (complete, or
not there), reusing the pages of the oldest kept snapshot. The file's layout is
in ``_snapshot_file``; restoring from them on the survivors in ``_snapshot_read``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from nnx_shard._base import Laps, Worker
from nnx_shard._checkpoint._fingerprint_shares import device_shares
from nnx_shard._checkpoint._snapshot_file import (
    HEADER,
    Layouts,
    Left,
    Mappings,
    copy_in,
    header_bytes,
    host_memory,
)
from nnx_shard._checkpoint._snapshot_peer import exchange, outgoing, peers, received
from nnx_shard._checkpoint._snapshot_stage import Staged, Staging
from nnx_shard._cluster import gather_json
from nnx_shard.errors import ConfigError

logger = logging.getLogger("nnx_shard")
DOMAIN = "NNX_SHARD_FAILURE_DOMAIN"


def default_snapshot_dir(job: str) -> Path:
    """``/dev/shm/nnx_shard-<job>`` where ``/dev/shm`` exists (host memory), else under the temp dir."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"nnx_shard-{job}"


def snapshot_folder(directory: Path, run: int | None, process: int) -> Path:
    """A process's own folder: ``process-<id>``, under ``run-<restart>`` in a job of ``nnx-shard launch``
    (ids are renumbered on a restart, so each run has its own folders)."""
    return (directory if run is None else directory / f"run-{run}") / f"process-{process}"


def _accelerated(shards: Sequence[Any]) -> bool:
    """Whether the shards are on GPUs or TPUs (not CPU devices, whose memory is the host's)."""
    return any(next(iter(d.devices())).platform != "cpu" for _, _, d, _ in shards)


@dataclasses.dataclass
class _Snapshot:
    """One snapshot being written: its folder (``.step-N.tmp`` until complete), its own file's pieces, the
    copies its shards come from (None once copied) and its own file's mapping when the step copied into it."""

    step: int
    folder: Path  # .step-N.tmp, made ready (:meth:`SnapshotWriter._reuse`) on the step's path or after it
    pieces: list[dict[str, Any]]
    size: int
    sources: list[Any] | None
    data_state: Any
    exchanged: bool = False
    ready: bool = False  # the folder is made ready
    error: str | None = None
    pages: np.ndarray | None = None
    shares: list[Any] | None = None  # each piece's fingerprint share, computed on its device (GPUs, TPUs)
    staged: Staged | None = None  # the devices' own copies, and their shares (GPUs, TPUs with room)
    on_path: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds by phase
    background: dict[str, float] = dataclasses.field(default_factory=dict)
    exchange_after: int = 1  # its copy goes to the peer before this many steps after its own have run
    began: float = dataclasses.field(default_factory=time.perf_counter)
    packed_s: float | None = None  # from the write to the end of its packing
    outgoing: tuple[np.ndarray, int] | None = None  # the copy for the peer (several processes), once packed


class SnapshotWriter:
    """Writes each snapshot (own + one peer's shards) to this process's folder, off the step's path; keeps
    the newest ``keep``.

    ``write`` starts a snapshot and returns; with several processes, ``poll``
    before each step sends the packed copy to the peer (every process calls both
    at the same steps): as many steps after the snapshot as the slowest process's
    last packing took (the processes agree on it at each snapshot), so that the
    steps do not wait for the packing; before the next step at a folder's first
    (the writer of the last ``train()`` call leaves what it measured to the next).
    ``wait`` finishes the snapshot in flight; ``skipped`` counts the snapshots
    not taken because one was still being written, and :attr:`phases` says where
    the last finished one's time went.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 2,
        run: int | None = None,
        discard: Sequence[Path] = (),
    ):
        self.directory = Path(directory)
        self.keep = max(keep, 1)
        domain = os.environ.get(DOMAIN) or socket.gethostname()
        all_domains = [str(d) for d in gather_json(domain)]
        self.dest = peers(all_domains)
        self.folder = snapshot_folder(self.directory, run, jax.process_index())
        self._discard = list(discard)  # folders of the run before, removed once this run has a snapshot
        self._newest = max(self._steps(), default=0)  # the newest kept snapshot's step
        self._worker = Worker("nnx_shard-snapshot")  # the background work, one job at a time
        self._job: threading.Event | None = None  # set once the job in flight is done
        self._current: _Snapshot | None = None  # the snapshot being written
        self.skipped = 0
        self.last_bytes = (0, 0)
        left = Left.take(self.folder)  # from the last writer of this folder (the last train() call's)
        self._maps = left.maps  # the kept snapshots' files, mapped; each write reuses one
        self._staging = Staging()
        self._layouts = Layouts()  # the last state's layout, remembered
        self._finished: _Snapshot | None = None  # the last snapshot whose write ended
        self._last_write = left.last_write  # the step of the last snapshot due
        self._packed_before = left.packed_s  # the last writer's last packing: its seconds
        self._polled: tuple[int, float] | None = None  # the last poll's step, and when it returned
        self._steps_s: collections.deque[float] = collections.deque(maxlen=16)  # seconds between polls

    def prepare(self, states: Any) -> None:
        """Compiles, in the background, what a snapshot of ``states`` runs on the devices (GPUs, TPUs): the
        first snapshot then dispatches and returns."""
        shards, _, _, key = self._layouts(states)  # remembered for the first snapshot
        if _accelerated(shards):
            self._staging.prepare(shards, key)

    def check_space(self, own_bytes: int) -> int:
        """Bytes the kept snapshots need here (own + peer, times ``keep``); ConfigError when the folder lacks
        them."""
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

    @property
    def in_flight(self) -> int | None:
        """The step of the snapshot still being written here (None when none is)."""
        current = self._current
        if current is None or (current.exchanged and (self._job is None or self._job.is_set())):
            return None
        return current.step

    def _agree(self, step: int) -> tuple[bool, int]:
        """Whether a snapshot is still being written on any process, and how many steps the snapshot of
        ``step`` leaves its packing before its copy goes to the peer: the slowest process's last packing, in
        steps, within the steps to the next snapshot (a collective with several processes)."""
        mine, last_step, self._last_write = self.in_flight is not None, self._last_write, step
        if jax.process_count() == 1:  # its own peer: nothing waits
            return mine, 1
        packed, need = self._last_packed_s, 1
        if packed is not None and self._steps_s:  # a step: the median of the last
            need = min(step - last_step - 1, math.ceil(packed / statistics.median(self._steps_s)) + 1)
        # one collective of two integers (gather_json takes two: the lengths, then the bytes)
        votes = np.asarray(multihost_utils.process_allgather(np.array([mine, max(need, 1)], np.int64)))
        busy, after = votes.reshape(-1, 2).T
        return bool(busy.any()), int(after.max())

    def write(self, step: int, states: Any, data_state: Any = None, *, skip_if_busy: bool = False) -> bool:
        """Starts the snapshot of ``step`` (every process calls it at the same step) and returns.

        With ``skip_if_busy`` a snapshot still in flight on any process makes this one skipped (False,
        counted in ``skipped``); otherwise it is finished first.
        """
        laps = Laps()
        busy, exchange_after = self._agree(step) if skip_if_busy else (False, 1)
        if busy:
            self.skipped += 1
            return False
        if jax.process_count() > 1 and skip_if_busy:
            laps.lap("agree")  # a collective
        self.wait()  # (counted with the layout) the snapshot before, when it is still being written
        if step <= self._newest:  # the run restored an older step: the snapshots of the branch it left go, so
            for newer in [s for s in self._steps() if s >= step]:  # that a restart never resumes from one
                shutil.rmtree(self.folder / f"step-{newer}", ignore_errors=True)
        self._newest = step
        shards, pieces, size, key = self._layouts(states)
        laps.lap("layout")
        staged = self._staging.stage(shards, key) if _accelerated(shards) else None
        # copied within each device's memory (GPUs, TPUs with room): the next step may donate at once
        sources = None if staged is not None else [host_memory(d) for _, _, d, _ in shards]
        laps.lap("stage" if staged is not None else "to_host_started")
        tmp = self.folder / f".step-{step}.tmp"
        snapshot = _Snapshot(step, tmp, pieces, size, sources, data_state, staged=staged, on_path=laps)
        snapshot.exchange_after = exchange_after
        if sources is not None and any(s is d for s, (_, _, d, _) in zip(sources, shards, strict=True)):
            # shards with no copy under way (CPU devices, whose memory is the host's; devices without host
            # memory kinds): copied now, before the next step may donate them, into the file's pages
            self._reuse(tmp)  # elsewhere made ready in the background
            laps.lap("folder")
            # mapped since its last write, or by the last write's background (the step then only copies)
            snapshot.pages = self._maps.pages(tmp / "own.bin", size)  # summed from in the background
            snapshot.ready = True
            copy_in(snapshot.pages, pieces, snapshot.sources)
            snapshot.sources = None
            laps.lap("copy")
        elif staged is None:  # the shares summed by the devices, queued before the next step
            snapshot.shares = device_shares(
                [(d, [a for a, _ in index], shape) for _, index, d, shape in shards]
            )
            laps.lap("shares_started")
        snapshot.exchanged = jax.process_count() == 1  # one process is its own peer
        self._current = snapshot
        self.last_bytes = (size, self.last_bytes[1] if jax.process_count() > 1 else size)
        self._start(self._seal, snapshot)
        laps.lap("thread")
        return True

    @property
    def phases(self) -> dict[str, dict[str, float]]:
        """Where the last complete snapshot's seconds went: ``on_the_steps_path`` (``agree`` with several
        processes, ``layout``, then ``stage`` on GPUs and TPUs, ``to_host_started`` with ``folder`` and
        ``copy`` (CPU devices) or ``shares_started`` elsewhere, ``thread``; with several processes
        ``packing_waited``, what the step that sent the peer's copy waited for the packing, and
        ``exchange``) and ``in_the_background`` (``folder`` where the step did not copy, ``map``,
        ``to_host``, then ``into_file`` when staged, ``shares``, ``header``, then with several processes
        ``peer_copy`` and ``peer``, ``publish``). Empty before the first."""
        done = self._finished
        if done is None:
            return {}
        return {"on_the_steps_path": dict(done.on_path), "in_the_background": dict(done.background)}

    def poll(self, step: int) -> None:
        """Before the step after ``step``, on every process: the snapshot in flight goes to the peer once
        its ``exchange_after`` steps have run (its ``ppermute`` queued before that step), its packing waited
        for if still under way."""
        now, current = time.perf_counter(), self._current
        if self._polled is not None and self._polled[0] == step - 1:  # a step's seconds, without exchanges
            self._steps_s.append(now - self._polled[1])
        due = current is not None and step + 1 - current.step >= current.exchange_after
        if current is not None and due and not current.exchanged:
            self._exchange(current)
        self._polled = (step, time.perf_counter())

    def wait(self) -> None:
        """Finishes the snapshot in flight (its peer copy included: every process calls it together)."""
        current = self._current
        if current is not None and not current.exchanged:
            self._exchange(current)
        self._join()
        if current is not None and current.error is not None:
            logger.warning("the snapshot of step %d could not be written: %s", current.step, current.error)
            current.error = None

    def close(self, *, remove: bool) -> None:
        """Waits for the last write; ``remove`` frees this process's snapshots (a finished run needs none)."""
        self.wait()
        self._current, maps, self._maps = None, self._maps, Mappings()
        if remove:
            maps.clear()
            shutil.rmtree(self.folder, ignore_errors=True)
        elif len(maps):  # for the next train() call's writer
            Left(maps, self._last_write, self._last_packed_s).leave(self.folder)

    @property
    def _last_packed_s(self) -> float | None:
        """How long the last finished snapshot took to pack (the last writer's before this one's first)."""
        return self._finished.packed_s if self._finished is not None else self._packed_before

    def _start(self, target: Any, *args: Any) -> None:
        self._job = self._worker.submit(target, *args)

    def _join(self) -> None:
        if self._job is not None:
            self._job.wait()
            self._job = None

    def _reuse(self, tmp: Path) -> None:
        """Makes ``tmp`` (``.step-N.tmp``), the folder a snapshot is written in: the oldest kept one's
        (its pages already allocated) renamed when ``keep`` are there; a new one otherwise."""
        self.folder.mkdir(parents=True, exist_ok=True)
        leftovers = [p for p in self.folder.glob(".step-*.tmp") if p != tmp]  # of a write that died
        steps = self._steps()
        reused = (
            leftovers[:1]
            or [self.folder / f"step-{s}" for s in steps[: max(len(steps) - self.keep + 1, 0)]][:1]
        )
        if tmp.exists():
            shutil.rmtree(tmp)
        for extra in leftovers[1:]:
            shutil.rmtree(extra, ignore_errors=True)
        if reused:
            reused[0].rename(tmp)
        else:
            tmp.mkdir()
        (tmp / "own.bin").touch()

    def _steps(self) -> list[int]:
        """The steps of the snapshots kept here, oldest first."""
        return sorted(int(p.name.split("-")[1]) for p in self.folder.glob("step-*"))

    def _premap(self, size: int, steps: Sequence[int]) -> None:
        """Maps the oldest kept snapshot's file, which the next write reuses, without changing it (kept
        mapped from its last write once the writer has gone round), and unmaps the files no longer kept."""
        folders = [self.folder / f"step-{s}" for s in steps]
        own = folders[0] / "own.bin" if len(steps) >= self.keep else None
        if own is not None and own.exists() and own.stat().st_size >= size:
            self._maps.pages(own, size, resize=False)
        self._maps.keep([f for folder in folders for f in folder.glob("*.bin")])

    def _seal(self, snapshot: _Snapshot) -> None:
        """In the background: copies the shards (when they were not copied at the step), sums each piece,
        writes the header; with one process, the snapshot is then complete."""
        laps = Laps()
        try:
            if not snapshot.ready:  # GPUs, TPUs: the folder made ready off the step's path
                self._reuse(snapshot.folder)
                laps.lap("folder")
            own = snapshot.folder / "own.bin"
            # mapped on the step's path (CPU devices), or here: the pages the last write mapped for this one
            buf = snapshot.pages if snapshot.pages is not None else self._maps.pages(own, snapshot.size)
            snapshot.pages = None  # the mapping stays (self._maps): the next write into this file finds it
            laps.lap("map")
            if snapshot.staged is not None:  # the devices' own copies, now to the host
                snapshot.staged.write_into(buf, snapshot.pieces, laps)
            if snapshot.sources is not None:
                copy_in(buf, snapshot.pieces, snapshot.sources)  # waits for the copies to host memory
                snapshot.sources = None
            laps.lap("to_host")
            shares = None if snapshot.shares is None else [int(x) for x in snapshot.shares]
            if snapshot.staged is not None:
                shares, snapshot.staged = snapshot.staged.share_values(), None
            snapshot.shares = None
            laps.lap("shares")  # the devices' (waited for); summed from the bytes in header_bytes otherwise
            header = header_bytes(buf, snapshot.step, snapshot.pieces, snapshot.data_state, shares)
            laps.lap("shares" if shares is None else "header")
            buf[:HEADER] = np.frombuffer(snapshot.size.to_bytes(HEADER, "little"), np.uint8)
            with open(own, "r+b") as f:
                f.seek(snapshot.size)
                f.write(header)
                f.truncate(snapshot.size + len(header))
            laps.lap("header")
            if not snapshot.exchanged:  # the copy for the peer, made ready off the step's path
                snapshot.outgoing = outgoing([buf, np.frombuffer(header, np.uint8)])
                laps.lap("peer_copy")
            snapshot.background, snapshot.packed_s = laps, time.perf_counter() - snapshot.began
            if snapshot.exchanged:
                self._publish(snapshot, None)
        except (OSError, jax.errors.JaxRuntimeError) as e:  # a full disk; no host memory for a transfer
            snapshot.error = str(e)

    def _exchange(self, snapshot: _Snapshot) -> None:
        """Sends the packed own file to the peer (a collective, on the main thread) and writes what came
        here in the background."""
        began = time.perf_counter()
        self._join()  # the own file is packed
        snapshot.on_path["packing_waited"] = time.perf_counter() - began
        out = snapshot.outgoing if snapshot.error is None else None
        snapshot.outgoing = None
        began = time.perf_counter()
        sent = exchange(out if out is not None else outgoing([np.zeros(HEADER, np.uint8)]), self.dest)
        snapshot.on_path["exchange"] = time.perf_counter() - began  # queued before the next step
        snapshot.exchanged = True
        self._start(self._receive, snapshot, sent)

    def _receive(self, snapshot: _Snapshot, sent: Any) -> None:
        try:
            began = time.perf_counter()
            peer = received(sent)
            snapshot.background["peer"] = time.perf_counter() - began
            self.last_bytes = (self.last_bytes[0], int(peer.size))
            if snapshot.error is None:
                self._publish(snapshot, peer)
        except (OSError, ValueError) as e:  # a peer whose own copy failed sent no header
            snapshot.error = f"the peer's copy: {e}"

    def _publish(self, snapshot: _Snapshot, peer: np.ndarray | None) -> None:
        """Writes the peer's copy (when another process's), renames the folder ``step-N``, drops older
        ones."""
        began = time.perf_counter()
        tmp, final = snapshot.folder, self.folder / f"step-{snapshot.step}"
        stale = set(tmp.glob("peer-*.bin"))
        if peer is not None:
            at = int.from_bytes(bytes(peer[:HEADER]), "little")
            source = int(json.loads(bytes(peer[at:]))["process"])
            if source != jax.process_index():
                path = tmp / f"peer-{source}.bin"
                stale.discard(path)
                path.touch()
                self._maps.pages(path, int(peer.size))[:] = peer
        for path in stale:
            path.unlink()
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # complete, or not there
        steps = self._steps()
        for old in steps[: -self.keep]:
            shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)
        for old in self._discard:  # a restart's: the snapshots of the run before are superseded
            shutil.rmtree(old, ignore_errors=True)
        self._discard = []
        self._premap(snapshot.size, steps[-self.keep :])
        snapshot.background["publish"] = time.perf_counter() - began
        self._finished = snapshot
