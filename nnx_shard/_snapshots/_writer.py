"""In-memory snapshots: each process's own shards in a file in host memory (``/dev/shm``), and a copy of
one peer's on another failure domain (the host name, or ``NNX_SHARD_FAILURE_DOMAIN``), sent through JAX.
The step copies the shards (CPU) or has each device copy its own (``_device``); the rest runs in a thread.
Each snapshot starts with one agreement of every process, and goes to the peer a fixed number of steps later
(from the writer's thread on CPU devices, which run a collective with ready inputs on the calling thread)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import mmap
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
from nnx_shard._snapshots._file import HEADER, Header, Layouts, copy_in, sum_shares
from nnx_shard._snapshots._peer import exchange, outgoing, peers, place, received, row_width
from nnx_shard.errors import ConfigError

logger = logging.getLogger("nnx_shard")
DOMAIN = "NNX_SHARD_FAILURE_DOMAIN"
EXCHANGE_AFTER = 2  # steps from a snapshot to its copy's exchange (one step runs beside its packing)
_SENT: set[tuple[int, tuple[int, ...]]] = set()  # (width, peers) of copies sent: compiled, communicator made


def default_snapshot_dir(job: str) -> Path:
    """``/dev/shm/nnx_shard-<job>`` where ``/dev/shm`` exists (host memory), else under the temp dir."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"nnx_shard-{job}"


def snapshot_folder(directory: Path, run: int | None, process: int) -> Path:
    """A process's folder: ``process-<id>``, under ``run-<restart>`` in a launched job (restarts renumber)."""
    return (directory if run is None else directory / f"run-{run}") / f"process-{process}"


@dataclasses.dataclass
class _Snapshot:
    """One snapshot being written."""

    step: int
    folder: Path  # .step-N.tmp until it is complete
    header: Header
    size: int  # where the header starts in its own file
    width: int  # of the rows every process sends its peer, agreed
    staged: Staged | None = None  # the devices' own copies (GPUs, TPUs)
    pages: np.ndarray | None = None  # its own file, mapped, when the step copied into it
    parts: list[Any] | None = None  # the copy for the peer, once packed and placed
    exchanged: bool = False
    error: str | None = None


