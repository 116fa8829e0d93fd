"""A checkpoint written by plain Orbax as a restore's source: each layout, the item that fits each object."""

from __future__ import annotations

import os
from typing import Any

from nnx_shard._checkpoint._plain import PlainCheckpoint
from nnx_shard._checkpoint._restore_options import RestoreOptions
from nnx_shard._checkpoint._sources import ReadRequest, SourceDefaults, register_source
from nnx_shard.errors import CheckpointFormatError


class OrbaxSource(SourceDefaults):
    """Reads the items of a plain Orbax checkpoint (``CheckpointManager``, ``StandardCheckpointer``,
    ``ocp.v1.save``) that fit the objects; it carries no fingerprints, which the report says."""

    collective = True
    note = "; it carries no fingerprints, so its content was not verified"

    def __init__(self, directory: str | os.PathLike[str]):
        self.plain = PlainCheckpoint(directory)
        self.step: int | None = None

    def prepare(self, request: ReadRequest) -> None:
        self.plain.prepare(request.step, request.target, request.options.orbax_item)
        self.step = self.plain.step

    def read(self, request: ReadRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.plain.read(request.target, request.options.max_host_bytes), {}

    def describe(self) -> str | None:
        return f"{self.plain.describe()} of a plain Orbax checkpoint"


def _make(obj: Any, options: RestoreOptions) -> OrbaxSource:
    if options.ema_as_model:
        raise CheckpointFormatError(
            f"ema_as_model=True reads the EMA that nnx_shard saves beside the model; {obj} was "
            f"written by plain Orbax. Restore its item into the model directly."
        )
    return OrbaxSource(obj)


# asked last: a directory no other kind takes is read as plain Orbax (whose own errors name what is there)
register_source("plain Orbax checkpoint", lambda obj: isinstance(obj, (str, os.PathLike)), _make)
