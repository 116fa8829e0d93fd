"""One writer per workdir: a lock file with a heartbeat, and folders for the steps a run sets aside."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from etils import epath

from nnx_shard._base import storage
from nnx_shard.errors import CheckpointWarning, WorkdirLockedError

logger = logging.getLogger("nnx_shard")
LOCK_FILE = "nnx_shard.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class _LocalFile:
    """The lock as a local file: created by a hard link of a complete file, kept fresh by its mtime."""

    def __init__(self, path: epath.Path):
        self.path = Path(os.fspath(path))

    def create(self, data: bytes, token: str) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{LOCK_FILE}.{token}")
        tmp.write_bytes(data)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def read(self) -> tuple[bytes, Any, float] | None:
        try:
            st = self.path.stat()
            return self.path.read_bytes(), (st.st_ino, st.st_mtime_ns), time.time() - st.st_mtime
        except FileNotFoundError:
            return None

    def take_over(self, version: Any, data: bytes, token: str) -> bool:
        """Moves the stale lock aside (a rename: one taker gets it), then creates ours. A lock that is not
        the one read (another taker's, or a holder's heartbeat since) is put back and left to its holder."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale.{token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # another taker moved it first
            return False
        try:
            st = aside.stat()
            if (st.st_ino, st.st_mtime_ns) != version:
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
                return False
        finally:
            aside.unlink(missing_ok=True)
        return self.create(data, token)

    def beat(self) -> bool:
        try:
            os.utime(self.path)
            return True
        except OSError:  # taken over or removed
            return False

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class _Object:
    """The lock as an object in a bucket: created only if absent (GCS ``ifGenerationMatch=0``), kept fresh and
    taken over by a write conditional on the generation read, so two jobs can never both hold it."""

    def __init__(self, path: epath.Path):
        self.path = path
        self.generation: str | None = None  # of what this job wrote
        self.data = b""

    def create(self, data: bytes, token: str) -> bool:
        return self._put(data, "0")

    def read(self) -> tuple[bytes, Any, float] | None:
        return storage.read_versioned(self.path)

    def take_over(self, version: Any, data: bytes, token: str) -> bool:
        return self._put(data, version)

    def _put(self, data: bytes, generation: str) -> bool:
        try:
            self.generation, self.data = storage.put_if(self.path, data, generation), data
            return True
        except FileExistsError:  # another job wrote it first
            return False

    def beat(self) -> bool:
        return self.generation is not None and self._put(self.data, self.generation)

    def remove(self) -> None:
        if self.generation is not None:
            storage.delete_if(self.path, self.generation)


class WorkdirLock:
    """A lock ``workdir/nnx_shard.lock`` naming its holder (host, pid, start time), kept fresh by a heartbeat,
    in a local folder or a bucket (``gs://``).

    A lock whose holder is gone is taken over with a warning: on this host
    when its pid no longer runs, on any host when its heartbeat is older than
    ``stale_after`` seconds. The lock is created atomically (locally a hard
    link of a complete file; in a bucket an object written only if absent),
    and a stale one is taken over by a write that succeeds only if nobody
    changed it since it was read, so two jobs starting together cannot both
    win, on one host or two.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> first = WorkdirLock(d).acquire()
    >>> WorkdirLock(d).acquire()
    Traceback (most recent call last):
    ...
    nnx_shard.errors.WorkdirLockedError: workdir ... is in use by another job: host ..., pid ..., started ...
    >>> first.release(); WorkdirLock(d).acquire().release()
    """

    def __init__(self, workdir: str | os.PathLike, *, stale_after: float = 300.0):
        self.workdir = storage.location(workdir)
        self.path = self.workdir / LOCK_FILE
        self._file = _Object(self.path) if storage.is_uri(self.path) else _LocalFile(self.path)
        self.stale_after = float(stale_after)
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _holder(self) -> tuple[dict[str, Any], Any] | None:
        found = self._file.read()
        if found is None:
            return None
        data, version, age = found
        try:
            info = json.loads(data)
        except ValueError:  # half-written: judged by its age alone
            info = {}
        return {**(info if isinstance(info, dict) else {}), "age": age}, version

    def _gone(self, holder: dict[str, Any]) -> str | None:
        """Why the holder is gone (None while it is alive)."""
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            if not _pid_alive(holder["pid"]):
                return f"its process {holder['pid']} no longer runs"
            return None
        if holder["age"] > self.stale_after:
            return f"its heartbeat is {holder['age']:.0f} s old (stale after {self.stale_after:.0f} s)"
        return None

    def acquire(self) -> WorkdirLock:
        """Takes the lock, or raises :class:`WorkdirLockedError` naming the live holder."""
        storage.check_bucket(self.workdir)
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "token": self.token,
        }
        data = json.dumps(info).encode()
        for _ in range(3):
            if self._file.create(data, self.token):
                break
            found = self._holder()
            if found is None:
                continue
            holder, version = found
            why = self._gone(holder)
            if why is None:
                raise WorkdirLockedError(
                    f"workdir {self.workdir} is in use by another job: host {holder.get('host', '?')}, "
                    f"pid {holder.get('pid', '?')}, started {holder.get('started', '?')} (lock file "
                    f"{self.path}, heartbeat {holder['age']:.0f} s ago). Wait for it to end, use another "
                    f"workdir, or delete the lock file if that job is certainly gone."
                ) from None
            if self._file.take_over(version, data, self.token):
                warnings.warn(
                    f"taking over the lock of workdir {self.workdir} from host {holder.get('host', '?')}, "
                    f"pid {holder.get('pid', '?')} (started {holder.get('started', '?')}): {why}",
                    CheckpointWarning,
                    stacklevel=3,
                )
                break
        else:
            raise WorkdirLockedError(f"could not take the lock {self.path}: it kept changing hands.")
        self.held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="nnx_shard-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)
        return self

    def _beat(self) -> None:
        while not self._stop.wait(max(0.05, self.stale_after / 4)):
            try:
                if not self._file.beat():
                    logger.warning("lock %s was taken over by another job; its heartbeat stops", self.path)
                    return
            except OSError as e:  # a storage hiccup: the next beat tries again
                logger.warning("the heartbeat of lock %s failed (%s); trying again", self.path, e)

    def release(self) -> None:
        """Gives the lock back (idempotent); a lock taken over by another job is left to it."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        found = self._holder()
        if found is not None and found[0].get("token") == self.token:
            self._file.remove()
        self.held = False
        atexit.unregister(self.release)

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def set_aside_folder(directory: Any, kind: str) -> Any:
    """Where steps moved out of ``directory`` go, never read by restores: ``<dir>.set_aside/<kind>-<UTC>``."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    return directory.parent / f"{directory.name}.set_aside" / f"{kind}-{stamp}"
