"""One writer per workdir: a lock file with a heartbeat, and folders for the steps a run sets aside."""

from __future__ import annotations

import atexit
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


class WorkdirLock:
    """A lock file ``workdir/nnx_shard.lock`` naming its holder (host, pid, start time), kept fresh by a
    heartbeat.

    A lock whose holder is gone is taken over with a warning: on this host
    when its pid no longer runs, on any host when its heartbeat is older than
    ``stale_after`` seconds. The file is created atomically (a hard link of a
    complete file), so two jobs starting together cannot both win.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> first = WorkdirLock(d).acquire()
    >>> WorkdirLock(d).acquire()
    Traceback (most recent call last):
    ...
    nnx_shard.errors.WorkdirLockedError: workdir ... is in use by another job: host ..., pid ..., started ...
    >>> first.release(); WorkdirLock(d).acquire().release()
    """

    def __init__(self, workdir: str | Path, *, stale_after: float = 300.0):
        self.path = Path(workdir) / LOCK_FILE
        self.stale_after = float(stale_after)
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _holder(self) -> dict[str, Any] | None:
        try:
            info = json.loads(self.path.read_text())
            info["age"] = time.time() - self.path.stat().st_mtime
            return info if isinstance(info, dict) else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # unreadable or half-written: judged by its age alone
            try:
                return {"age": time.time() - self.path.stat().st_mtime}
            except FileNotFoundError:
                return None

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "token": self.token,
        }
        for _ in range(3):
            tmp = self.path.with_name(f"{LOCK_FILE}.{self.token}")
            tmp.write_text(json.dumps(info))
            try:
                os.link(tmp, self.path)
                break
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue
                why = self._gone(holder)
                if why is None:
                    raise WorkdirLockedError(
                        f"workdir {self.path.parent} is in use by another job: host "
                        f"{holder.get('host', '?')}, "
                        f"pid {holder.get('pid', '?')}, started {holder.get('started', '?')} (lock file "
                        f"{self.path}, heartbeat {holder['age']:.0f} s ago). Wait for it to end, use another "
                        f"workdir, or delete the lock file if that job is certainly gone."
                    ) from None
                warnings.warn(
                    f"taking over the lock of workdir {self.path.parent} from host "
                    f"{holder.get('host', '?')}, "
                    f"pid {holder.get('pid', '?')} (started {holder.get('started', '?')}): {why}",
                    CheckpointWarning,
                    stacklevel=3,
                )
                self.path.unlink(missing_ok=True)
            finally:
                tmp.unlink(missing_ok=True)
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
                os.utime(self.path)
            except OSError:  # taken over or removed: the next acquire says so
                return

    def release(self) -> None:
        """Gives the lock back (idempotent); a lock taken over by another job is left to it."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = self._holder()
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        self.held = False
        atexit.unregister(self.release)

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def set_aside_folder(directory: Any, kind: str) -> Any:
    """Where steps moved out of ``directory`` go: ``<directory>.set_aside/<kind>-<UTC time>``, never read by
    restores."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    return directory.parent / f"{directory.name}.set_aside" / f"{kind}-{stamp}"
