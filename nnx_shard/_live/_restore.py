"""``restore_and_reshard``: a checkpoint (or a state Orbax loaded) onto the current mesh, for objects no hooks own."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._format import RestoreOptions, RestoreReport
from nnx_shard._live._hooks import ShardingHooks


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

    The same restore as :meth:`ShardingHooks.restore_and_reshard` (which this
    calls), for objects that no hooks own yet.

    Args:
      checkpointer: a :class:`Checkpointer` or a directory: nnx_shard's, or one
        written by plain Orbax (``CheckpointManager``, ``ocp.v1.save_pytree``).
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
    hooks = ShardingHooks(strategy, mesh)
    hooks.adopt(objects)
    if state is not None:
        hooks.on_restore(state)
        hooks.sync()  # write into the caller's objects now
        return None
    options = RestoreOptions(
        item=item, ema_as_model=ema_as_model, free_live=free_live, max_host_bytes=max_host_bytes
    )
    report = hooks.restore_and_reshard(checkpointer, step=step, options=options)
    hooks.sync()
    return report