class SnapshotWriter:
    """Writes each snapshot (own + one peer's shards) to this process's folder; keeps the newest ``keep``.
    ``poll``, before each step, starts the copy to the peer ``EXCHANGE_AFTER`` steps after its snapshot (1
    when snapshots are closer, ``every``); ``skipped`` counts the snapshots not taken while one was busy.

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
        self.directory, self.keep = Path(directory), max(keep, 1)
        self.exchange_after = max(1, min(EXCHANGE_AFTER, every - 1))
        domain = os.environ.get(DOMAIN) or socket.gethostname()
        self.dest = peers([str(d) for d in gather_json(domain, site="snapshot.domains")])
        self.folder = snapshot_folder(self.directory, run, jax.process_index())
        self._discard = list(discard)  # folders of the run before, removed once this run has a snapshot
        self._newest = max(self._steps(), default=0)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nnx_shard-snapshot")
        self._send_on_thread = jax.local_devices()[0].platform == "cpu"
        self._job: concurrent.futures.Future[None] | None = None  # the background job in flight
        self._current: _Snapshot | None = None
        self._maps: dict[int, np.ndarray] = {}  # the kept files' mappings, by inode
        self._staging, self._layouts = Staging(), Layouts()
        self.skipped, self.last_bytes = 0, (0, 0)  # the last snapshot's own file and the peer's copy received

    def check_space(self, own_bytes: int) -> int:
        """Bytes the kept snapshots need here (own + peer, times ``keep``); a ConfigError on every process
        when any process's folder lacks them (agreed)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        rows = agree("snapshot.space", [own_bytes, shutil.disk_usage(self.directory).free])
        needs = [int((rows[p, 0] + rows[self.dest.index(p), 0]) * self.keep) for p in range(len(rows))]
        short = [
            f"process {p} needs {n / 2**20:.1f} MiB and has {rows[p, 1] / 2**20:.1f} MiB free"
            for p, n in enumerate(needs)
            if rows[p, 1] < n
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
        now = self._current
        done = now is None or (now.exchanged and (self._job is None or self._job.done()))
        return None if done else now.step

    def write(self, step: int, states: Any, data_state: Any = None, *, skip_if_busy: bool = False) -> bool:
        """Starts the snapshot of ``step`` (every process at the same step): with ``skip_if_busy`` a snapshot
        still in flight on any process skips it on every one (False); otherwise that one is finished first."""
        with jax.profiler.TraceAnnotation("nnx_shard.snapshot.write", step=step):
            shards, pieces, size = self._layouts(states)
            header = Header(step, jax.process_index(), pieces, data_state)
            width = row_width(size + header.bound(self._layouts.widest))
            votes = agree("snapshot.agree", [self.in_flight is not None, width], step=step)
            if skip_if_busy and votes[:, 0].any():
                self.skipped += 1
                logger.debug("snapshot of step %d skipped: the last one is still being written", step)
                return False
            self.wait()
            if step <= self._newest:  # a run that restored an older step: the branch it left goes, so that
                for newer in [s for s in self._steps() if s >= step]:  # a restart never resumes from it
                    shutil.rmtree(self.folder / f"step-{newer}", ignore_errors=True)
            self._newest = step
            tmp = self.folder / f".step-{step}.tmp"
            snapshot = _Snapshot(step, tmp, header, size, int(votes[:, 1].max()))
            snapshot.staged = self._staging.stage(shards, self._layouts.key)
            if snapshot.staged is None:  # CPU devices, or no room on the devices: copied before the next step
                snapshot.pages = self._open(snapshot.folder, size)
                copy_in(snapshot.pages, pieces, [s.data for s in shards])
            snapshot.exchanged = jax.process_count() == 1  # one process is its own peer
            self._current = snapshot
            self.last_bytes = (size, self.last_bytes[1] if jax.process_count() > 1 else size)
            self._job = self._pool.submit(self._seal, snapshot)
            return True

    def poll(self, step: int) -> None:
        """Before the step after ``step``: starts the copy to the peer ``exchange_after`` steps after it."""
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
        ``failed`` (an exception the others may not share): no collective started, nothing more published."""
        self._join(failed=True) if failed else self.wait()
        self._pool.shutdown(wait=True)
        self._current, self._maps = None, {}
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _join(self, *, failed: bool = False) -> None:
        job, self._job = self._job, None  # the jobs keep their errors in the snapshot, but a collective's
        if job is not None and (error := job.exception()) is not None:
            if not failed:  # after a failure, logged: not raised over the error that ended the run
                raise error
            logger.warning("the snapshot's copy to the peer failed too: %s", error)

    def _open(self, tmp: Path, size: int) -> np.ndarray:
        """Makes the folder ``tmp`` (the oldest kept one when ``keep`` are there, its pages allocated, or new)
        and maps its own file ``size`` bytes long, the mapping kept for the next write into the file."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for leftover in self.folder.glob(".step-*.tmp"):  # of a write that died, or of a failed call
            shutil.rmtree(leftover, ignore_errors=True)
        steps = self._steps()
        (self.folder / f"step-{steps[0]}").rename(tmp) if len(steps) >= self.keep else tmp.mkdir()
        for path in tmp.glob("peer-*.bin"):
            path.unlink()
        live = {p.stat().st_ino for p in self.folder.glob("*step-*/own.bin")}  # inodes are reused
        self._maps = {inode: pages for inode, pages in self._maps.items() if inode in live}
        (own := tmp / "own.bin").touch()
        if (inode := own.stat().st_ino) not in self._maps or self._maps[inode].size != size:
            with open(own, "r+b") as f:  # mapped with its page tables filled: about a copy's cost
                f.truncate(size)
                pages = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self._maps[inode] = np.frombuffer(pages, np.uint8)  # unmapped with the array
        return self._maps[inode]

    def _steps(self) -> list[int]:
        """The steps of the snapshots kept here, oldest first."""
        return sorted(int(p.name.split("-")[1]) for p in self.folder.glob("step-*"))

    def _seal(self, snapshot: _Snapshot) -> None:
        """In the background: copies into the file, shares, header, the copy for the peer (or published)."""
        with jax.profiler.TraceAnnotation("nnx_shard.snapshot.seal", step=snapshot.step):
            try:
                own, pieces = snapshot.folder / "own.bin", snapshot.header.pieces
                if snapshot.staged is not None:
                    buf = self._open(snapshot.folder, snapshot.size)
                    snapshot.staged.write_into(buf, pieces)
                    snapshot.staged = None  # its chunks are freed
                else:
                    buf = snapshot.pages
                    sum_shares(buf, pieces)
                header = snapshot.header.to_bytes()
                buf[:HEADER] = np.frombuffer(snapshot.size.to_bytes(HEADER, "little"), np.uint8)
                with open(own, "r+b") as f:
                    f.seek(snapshot.size)
                    f.write(header)
                    f.truncate(snapshot.size + len(header))
                if jax.process_count() > 1:
                    snapshot.parts = place(outgoing([buf, np.frombuffer(header, np.uint8)], snapshot.width))
                else:
                    self._publish(snapshot, None)
                logger.debug("snapshot of step %d packed", snapshot.step)
            except (OSError, ValueError, jax.errors.JaxRuntimeError) as e:  # a full disk; no host memory
                snapshot.error = str(e)

    def _exchange(self, snapshot: _Snapshot) -> None:
        """Sends the own file to the peer (from the writer's thread on CPU devices), then writes what came."""
        snapshot.exchanged, sealed, kind = True, self._job, (snapshot.width, tuple(self.dest))
        thread = self._send_on_thread and kind in _SENT  # a first copy compiles: its step waits for it
        if not thread:
            self._join()  # the own file is packed and placed
        sent = None if thread else self._send(snapshot)
        _SENT.add(kind)
        self._job = self._pool.submit(self._receive, snapshot, sent, sealed)

    def _send(self, snapshot: _Snapshot) -> list[Any]:
        """The copy's collectives (an empty row if the snapshot failed here): what came, not waited for."""
        with jax.profiler.TraceAnnotation("nnx_shard.snapshot.exchange", step=snapshot.step):
            ok = snapshot.error is None and snapshot.parts is not None
            parts, snapshot.parts = snapshot.parts if ok else place(outgoing([], snapshot.width)), None
            return exchange(parts, self.dest, snapshot.step)

    def _receive(self, snapshot: _Snapshot, sent: Any, sealed: Any) -> None:
        sent = self._send(snapshot) if sent is None else sent  # from the writer's thread, after the packing
        if sealed is not None and (error := sealed.exception()) is not None:  # an error of ours, once sent
            raise error
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
        """Writes the peer's copy (another process's), renames the folder ``step-N``, drops older ones."""
        tmp, final = snapshot.folder, self.folder / f"step-{snapshot.step}"
        if peer is not None:
            source = Header.from_bytes(bytes(peer[int.from_bytes(bytes(peer[:HEADER]), "little") :])).process
            if source != jax.process_index():
                peer.tofile(tmp / f"peer-{source}.bin")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # complete, or not there
        # older ones, and a restart's discarded: the snapshots of the run before are superseded
        for old in [*(self.folder / f"step-{s}" for s in self._steps()[: -self.keep]), *self._discard]:
            shutil.rmtree(old, ignore_errors=True)
        self._discard = []
        logger.debug("snapshot of step %d complete in %s", snapshot.step, final)
