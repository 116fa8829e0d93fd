"""A checkpoint directory's files: leftovers of interrupted saves, finished steps, steps moved aside, and the
errors naming them."""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import jax

from nnx_shard._base import itemsize, storage
from nnx_shard._checkpoint._faults import describe, named, os_error, os_reason
from nnx_shard._checkpoint._manifest import unreadable_json
from nnx_shard.errors import CheckpointCorruptError, CheckpointError, CheckpointSaveError

logger = logging.getLogger("nnx_shard")
TMP_MARK = (
    ".orbax-checkpoint-tmp"  # Orbax writes a step under <step>.orbax-checkpoint-tmp-<n>, then renames it
)
# Host bytes a read holds per byte in flight (see read_limit).
READ_AMPLIFICATION = 5


WORKDIR_FOLDER = "checkpoints"  # where a Trainer keeps its checkpoints inside its workdir


def _has_steps(path: Any) -> bool:
    try:
        return any(p.name.isdigit() and p.is_dir() for p in path.iterdir())
    except OSError:
        return False


def checkpoint_directory(directory: Any) -> Any:
    """``directory``, or its ``checkpoints/`` folder when ``directory`` is a Trainer's workdir (a
    ``checkpoints/`` inside and no checkpoint step of its own)."""
    inner = directory / WORKDIR_FOLDER
    if directory.is_dir() and inner.is_dir() and not _has_steps(directory):
        return inner
    return directory


def checkpoints_below(directory: Any, depth: int = 3) -> list[str]:
    """Folders under ``directory`` (``depth`` levels at most) that hold checkpoint steps: for an error that
    was given the wrong level."""
    found, level = [], [directory]
    for _ in range(depth):
        level = [c for p in level if p.is_dir() for c in _children(p)]
        found += [str(c) for c in level if _has_steps(c)]
    return sorted(found)[:5]


def _children(path: Any) -> list[Any]:
    try:
        return [c for c in path.iterdir() if c.is_dir() and not c.name.isdigit()]
    except OSError:
        return []


def remove_leftovers(directory: Any) -> list[str]:
    """Removes the temporary folders interrupted saves left in ``directory`` (process 0), with a note."""
    if jax.process_index() != 0 or not directory.exists():
        return []
    left = sorted(p for p in directory.iterdir() if TMP_MARK in p.name)
    for p in left:
        _remove(p)
    if left:
        logger.warning(
            "removed %d temporary folders of interrupted saves in %s: %s",
            len(left),
            directory,
            [p.name for p in left],
        )
    return [p.name for p in left]


def _remove(path: Any, tries: int = 20) -> None:
    """Removes a file or folder; retries while a failed save's last writer thread still adds files to it."""
    for attempt in range(tries):
        try:
            path.rmtree() if path.is_dir() else path.unlink()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.ENOTEMPTY or attempt == tries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def remove_unfinished(directory: Any, step: int) -> None:
    """Removes ``step``'s folder when Orbax never finalised it (no commit marker): no restore may pick it."""
    folder = directory / str(step)
    if jax.process_index() == 0 and folder.exists() and not (folder / "_CHECKPOINT_METADATA").exists():
        _remove(folder)


def move_steps(directory: Any, steps: Sequence[int], folder: Any) -> None:
    """Moves step folders into ``folder`` (process 0): on a disk a rename, so nothing is copied or deleted; in
    a bucket a copy, then the deletion (see :func:`nnx_shard._base._storage.move_tree`)."""
    if jax.process_index() != 0 or not steps:
        return
    for step in steps:
        storage.move_tree(directory / str(step), folder / str(step))


def corrupted(directory: Any, step: int, what: str, others: list[int]) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"step {step} in {directory} could not be read ({what}); it is incomplete or "
        f"corrupted. Nothing live was changed. Other steps: {others}."
    )


def unreadable(
    directory: Any, step: int | None, error: BaseException, hidden: list[str], others: list[int]
) -> CheckpointError:
    """The error for a read that failed on the storage: the step, the arrays or files, the first cause."""
    denied = os_error(error)
    if isinstance(denied, PermissionError):
        return CheckpointError(
            f"step {step} in {directory} cannot be read: permission denied on {denied.filename}. "
            f"Nothing live was changed; fix the file's permissions."
        )
    arrays, files = named(error)
    if not arrays and not files and step is not None:
        files = unreadable_json(directory / str(step))  # a decode error names no file: find it
    parts = [describe(error)]
    if arrays:
        parts.insert(0, f"arrays {arrays[:8]}")
    if files:
        parts.insert(0, f"files {files[:4]}")
    if hidden:
        parts.append(f"{len(hidden)} more reads failed")
    if step is None:
        return CheckpointCorruptError(f"{directory} could not be opened ({'; '.join(parts)}).")
    return corrupted(directory, step, "; ".join(parts), others)


def save_failed(directory: Any, step: int | None, error: BaseException) -> CheckpointSaveError:
    """The error for a save that could not be written: the step, the path, the array, the OS's reason."""
    reason, arrays = os_reason(error), named(error)[0]
    what = describe(error) if reason is None else f"{reason}; {describe(error)[:200]}"
    if arrays:
        what = f"writing {arrays[0]}: {what}"
    return CheckpointSaveError(
        f"step {step} could not be written to {directory} ({what}). The earlier steps are intact; "
        f"free space or fix the directory's permissions, and the next save writes."
    )


def move_failed(directory: Any, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"steps could not be moved out of {directory} ({describe(error)}); nothing was "
        f"deleted. Fix the directory's permissions or free space, then start again."
    )


def read_limit(max_host_bytes: int, target: Any) -> int:
    """The byte limit Orbax's reader gets for a read that may hold ``max_host_bytes`` on the host.

    A shard in flight is held about four times over on the host (TensorStore's
    read buffer, the decoded array, the copy into device memory, and what the
    allocator keeps): measured peak RSS above the state was 1.5-2x Orbax's
    limit plus ~90 MB of fixed overhead. So Orbax gets a fifth of the budget
    (a quarter peaked 1.15-1.16x a 1.125 GiB state at 128 MiB, a sixth cost
    time, a fifth 1.147-1.149x in bench_restore), and never less than the
    largest shard, which must be read whole.
    """
    if max_host_bytes <= 0:
        raise CheckpointError(f"max_host_bytes must be a positive number of bytes; got {max_host_bytes!r}.")
    largest = max(
        (
            math.prod(x.sharding.shard_shape(x.shape)) * itemsize(x.dtype)
            for x in jax.tree.leaves(target)
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
        ),
        default=0,
    )
    if largest * READ_AMPLIFICATION > max_host_bytes:
        logger.warning(
            "max_host_bytes=%d is below what reading the largest shard takes (about %d bytes); reading one "
            "shard at a time",
            max_host_bytes,
            largest * READ_AMPLIFICATION,
        )
    return max(max_host_bytes // READ_AMPLIFICATION, largest + 2**20)  # Orbax needs room for a whole shard
