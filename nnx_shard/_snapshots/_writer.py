"""In-memory snapshots: each process's own shards in host memory, and a copy of one peer's through JAX.

Every ``snapshot_every`` steps each process packs the shards it owns (replica 0 of every addressable shard)
into one file (``_file``) in its own folder under the snapshot directory (``/dev/shm`` where it exists).
The same bytes go to one peer on another failure domain (the host name, or ``NNX_SHARD_FAILURE_DOMAIN``)
through ``ppermute``s (``_peer``), so that a host's death loses no snapshot data.

On CPU devices the step copies the shards straight into the file (before the next step may donate them);
on GPUs and TPUs it queues each device's copy within its own memory (``_device``). The shares, the header
and the peer's copy are made in one background thread. Every collective is decided by values all processes
agreed on: each snapshot starts with one agreement (``[busy, width]``), and the copy goes to the peer a
fixed number of steps after it. A folder is written as ``.step-N.tmp`` and renamed (complete, or not
there), reusing the pages of the oldest kept one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nnx_shard._cluster import agree, gather_json
from nnx_shard._snapshots._device import Staged, Staging
from nnx_shard._snapshots._file import HEADER, Header, Layouts, Mappings, Shard, copy_in, sum_shares
from nnx_shard._snapshots._peer import empty, exchange, outgoing, peers, place, received, row_width
from nnx_shard.errors import ConfigError

logger = logging.getLogger("nnx_shard")
DOMAIN = "NNX_SHARD_FAILURE_DOMAIN"
EXCHANGE_AFTER = 2  # steps from a snapshot to its copy's exchange (one step runs beside its packing)


def default_snapshot_dir(job: str) -> Path:
    """``/dev/shm/nnx_shard-<job>`` where ``/dev/shm`` exists (host memory), else under the temp dir."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"nnx_shard-{job}"


def snapshot_folder(directory: Path, run: int | None, process: int) -> Path:
    """A process's own folder: ``process-<id>``, under ``run-<restart>`` in a job of ``nnx-shard launch``
    (ids are renumbered on a restart, so each run has its own folders)."""
    return (directory if run is None else directory / f"run-{run}") / f"process-{process}"


def _accelerated(shards: Sequence[Shard]) -> bool:
    """Whether the shards are on GPUs or TPUs (not CPU devices, whose memory is the host's)."""
    return any(next(iter(s.data.devices())).platform != "cpu" for s in shards)


@dataclasses.dataclass
class _Snapshot:
    """One snapshot being written."""

    step: int
    folder: Path  # .step-N.tmp until it is complete
    header: Header
    size: int  # where the header starts in its own file
    width: int  # of the rows every process sends its peer, agreed
    pages: np.ndarray | None = None  # its own file, mapped, when the step copied into it
    staged: Staged | None = None  # the devices' own copies (GPUs, TPUs)
    parts: list[Any] | None = None  # the copy for the peer, once packed and placed (``place``)
    exchanged: bool = False
    error: str | None = None


