"""The one restore: a source, live states and options in; restored states on the target shardings and a report
out."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._base import (
    EMA,
    MODEL,
    check_every_process_in,
    describe_mesh,
    ema_as_model_restored,
    ema_as_model_target,
)
from nnx_shard._checkpoint._faults import quiet
from nnx_shard._checkpoint._format import abstract_target
from nnx_shard._checkpoint._restore_options import RestoreOptions, RestoreReport
from nnx_shard._checkpoint._sources import ReadRequest, as_source
from nnx_shard.errors import CheckpointError

logger = logging.getLogger("nnx_shard")


def check_placed(states: Any, shardings: Any) -> None:
    """Refuses a restore that did not land exactly on the target (never keep an old device subset)."""
    targets, treedef = jax.tree_util.tree_flatten(shardings, is_leaf=lambda v: v is None)
    for target, sub in zip(targets, treedef.flatten_up_to(states), strict=True):
        for x in jax.tree.leaves(sub):
            if (
                target is not None
                and isinstance(x, jax.Array)
                and not x.sharding.is_equivalent_to(target, x.ndim)
            ):
                raise CheckpointError(f"a restored array landed on {x.sharding}, not on the target {target}.")


def restore_names(
    default: Sequence[str], objects: Sequence[str], only: Sequence[str] | None, ema_as_model: bool
) -> list[str]:
    """The objects a restore reads: ``only`` (default: ``default``, those the source offers), checked
    against the live ``objects``; the EMA not read with ``ema_as_model``."""
    names = list(default) if only is None else list(only)
    unknown = sorted(set(names) - set(objects))
    if unknown:
        raise CheckpointError(
            f"only={unknown} names no live object; the objects are {sorted(objects)}: restore some of those."
        )
    if ema_as_model and MODEL not in names:
        raise CheckpointError(
            "ema_as_model=True loads EMA parameters into the 'model' object; include 'model' in only=."
        )
    return [n for n in names if n != EMA] if ema_as_model else names


def _targets(
    states: dict[str, Any], shardings: Mapping[str, Any], names: list[str], opts: RestoreOptions
) -> tuple[Any, Any, Any]:
    """What to read into, the structure the checkpoint must have, and the frozen part kept (``states``
    trimmed)."""
    target = {k: abstract_target(states[k], shardings[k]) for k in names}
    kept = None
    if opts.frozen is not None and MODEL in target:  # the frozen part stays as it is, never read
        kept, states[MODEL] = nnx.split_state(states[MODEL], opts.frozen, ...)
        target[MODEL] = nnx.split_state(target[MODEL], opts.frozen, ...)[1]
    expected = dict(target)
    if opts.ema_as_model:
        target, expected = ema_as_model_target(target), ema_as_model_target(target, expected=True)
    return target, expected, kept


def restore_onto(
    source: Any,
    states: Mapping[str, Any],
    shardings: Mapping[str, Any],
    mesh: Mesh,
    *,
    step: int | None = None,
    options: RestoreOptions | None = None,
) -> tuple[dict[str, Any], RestoreReport]:
    """Reads ``step`` (default: the newest) of ``source`` straight into ``shardings``; owns nothing.

    The one restore every public one calls. ``source`` is anything :func:`as_source` resolves (a
    :class:`Checkpointer`, a directory of nnx_shard's or plain Orbax's, a safetensors folder, loaded states,
    snapshots, a :class:`Source`); ``states`` are the live states of every object (``{"model": State,
    ...}``), ``shardings`` their targets on ``mesh``. Returns the restored states of the objects read
    (``options.only``, default all the source holds) and a :class:`RestoreReport`. A failed restore changes
    nothing live unless ``options.free_live`` freed it.
    """
    opts = options or RestoreOptions()
    src = as_source(source, opts)
    if src.collective:
        check_every_process_in(  # Orbax reads an array only onto devices of every process
            mesh,
            "a restore",
            "Restore onto a mesh with a device on every process, then move the state with "
            "Trainer.resize(mesh) or ShardingHooks.on_mesh_change(mesh), which may leave processes out.",
        )
    states = dict(states)
    live = dict(states)
    names = restore_names(src.objects(list(states)), list(states), opts.only, opts.ema_as_model)
    target, expected, kept = _targets(states, shardings, names, opts)
    request = ReadRequest(step, target, expected, live, opts)
    with quiet():  # one quiet block for the whole restore: the reads inside share its cleanup
        src.prepare(request)  # checked before anything live is freed
        if opts.free_live:
            for x in jax.tree.leaves({k: states[k] for k in names}):
                if isinstance(x, jax.Array):
                    x.delete()
        try:
            restored, saved = src.read(request)
        except CheckpointError:
            if opts.free_live:
                logger.error(
                    "restore of step %s failed after the live state was freed (free_live=True)", src.step
                )
            raise
    restored = dict(restored)
    if kept is not None:
        restored[MODEL] = nnx.merge_state(restored[MODEL], kept)
    if opts.ema_as_model:
        restored = ema_as_model_restored(restored)
    check_placed(restored, {k: shardings[k] for k in restored})
    partial = src.describe() is None and (not src.complete(list(restored)) or opts.ema_as_model)
    report = RestoreReport(
        step=src.step,
        saved=saved,
        devices=int(mesh.devices.size),
        processes=jax.process_count(),
        mesh=describe_mesh(mesh),
        only=tuple(sorted(restored)) if partial else None,
        ema_as_model=opts.ema_as_model,
        source=src.describe(),
        note=src.note,
    )
    return restored, report
