"""A job's in-memory snapshots as a restore's source: the newest complete one after a checkpoint's step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nnx_shard._checkpoint import ReadRequest, SourceDefaults, register_source
from nnx_shard._snapshots._reader import restore_from_snapshots
from nnx_shard.errors import CheckpointFormatError, NoCheckpointError


class Snapshots(SourceDefaults):
    """The snapshots a previous run of ``previous`` processes left in this process's ``folder`` (None: new
    to the job), newer than step ``after`` (a collective); none complete and verified: :meth:`prepare` raises
    :class:`NoCheckpointError` on every process. After the read, ``data_states`` holds each one's data."""

    collective = True

    def __init__(self, folder: Path | None, previous: int, *, after: int):
        self.folder, self.previous, self.after = folder, previous, after
        self.step: int | None = None
        self.data_states: list[Any] = []
        self._got: Any = None

    def prepare(self, request: ReadRequest) -> None:
        if request.options.ema_as_model or request.options.frozen is not None:
            raise CheckpointFormatError(
                "a snapshot holds the whole live state: restore it without ema_as_model= or frozen=."
            )
        self._got = restore_from_snapshots(self.folder, self.previous, request.live, after=self.after)
        if self._got is None:
            raise NoCheckpointError(f"no complete, verified snapshot newer than step {self.after}.")
        self.step, self.data_states = self._got.step, self._got.data_states

    def read(self, request: ReadRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        return {k: self._got.states[k] for k in request.target}, {}

    def describe(self) -> str | None:
        return f"the in-memory snapshots of {self.previous} process{'es' if self.previous != 1 else ''}"


register_source(
    "snapshots", lambda obj: isinstance(obj, Snapshots), lambda obj, _: obj, before="plain Orbax checkpoint"
)
