"""Where the package writes: a local folder or an object store's URI (``gs://bucket/run``), behind one small
interface over ``etils.epath`` (what Orbax uses) and fsspec.

A local path behaves as a file system does (atomic renames, hard links). An
object store has neither: a whole object is written at once, a conditional
write (GCS's ``ifGenerationMatch``) replaces only the version one read, and a
folder is moved by copying its objects and deleting them. Every path the
package writes in a workdir or checkpoint directory goes through here.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

from etils import epath

from nnx_shard.errors import StorageError

SERVED = ("gs", "s3", "az", "hf")  # the URI schemes etils.epath serves (through fsspec or TensorFlow)
# A finished step's markers: Orbax lists a step on GCS once commit_success.txt is there, on a disk once
# _CHECKPOINT_METADATA is; a move copies them last and deletes them first.
MARKERS = ("commit_success.txt", "_CHECKPOINT_METADATA")


def is_uri(where: Any) -> bool:
    """True for ``scheme://...`` (an object store), False for a local path.

    >>> is_uri("gs://bkt/run"), is_uri("/tmp/run")
    (True, False)
    """
    return "://" in os.fspath(where) if isinstance(where, (str, os.PathLike)) else False


def scheme(where: Any) -> str | None:
    return os.fspath(where).split("://", 1)[0] if is_uri(where) else None


def location(where: str | os.PathLike) -> epath.Path:
    """``where`` as an ``epath.Path``: a local path made absolute, or a URI whose scheme is served here.

    Raises:
      StorageError: a scheme etils and fsspec cannot serve, or whose client
        is not installed (``gcsfs`` for ``gs://``), naming what to install.
        Nothing is written: a URI is never taken for a local folder.

    >>> location("ftpx://bkt/run")
    Traceback (most recent call last):
    ...
    nnx_shard.errors.StorageError: cannot use ftpx://bkt/run: ...
    """
    text = os.fspath(where)
    name = scheme(text)
    if name is None:
        return epath.Path(os.path.abspath(text))
    if name not in SERVED:
        raise StorageError(
            f"cannot use {text}: the scheme {name}:// is not one etils.epath serves (expected a local path "
            f"or one of {', '.join(s + '://' for s in SERVED)}). Use a local folder or a gs:// bucket."
        )
    import fsspec

    try:
        fsspec.get_filesystem_class(name)
    except (ImportError, ValueError) as e:
        raise StorageError(
            f"cannot use {text}: no client for {name}:// is installed ({e}). Install it (for gs://: "
            f"pip install 'nnx-shard[gcs]', which brings gcsfs) and start again; nothing was written."
        ) from e
    return epath.Path(text)


def filesystem(path: Any) -> Any:
    """The fsspec file system that serves URI ``path``: the same instance etils.epath reads through, so a
    listing either caches is refreshed by the other's writes."""
    from etils.epath import backend

    return backend.fsspec_backend.fs(os.fspath(path))


def key(path: Any) -> str:
    """``gs://bkt/a/b`` -> ``bkt/a/b``: the name fsspec gives the object."""
    return os.fspath(path).split("://", 1)[1]


def refresh(path: Any) -> None:
    """Forgets what fsspec has cached of ``path``'s listings, so that another process's writes are seen."""
    if is_uri(path):
        filesystem(path).invalidate_cache()


def check_bucket(path: epath.Path) -> None:
    """Raises :class:`StorageError` when the bucket (or container) of URI ``path`` does not exist, or
    cannot be reached, before anything is written there."""
    if not is_uri(path):
        return
    bucket = key(path).split("/", 1)[0]
    fs = filesystem(path)
    try:
        fs.invalidate_cache()
        fs.info(bucket)
    except FileNotFoundError as e:
        raise StorageError(
            f"cannot use {path}: the bucket {scheme(path)}://{bucket} does not exist (or these credentials "
            f"cannot see it). Create it, or fix the URI; nothing was written."
        ) from e
    except OSError as e:
        raise StorageError(
            f"cannot use {path}: the bucket {scheme(path)}://{bucket} could not be reached ({e}). Check the "
            f"network and credentials; nothing was written."
        ) from e


def write_bytes(path: epath.Path, data: bytes) -> None:
    """Writes a whole file at once: locally a temporary file renamed over ``path`` (a crash leaves the old
    or the new one), on an object store one object (objects are never seen half-written)."""
    if is_uri(path):
        filesystem(path).pipe_file(key(path), data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.fspath(path.parent), prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.fspath(path))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def list_files(folder: epath.Path) -> dict[str, int]:
    """Every file under ``folder``: its ``/``-joined name below it -> its size. In a bucket one listing."""
    if is_uri(folder):
        fs, base = filesystem(folder), key(folder).rstrip("/")
        fs.invalidate_cache()
        return {name[len(base) + 1 :]: int(info["size"]) for name, info in fs.find(base, detail=True).items()}
    root = os.fspath(folder)
    out = {}
    for where, _, files in os.walk(root):
        for f in files:
            full = os.path.join(where, f)
            out[os.path.relpath(full, root).replace(os.sep, "/")] = os.path.getsize(full)
    return out


def read_many(folder: epath.Path, names: Iterable[str]) -> dict[str, bytes | None]:
    """The bytes of each file ``folder/name`` (None for one that is missing); in a bucket fetched
    concurrently, in one call."""
    names = list(names)
    if not is_uri(folder):
        out: dict[str, bytes | None] = {}
        for name in names:
            try:
                out[name] = (folder / name).read_bytes()
            except FileNotFoundError:
                out[name] = None
        return out
    fs, base = filesystem(folder), key(folder).rstrip("/")
    got = fs.cat([f"{base}/{n}" for n in names], on_error="return")
    out = {}
    for name in names:
        value = got.get(f"{base}/{name}")
        if isinstance(value, FileNotFoundError) or value is None:
            out[name] = None
        elif isinstance(value, BaseException):
            raise value
        else:
            out[name] = bytes(value)
    return out


@contextlib.contextmanager
def staged_folder(where: str | os.PathLike) -> Iterator[str]:
    """A local folder to write ``where``'s files into: ``where`` itself when local; for a URI a temporary
    folder whose files are uploaded there when the block ends without an error, then removed.

    For writers that need a local path (safetensors, a PNG). What this process wrote is what it uploads.
    """
    target = location(where)
    if not is_uri(target):
        yield os.fspath(target)
        return
    check_bucket(target)
    local = tempfile.mkdtemp(prefix="nnx_shard-upload-")
    try:
        yield local
        fs = filesystem(target)
        for name in sorted(list_files(epath.Path(local))):
            fs.put_file(os.path.join(local, name), f"{key(target).rstrip('/')}/{name}")
        fs.invalidate_cache()
    finally:
        shutil.rmtree(local, ignore_errors=True)


@contextlib.contextmanager
def fetched_folder(where: str | os.PathLike) -> Iterator[str]:
    """A local copy of folder (or file) ``where`` for readers that need a local path (safetensors maps its
    files): ``where`` itself when local; for a URI its objects downloaded into a temporary folder, removed
    when the block ends."""
    source = location(where)
    if not is_uri(source):
        yield os.fspath(where)
        return
    check_bucket(source)
    fs, base = filesystem(source), key(source).rstrip("/")
    fs.invalidate_cache()
    local = tempfile.mkdtemp(prefix="nnx_shard-download-")
    try:
        if fs.isfile(base):
            fs.get_file(base, os.path.join(local, source.name))
            yield os.path.join(local, source.name)
        else:
            names = list_files(source)
            if not names:
                raise StorageError(f"{where} holds nothing to read (no objects under it).")
            for name in names:
                os.makedirs(os.path.dirname(os.path.join(local, name)), exist_ok=True)
                fs.get_file(f"{base}/{name}", os.path.join(local, name))
            yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def uri_of(local_file: str, local_root: str, where: str | os.PathLike) -> str:
    """The name a file staged under ``local_root`` has once uploaded to ``where``."""
    return os.fspath(where).rstrip("/") + "/" + os.path.relpath(local_file, local_root).replace(os.sep, "/")


# -- objects with versions: what a lock on object storage stands on ------------------------------


def _conditional(path: Any) -> tuple[Any, str, str]:
    if scheme(path) != "gs":
        raise StorageError(
            f"{path}: a conditional write (what the workdir lock needs) is made on gs:// only; "
            f"{scheme(path)}:// is not supported. Use a local workdir or a gs:// bucket."
        )
    bucket, _, name = key(path).partition("/")
    return filesystem(path), bucket, name


def put_if(path: Any, data: bytes, generation: str) -> str:
    """Writes object ``path`` only if its generation is ``generation`` (``"0"``: only if absent); returns the
    new generation.

    Raises:
      FileExistsError: another writer got there first (GCS's 412).
    """
    fs, bucket, name = _conditional(path)
    meta = json.dumps({"name": name})
    body = (
        f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
        f"--==0==\nContent-Type: application/octet-stream\n\n"
    ).encode() + data
    out = fs.call(
        "POST",
        f"{fs._location}/upload/storage/v1/b/{bucket}/o",
        uploadType="multipart",
        ifGenerationMatch=str(generation),
        headers={"Content-Type": 'multipart/related; boundary="==0=="'},
        data=body + b"\n--==0==--",
        json_out=True,
    )
    fs.invalidate_cache(key(path))
    return str(out["generation"])


def read_versioned(path: Any) -> tuple[bytes, str, float] | None:
    """``(data, generation, age in seconds)`` of object ``path``, or None when it does not exist."""
    fs, bucket, name = _conditional(path)
    try:
        info = fs.call("GET", "b/{}/o/{}", bucket, name, json_out=True)
        data = fs.call("GET", "b/{}/o/{}", bucket, name, alt="media", generation=info["generation"])[1]
    except FileNotFoundError:
        return None
    updated = datetime.datetime.fromisoformat(info["updated"].replace("Z", "+00:00"))
    age = (datetime.datetime.now(datetime.UTC) - updated).total_seconds()
    return bytes(data), str(info["generation"]), age


def delete_if(path: Any, generation: str) -> None:
    """Deletes object ``path`` if it is still at ``generation`` (gone already: nothing to do)."""
    fs, bucket, name = _conditional(path)
    try:
        fs.call("DELETE", "b/{}/o/{}", bucket, name, ifGenerationMatch=str(generation))
    except (FileNotFoundError, FileExistsError):  # gone, or replaced by another writer: theirs now
        pass
    fs.invalidate_cache(key(path))


# -- folders ---------------------------------------------------------------------------------------


def move_tree(source: epath.Path, target: epath.Path) -> None:
    """Moves folder ``source`` to ``target`` (which must not exist).

    Locally a rename. On an object store every object is copied, the
    markers last (so the copy counts as a finished step only once whole),
    then the source's markers are deleted first (so it stops counting as one
    at once) and the rest after. A crash at any point leaves the folder
    whole in one place or the other; a source left without its markers is an
    unfinished save, which the next opening removes.
    """
    if not is_uri(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        return
    fs = filesystem(source)
    src, dst = key(source).rstrip("/"), key(target).rstrip("/")
    sizes = list_files(source)
    if not sizes:
        raise FileNotFoundError(f"{source} holds no objects to move")
    names = sorted(sizes)
    for name in _markers_last(names):
        fs.cp_file(f"{src}/{name}", f"{dst}/{name}")
    copied = list_files(target)
    if copied != sizes:
        raise OSError(f"the copy of {source} in {target} is not whole: {sorted(set(sizes) ^ set(copied))}")
    fs.rm([f"{src}/{n}" for n in names if n in MARKERS])
    fs.rm([f"{src}/{n}" for n in names if n not in MARKERS])
    fs.invalidate_cache()


def _markers_last(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda n: (n in MARKERS, n.rsplit("/", 1)[-1] in MARKERS, n))
