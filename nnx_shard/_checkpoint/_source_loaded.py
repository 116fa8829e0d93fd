"""State a user already loaded (with Orbax or anything else) as a restore's source: placed, never read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from nnx_shard._base import is_graph_object
from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._restore_options import RestoreOptions
from nnx_shard._checkpoint._sources import ReadRequest, SourceDefaults, register_source, target_shardings
from nnx_shard._reshard import reshard
from nnx_shard.errors import CheckpointError, CheckpointFormatError


def check_keys(given: Mapping[str, Any], objects: Any, message: str) -> None:
    """Raises ``CheckpointError(message)`` (``{unknown}``, ``{objects}`` filled) for keys naming no object."""
    unknown = sorted(set(given) - set(objects))
    if unknown:
        raise CheckpointError(message.format(unknown=unknown, objects=sorted(objects)))


class LoadedState(SourceDefaults):
    """States loaded anywhere (``nnx.State``, graph objects, pure dicts or numpy trees, on any mesh or the
    host), placed onto the restore's shardings: arrays on devices resharded (no host round trip), host data
    placed shard by shard, a pure dict's values put into the live structure. The results own their buffers,
    so the next jitted step can donate them."""

    def __init__(self, loaded: Mapping[str, Any]):
        self.loaded = dict(loaded)

    def objects(self, live: list[str]) -> list[str]:
        check_keys(self.loaded, live, "restored keys {unknown} are not among the objects {objects}.")
        return list(self.loaded)

    def read(self, request: ReadRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        incoming = {}
        for key, target in request.target.items():
            value = self.loaded[key]
            if isinstance(value, nnx.State) or is_graph_object(value):
                state = nnx.state(value) if is_graph_object(value) else value
                if key == "model" and request.options.frozen is not None:  # the frozen part stays live
                    state = nnx.split_state(state, request.options.frozen, ...)[1]
                incoming[key] = state
            else:  # a pure dict: its values into the live structure
                template = jax.tree.map(lambda x: x, target)
                nnx.replace_by_pure_dict(template, _unwrap_values(value))
                incoming[key] = template
        return reshard(incoming, target_shardings(request.target), donate=False), {}

    def describe(self) -> str | None:
        return "the loaded state"


def _unwrap_values(tree: Any) -> Any:
    """Orbax's layout without a target keeps each Variable as ``{"value": x}``: take ``x``."""
    if isinstance(tree, Mapping):
        if set(tree) == {"value"}:
            return tree["value"]
        return {k: _unwrap_values(v) for k, v in tree.items()}
    return tree


def _make(obj: Any, options: RestoreOptions) -> LoadedState:
    for name in ("ema_as_model", "orbax_item"):
        if getattr(options, name):
            raise CheckpointFormatError(
                f"{name}= applies to a checkpoint read from disk; the state given was already loaded. "
                f"Give the states as the objects should hold them (e.g. the EMA's parameters under 'model')."
            )
    return LoadedState(obj)


register_source(
    "loaded state", lambda obj: isinstance(obj, Mapping) and not isinstance(obj, Checkpointer), _make
)
