"""Restored state onto the current mesh: ``restore_and_reshard`` for any objects, and loaded state placed."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._base import as_state, is_graph_object
from nnx_shard._checkpoint import Checkpointer, RestoreOptions, RestoreReport, restore_onto
from nnx_shard._cluster import barrier_sync
from nnx_shard._reshard import reshard
from nnx_shard._sharding import plan_sharding
from nnx_shard.errors import CheckpointError

logger = logging.getLogger("nnx_shard")


def place_loaded(
    loaded: Mapping[str, Any], live: Mapping[str, Any], shardings: Mapping[str, Any]
) -> dict[str, Any]:
    """State loaded anywhere (States, pure dicts or numpy trees, on any mesh or the host) onto ``shardings``.

    Arrays on devices are resharded (no host round trip); host data is placed
    shard by shard; a pure dict's values go into the structure of ``live``.
    The results own their buffers, so the next jitted step can donate them.
    """
    check_keys(loaded, live, "restored keys {unknown} are not among the objects {objects}.")
    incoming = {}
    for key, value in loaded.items():
        if isinstance(value, nnx.State) or is_graph_object(value):
            incoming[key] = nnx.state(value) if is_graph_object(value) else value
        else:  # a pure dict: put its values into the live structure
            template = jax.tree.map(lambda x: x, live[key])
            nnx.replace_by_pure_dict(template, _unwrap_values(value))
            incoming[key] = template
    return reshard(incoming, {k: shardings[k] for k in incoming}, donate=False)


def _unwrap_values(tree: Any) -> Any:
    """Orbax's layout without a target keeps each Variable as ``{"value": x}``: take ``x``."""
    if isinstance(tree, Mapping):
        if set(tree) == {"value"}:
            return tree["value"]
        return {k: _unwrap_values(v) for k, v in tree.items()}
    return tree


def restore_and_reshard(
    checkpointer: Checkpointer | str | os.PathLike[str],
    objects: Mapping[str, Any],
    strategy: Sequence[tuple[str, Any]],
    mesh: Mesh,
    *,
    step: int | None = None,
    state: Mapping[str, Any] | None = None,
    item: str | None = None,
    ema_as_model: bool = False,
    free_live: bool = False,
    max_host_bytes: int | None = None,
) -> RestoreReport | None:
    """Restores a checkpoint (or a state already loaded with Orbax) onto the current mesh.

    The same restore as :meth:`ShardingHooks.restore_and_reshard`, for objects
    that no hooks own: the shardings are planned for ``objects`` on ``mesh``,
    and the restored state is written into them.

    Args:
      checkpointer: a :class:`Checkpointer` or a directory: nnx_shard's, or one
        written by plain Orbax (``CheckpointManager``, ``ocp.v1.save``).
      objects: the live ``{"model": ..., "optimizer": ..., "ema": ...}``, updated in place.
      strategy: the sharding strategy for the current mesh.
      mesh: the current mesh.
      step: the step to restore (default: the latest).
      state: a state already loaded (any mesh, host or numpy) to place instead of reading.
      item: the item of a plain Orbax checkpoint to read (default: the one that fits).
      ema_as_model: load the checkpoint's EMA parameters into ``objects["model"]``.
      free_live: free the live arrays before reading, to keep the peak low.
      max_host_bytes: bound the host memory the read holds at once.

    Only the items given in ``objects`` are read: ``{"model": model}`` restores
    the model of a checkpoint that also holds an optimizer and an EMA, and
    reads nothing else. Within an item the structure must match exactly.

    Returns:
      What happened, e.g. ``restored step 300, saved on 8 devices (fsdp=8), onto 4
      devices (fsdp=4)``; None when ``state`` was given.

    >>> import tempfile
    >>> from nnx_shard import Checkpointer, create_mesh
    >>> strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), async_save=False)
    >>> ckpt.save(7, {"model": nnx.Linear(4, 8, rngs=nnx.Rngs(0))}, mesh=create_mesh((8,), ("fsdp",)))
    True
    >>> model = nnx.Linear(4, 8, rngs=nnx.Rngs(1))
    >>> half = create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    >>> print(restore_and_reshard(ckpt, {"model": model}, strategy, half))
    restored step 7, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)
    """
    plan = plan_sharding(dict(objects), strategy, mesh)
    live = as_state(dict(objects))[0]
    if state is not None:
        placed = place_loaded(state, live, plan.shardings)
        barrier_sync("nnx_shard/on_restore")
        write_states(objects, placed)
        return None
    options = RestoreOptions(
        item=item, ema_as_model=ema_as_model, free_live=free_live, max_host_bytes=max_host_bytes
    )
    restored, report = restore_onto(checkpointer, live, plan.shardings, mesh, step=step, options=options)
    barrier_sync("nnx_shard/restore_and_reshard")
    logger.info("%s", report)
    write_states(objects, restored)
    return report


def write_states(objects: Mapping[str, Any], states: Mapping[str, Any]) -> None:
    """The states into the live objects: graph objects (Modules, Optimizer, EMA) updated in place, a plain
    pytree replaced in ``objects`` when it is a mutable mapping."""
    for key, state in states.items():
        if is_graph_object(objects[key]):
            nnx.update(objects[key], state)
        elif isinstance(objects, MutableMapping):
            objects[key] = state


def check_keys(given: Mapping[str, Any], objects: Mapping[str, Any], message: str) -> None:
    """Raises ``CheckpointError(message)`` (with ``{unknown}`` and ``{objects}``) for keys naming no object."""
    unknown = sorted(set(given) - set(objects))
    if unknown:
        raise CheckpointError(message.format(unknown=unknown, objects=sorted(objects)))