class SnapshotWriter:
    """Writes each snapshot (own + one peer's shards) to this process's folder, off the step's path; keeps
    the newest ``keep``.

    ``write`` starts a snapshot and returns; with several processes ``poll``, before each step, sends the
    packed copy to the peer ``EXCHANGE_AFTER`` steps after the snapshot, or 1 when they are less than 3
    apart (``every``; every process calls both at the same steps). ``wait`` finishes the snapshot in
    flight; ``skipped`` counts the snapshots not taken because one was still being written somewhere.

    >>> import tempfile
    >>> writer = SnapshotWriter(tempfile.mkdtemp())
    >>> writer.write(3, {"w": jax.numpy.arange(8.0)})
    True
    >>> writer.wait(); sorted(p.name for p in writer.folder.iterdir())
    ['step-3']
    >>> writer.close(remove=True)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 2,
        run: int | None = None,
        discard: Sequence[Path] = (),
        every: int = EXCHANGE_AFTER + 1,
    ):
        self.directory = Path(directory)
        self.keep = max(keep, 1)
        self.exchange_after = max(1, min(EXCHANGE_AFTER, every - 1))
        domain = os.environ.get(DOMAIN) or socket.gethostname()
        self.dest = peers([str(d) for d in gather_json(domain, site="snapshot.domains")])
        self.folder = snapshot_folder(self.directory, run, jax.process_index())
        self._discard = list(discard)  # folders of the run before, removed once this run has a snapshot
        self._newest = max(self._steps(), default=0)  # the newest kept snapshot's step
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nnx_shard-snapshot")
        self._job: concurrent.futures.Future[None] | None = None  # the background job in flight
        self._current: _Snapshot | None = None  # the snapshot being written
        self._maps = Mappings()  # the kept snapshots' files, mapped; each write reuses one
        self._staging = Staging()
        self._layouts = Layouts()
        self.skipped = 0
        self.last_bytes = (0, 0)  # the last snapshot's own file and the peer's copy received

    def prepare(self, states: Any) -> None:
        """Compiles, in the background, what a snapshot of ``states`` runs on the devices (GPUs, TPUs)."""
        if _accelerated(shards := self._layouts(states)[0]):
            self._staging.prepare(shards)

    def check_space(self, own_bytes: int) -> int:
        """Bytes the kept snapshots need here (own + peer, times ``keep``); a ConfigError on every process
        when any process's folder lacks them (the processes agree on every one's bytes and free space)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        rows = agree("snapshot.space", [own_bytes, shutil.disk_usage(self.directory).free])
        own, free = rows[:, 0], rows[:, 1]
        needs = [int((own[p] + own[self.dest.index(p)]) * self.keep) for p in range(len(own))]
        short = [
            f"process {p} needs {needs[p] / 2**20:.1f} MiB and has {free[p] / 2**20:.1f} MiB free"
            for p in range(len(own))
            if free[p] < needs[p]
        ]
        if short:
            raise ConfigError(
                f"snapshots need room in {self.directory} for own and a peer's shards, {self.keep} kept: "
                f"{', '.join(short)}; set config.snapshot_dir to a larger tmpfs, or snapshot_every=0."
            )
        return needs[jax.process_index()]

    @property
    def in_flight(self) -> int | None:
        """The step of the snapshot still being written here (None when none is)."""
        current = self._current
        if current is None or (current.exchanged and (self._job is None or self._job.done())):
            return None
        return current.step

    def write(self, step: int, states: Any, data_state: Any = None, *, skip_if_busy: bool = False) -> bool:
        """Starts the snapshot of ``step`` (every process calls it at the same step) and returns.

        The processes first agree, in one collective, on whether a snapshot is still being written on any
        of them and on the width of the rows their copies travel in. With ``skip_if_busy`` a snapshot still
        in flight on any process makes this one skipped (False, counted in ``skipped``) on every process;
        otherwise it is finished first.
        """
        with jax.profiler.TraceAnnotation("nnx_shard.snapshot.write", step=step):
            shards, pieces, size, key = self._layouts(states)
            header = Header(step, jax.process_index(), pieces, data_state)
            votes = agree(
                "snapshot.agree",
                [self.in_flight is not None, row_width(size + header.bound(self._layouts.widest))],
                step=step,
            )
            if skip_if_busy and votes[:, 0].any():
                self.skipped += 1
                logger.debug("snapshot of step %d skipped: the last one is still being written", step)
                return False
            self.wait()
            if step <= self._newest:  # a run that restored an older step: the branch it left goes, so that
                for newer in [s for s in self._steps() if s >= step]:  # a restart never resumes from it
                    shutil.rmtree(self.folder / f"step-{newer}", ignore_errors=True)
            self._newest = step
            snapshot = _Snapshot(
                step, self.folder / f".step-{step}.tmp", header, size, int(votes[:, 1].max())
            )
            snapshot.staged = self._staging.stage(shards, key) if _accelerated(shards) else None
            if snapshot.staged is None:  # CPU devices, or no room on the devices: copied before the next step
                self._reuse(snapshot.folder)
                snapshot.pages = self._maps.pages(snapshot.folder / "own.bin", size)
                copy_in(snapshot.pages, pieces, [s.data for s in shards])
            snapshot.exchanged = jax.process_count() == 1  # one process is its own peer
            self._current = snapshot
            self.last_bytes = (size, self.last_bytes[1] if jax.process_count() > 1 else size)
            self._job = self._pool.submit(self._seal, snapshot)
            return True

    def poll(self, step: int) -> None:
        """Before the step after ``step``, on every process: the snapshot in flight goes to the peer once
        ``exchange_after`` steps have passed since it, its packing waited for if still under way."""
        current = self._current
        if current is not None and not current.exchanged and step + 1 - current.step >= self.exchange_after:
            self._exchange(current)

    def wait(self) -> None:
        """Finishes the snapshot in flight (its peer copy included: every process calls it together)."""
        current = self._current
        if current is not None and not current.exchanged:
            self._exchange(current)
        self._join()
        if current is not None and current.error is not None:
            logger.warning("the snapshot of step %d could not be written: %s", current.step, current.error)
            current.error = None

    def close(self, *, remove: bool, failed: bool = False) -> None:
        """Waits for the last write; ``remove`` frees this process's snapshots (a finished run needs none).

        ``failed``: the ``train()`` call ends with an exception, which the other processes may not share, so
        no collective is issued: the snapshot in flight is not sent to its peer, and never published.
        """
        if failed:
            self._join()
        else:
            self.wait()
        self._pool.shutdown(wait=True)
        self._current = None
        self._maps.clear()
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _join(self) -> None:
        if self._job is not None:
            self._job.result()  # the jobs keep their errors in the snapshot
            self._job = None

    def _reuse(self, tmp: Path) -> None:
        """Makes ``tmp`` (``.step-N.tmp``) the folder a snapshot is written in: the oldest kept one's (its
        pages already allocated) renamed when ``keep`` are there, a leftover of a write that died, or new."""
        self.folder.mkdir(parents=True, exist_ok=True)
        leftovers = [p for p in self.folder.glob(".step-*.tmp") if p != tmp]
        steps = self._steps()
        oldest = [self.folder / f"step-{s}" for s in steps[: max(len(steps) - self.keep + 1, 0)]]
        reused = (leftovers + oldest)[:1]
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

    def _seal(self, snapshot: _Snapshot) -> None:
        """In the background: the devices' copies to the file (GPUs, TPUs), each piece's share, the header,
        the copy for the peer; with one process, the snapshot is then complete."""
        with jax.profiler.TraceAnnotation("nnx_shard.snapshot.seal", step=snapshot.step):
            try:
                own = snapshot.folder / "own.bin"
                if snapshot.pages is None:
                    self._reuse(snapshot.folder)
                    snapshot.pages = self._maps.pages(own, snapshot.size)
                buf, pieces = snapshot.pages, snapshot.header.pieces
                if snapshot.staged is not None:
                    snapshot.staged.write_into(buf, pieces)
                    for p, share in zip(pieces, snapshot.staged.share_values(), strict=True):
                        p.share = share
                    snapshot.staged = None
                else:
                    sum_shares(buf, pieces)
                header = snapshot.header.to_bytes()
                buf[:HEADER] = np.frombuffer(snapshot.size.to_bytes(HEADER, "little"), np.uint8)
                with open(own, "r+b") as f:
                    f.seek(snapshot.size)
                    f.write(header)
                    f.truncate(snapshot.size + len(header))
                snapshot.pages = None  # the mapping stays in self._maps for the next write
                if not snapshot.exchanged:
                    row = outgoing([buf, np.frombuffer(header, np.uint8)], snapshot.width)
                    if row is None:
                        raise ValueError(
                            f"the copy for the peer is wider than the {snapshot.width} bytes agreed"
                        )
                    snapshot.parts = place(row)
                else:
                    self._publish(snapshot, None)
                logger.debug("snapshot of step %d packed", snapshot.step)
            except (OSError, ValueError, jax.errors.JaxRuntimeError) as e:  # a full disk; no host memory
                snapshot.error = str(e)

    def _exchange(self, snapshot: _Snapshot) -> None:
        """Sends the packed own file to the peer (a collective, on the main thread; an empty row when the
        snapshot failed here) and writes what came here in the background."""
        with jax.profiler.TraceAnnotation("nnx_shard.snapshot.exchange", step=snapshot.step):
            self._join()  # the own file is packed and placed
            ok = snapshot.error is None and snapshot.parts is not None
            parts = snapshot.parts if ok else place(empty(snapshot.width))
            snapshot.parts = None
            sent = exchange(parts, self.dest, snapshot.step)
            snapshot.exchanged = True
            self._job = self._pool.submit(self._receive, snapshot, sent)

    def _receive(self, snapshot: _Snapshot, sent: Any) -> None:
        with jax.profiler.TraceAnnotation("nnx_shard.snapshot.receive", step=snapshot.step):
            try:
                peer = received(sent)
                self.last_bytes = (self.last_bytes[0], int(peer.size))
                if not peer.size:
                    raise ValueError("the peer sent none (its own snapshot failed)")
                if snapshot.error is None:
                    self._publish(snapshot, peer)
            except (OSError, ValueError) as e:
                snapshot.error = f"the peer's copy: {e}"

    def _publish(self, snapshot: _Snapshot, peer: np.ndarray | None) -> None:
        """Writes the peer's copy (when another process's), renames the folder ``step-N``, drops older
        ones."""
        tmp, final = snapshot.folder, self.folder / f"step-{snapshot.step}"
        stale = set(tmp.glob("peer-*.bin"))
        if peer is not None:
            source = Header.from_bytes(bytes(peer[int.from_bytes(bytes(peer[:HEADER]), "little") :])).process
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
        logger.debug("snapshot of step %d complete in %s", snapshot.step, final)

    def _premap(self, size: int, steps: Sequence[int]) -> None:
        """Maps the oldest kept snapshot's file, which the next write reuses, without changing it, and
        unmaps the files no longer kept."""
        folders = [self.folder / f"step-{s}" for s in steps]
        own = folders[0] / "own.bin" if len(steps) >= self.keep else None
        if own is not None and own.exists() and own.stat().st_size >= size:
            self._maps.pages(own, size, resize=False)
        self._maps.keep([f for folder in folders for f in folder.glob("*.bin")])
