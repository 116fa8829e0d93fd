"""``restore_and_reshard`` for objects no hooks own, and the arguments every public restore shares."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from nnx_shard._base import as_state, is_graph_object
from nnx_shard._checkpoint import RestoreOptions, RestoreReport, renamed, restore_onto
from nnx_shard._cluster import barrier_sync
from nnx_shard._sharding import plan_sharding
from nnx_shard.errors import ConflictingArgumentsError

logger = logging.getLogger("nnx_shard")


def restore_options(where: str, options: RestoreOptions | None, arguments: dict[str, Any]) -> RestoreOptions:
    """The options of a public restore: ``options=``, or its keywords (the old ``items=``/``item=`` warn)."""
    return RestoreOptions.given(options, **renamed(arguments, where))


def read_arguments(
    where: str,
    source: Any,
    options: RestoreOptions | None,
    keywords: dict[str, Any],
    old: dict[str, Any],
    old_sources: tuple[str, ...] = ("checkpointer",),
) -> tuple[Any, RestoreOptions]:
    """What a public restore was asked: its source (or what an old ``checkpointer=``/``state=`` gave) and
    its options (``options=``, or the keywords; the old ``items=``/``item=`` warn).

    Raises:
      TypeError: a keyword the restore does not take, or no source.
    """
    unknown = sorted(set(old) - {*old_sources, "items", "item"})
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword arguments {unknown}")
    source = source_given(where, source, {k: old.pop(k, None) for k in old_sources})
    if source is None:
        raise TypeError(f"{where}() needs a source: a Checkpointer, a directory, or loaded states.")
    return source, restore_options(where, options, {**keywords, **old})


def source_given(where: str, source: Any, old: dict[str, Any]) -> Any:
    """The source, or what an old keyword (``checkpointer=``, ``state=``) gave, with a warning."""
    given = {k: v for k, v in old.items() if v is not None}
    if not given:
        return source
    (name, value), *rest = given.items()
    if rest or source is not None:
        raise ConflictingArgumentsError(
            f"{where} reads one source; it got "
            f"{', '.join(['source', *given] if source is not None else given)}."
        )
    warnings.warn(
        f"{where}: {name}= is now the first argument, source (every kind of source goes there).",
        DeprecationWarning,
        stacklevel=4,  # the caller of the public restore
    )
    return value


def restore_and_reshard(
    source: Any = None,
    objects: Mapping[str, Any] | None = None,
    strategy: Sequence[tuple[str, Any]] | None = None,
    mesh: Mesh | None = None,
    *,
    step: int | None = None,
    options: RestoreOptions | None = None,
    only: Sequence[str] | None = None,
    orbax_item: str | None = None,
    ema_as_model: bool = False,
    free_live: bool = False,
    max_host_bytes: int | None = None,
    frozen: Any = None,
    **old: Any,
) -> RestoreReport:
    """Restores ``source`` onto the current mesh, into objects that no hooks own.

    The same restore as :meth:`ShardingHooks.restore_and_reshard` and :meth:`Trainer.restore_and_reshard`,
    with the same arguments: the shardings are planned for ``objects`` on ``mesh``, and the restored state
    is written into them (graph objects updated in place, plain pytrees replaced in the mapping).

    Args:
      source: where to read (see :func:`nnx_shard.restore_onto`'s sources): a :class:`Checkpointer` or a
        directory (nnx_shard's, or one written by plain Orbax: ``CheckpointManager``, ``ocp.v1.save``), a
        safetensors folder, or states already loaded (any mesh, host or numpy) to place.
      objects: the live ``{"model": ..., "optimizer": ..., "ema": ...}``, updated in place.
      strategy: the sharding strategy for the current mesh.
      mesh: the current mesh.
      step: the step to restore (default: the latest).
      options: the keywords below as one :class:`RestoreOptions` (not both).
      only: restore only these objects (default: all given); the source's others are not read.
      orbax_item: the item of a plain Orbax checkpoint to read (default: the one that fits).
      ema_as_model: load the checkpoint's EMA parameters into ``objects["model"]``.
      free_live: free the live arrays before reading, to keep the peak low.
      max_host_bytes: bound the host memory the read holds at once.
      frozen: an nnx filter of model parameters the checkpoint does not hold (they keep their values).

    ``state=`` (a loaded state), ``items=`` and ``item=`` are the old names of ``source``, ``only=`` and
    ``orbax_item=`` (they warn). Within an object the structure must match exactly.

    Returns:
      What happened, e.g. ``restored step 300, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)``.

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
    keywords = {"only": only, "orbax_item": orbax_item, "ema_as_model": ema_as_model, "free_live": free_live}
    keywords |= {"max_host_bytes": max_host_bytes, "frozen": frozen}
    old_sources = ("checkpointer", "state")
    source, opts = read_arguments("restore_and_reshard", source, options, keywords, old, old_sources)
    if objects is None or strategy is None or mesh is None:
        raise TypeError("restore_and_reshard() needs the objects, a strategy and a mesh after the source.")
    plan = plan_sharding(dict(objects), strategy, mesh)
    live = as_state(dict(objects))[0]
    restored, report = restore_onto(source, live, plan.shardings, mesh, step=step, options=opts)
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
