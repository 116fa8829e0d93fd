"""nnx_shard's own checkpoints as a restore's source: a :class:`Checkpointer` or a folder in its layout."""

from __future__ import annotations

import os
from typing import Any

import jax
from etils import epath

from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._plain import has_steps, is_nnx_shard
from nnx_shard._checkpoint._restore_options import RestoreOptions
from nnx_shard._checkpoint._sources import ReadRequest, SourceDefaults, register_source
from nnx_shard._cluster import agree
from nnx_shard.errors import CheckpointFormatError, NoCheckpointError


class CheckpointSource(SourceDefaults):
    """Reads a step of an nnx_shard checkpoint, its structure and files checked before anything is freed."""

    collective = True

    def __init__(self, checkpointer: Checkpointer | str | os.PathLike[str]):
        self.checkpointer = (
            checkpointer if isinstance(checkpointer, Checkpointer) else Checkpointer(checkpointer)
        )
        self.step: int | None = None

    def prepare(self, request: ReadRequest) -> None:
        expected, step = request.expected, request.step
        step = newest_listed(self.checkpointer) if step is None else step
        self.step = self.checkpointer.validate(step, expected, items=sorted(expected))
        if request.options.free_live:
            self.checkpointer.metadata(self.step)  # readable, before anything live is freed

    def read(self, request: ReadRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.checkpointer.read(
            self.step, request.target, partial=True, max_host_bytes=request.options.max_host_bytes
        )

    def describe(self) -> str | None:
        return None

    def complete(self, restored: list[str]) -> bool:
        return sorted(restored) == self.checkpointer.items(self.step)


def newest_listed(checkpointer: Checkpointer) -> int | None:
    """The newest step every process lists (a host's view may lag), agreed (a collective); None where none
    does, or with one process (its own listing decides). NoCheckpointError when only some list none."""
    if jax.process_count() == 1:
        return None
    latest = checkpointer.latest_step()
    newest = agree("restore.newest", [0 if latest is None else latest + 1])[:, 0] - 1
    missing = [p for p, s in enumerate(newest) if s < 0]
    if 0 < len(missing) < len(newest):  # none anywhere: validate's error says where checkpoints are
        raise NoCheckpointError(f"no checkpoint in {checkpointer.directory}: processes {missing} list none")
    return None if missing else int(newest.min())


def _matches(obj: Any) -> bool:
    return isinstance(obj, Checkpointer) or (isinstance(obj, (str, os.PathLike)) and is_nnx_shard(obj))


def _make(obj: Any, options: RestoreOptions) -> CheckpointSource:
    directory = obj.directory if isinstance(obj, Checkpointer) else obj
    if options.orbax_item is not None and epath.Path(directory).exists() and has_steps(directory):
        raise CheckpointFormatError(
            f"orbax_item={options.orbax_item!r} names an item of a plain Orbax checkpoint; {obj} is "
            "nnx_shard's "
            f"own, whose objects are chosen with only=[...]."
        )
    return CheckpointSource(obj)


register_source("nnx_shard checkpoint", _matches, _make)
