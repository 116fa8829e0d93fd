"""A safetensors file or folder (Hugging Face's layout, or a PEFT adapter) as a restore's source."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from nnx_shard._checkpoint._restore_options import RestoreOptions
from nnx_shard._checkpoint._sources import ReadRequest, SourceDefaults, register_source, target_shardings
from nnx_shard._reshard import reshard
from nnx_shard._weights import load_safetensors
from nnx_shard.errors import CheckpointFormatError


class SafetensorsFolder(SourceDefaults):
    """Pretrained weights into the model: :func:`nnx_shard.load_safetensors` over a copy of the live model's
    state (the live one is untouched until the restore writes it), with its key map, ``skip``, ``ignore``
    and ``strict``. Only the model is read. After the read, ``report`` is the :class:`LoadReport`."""

    def __init__(
        self,
        files: str | os.PathLike[str],
        key_map: Any = None,
        *,
        skip: Sequence[str] = (),
        ignore: Sequence[str] = (),
        strict: bool = True,
    ):
        self.files, self.key_map = files, key_map
        self.skip, self.ignore, self.strict = skip, ignore, strict
        self.report: Any = None
        self._template: Any = None

    def objects(self, live: list[str]) -> list[str]:
        if "model" not in live:
            raise CheckpointFormatError(
                f"safetensors weights load into the 'model' object; the objects are {sorted(live)}."
            )
        return ["model"]

    def prepare(self, request: ReadRequest) -> None:
        options = request.options
        if options.ema_as_model or options.orbax_item is not None or options.free_live:
            raise CheckpointFormatError(
                f"{self.files} is a safetensors source: restore it without ema_as_model=, orbax_item= or "
                f"free_live= (the weights load into a copy of the live model, then replace it)."
            )
        self._template = jax.tree.map(lambda x: x, request.live["model"])  # new Variables, the same arrays

    def read(self, request: ReadRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        self.report = load_safetensors(
            self._template, self.files, self.key_map, skip=self.skip, ignore=self.ignore, strict=self.strict
        )
        state = self._template
        if request.options.frozen is not None:
            state = nnx.split_state(state, request.options.frozen, ...)[1]
        return reshard({"model": state}, target_shardings(request.target), donate=False), {}

    def describe(self) -> str | None:
        tensors = "" if self.report is None else f" ({self.report.tensors} tensors)"
        return f"the safetensors weights of {self.files}{tensors}"


def is_safetensors(obj: Any) -> bool:
    """A ``.safetensors`` file, or a folder holding some (or their index, or a PEFT adapter's config)."""
    if not isinstance(obj, (str, os.PathLike)):
        return False
    path = Path(obj)
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and (any(path.glob("*.safetensors")) or (path / "adapter_config.json").is_file())


def _make(obj: Any, options: RestoreOptions) -> SafetensorsFolder:
    return obj if isinstance(obj, SafetensorsFolder) else SafetensorsFolder(obj)


register_source("safetensors", is_safetensors, _make, before="nnx_shard checkpoint")
