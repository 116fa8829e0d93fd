"""Synchronizing processes (named barriers with timeouts) and host-local batches as global arrays."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._cluster._coordination import Keys, KeyValueStore
from nnx_shard.errors import BarrierTimeoutError, LocalSliceError, ShardingError

DATA_AXES: tuple[str, ...] = ("dp", "fsdp", "data", "batch")


_calls: collections.Counter[str] = collections.Counter()


DEADLINE_EXCEEDED = (
    4  # absl's StatusCode::kDeadlineExceeded: JaxRuntimeError.error_code of a barrier that timed out
)


def _barrier_id(name: str | None) -> tuple[str, str]:
    """A barrier id the same in every process that makes the same calls.

    Each name keeps its own counter, so processes only need to agree on how
    often they pass a given name, not on every barrier they ever called.
    """
    shown = name if name is not None else "<unnamed>"
    base = f"nnx_shard/{name if name is not None else '_unnamed'}"
    k = _calls[base]
    _calls[base] += 1
    return f"{base}#{k}", shown


def barrier_sync(name: str | None = None, timeout: float = 200) -> None:
    """Waits until every process reaches the barrier ``name``, or raises after ``timeout`` seconds.

    Returns at once with a single process. With several, it is a barrier of
    JAX's distributed coordination service whose id is ``name`` plus how many
    times this process has passed that name (a counter alone when no name is
    given, which drifts if processes call unnamed barriers a different number
    of times: prefer names). Processes that pass different names time out
    instead of deadlocking, and the error says which processes are missing
    and where they are waiting.

    Args:
      name: the barrier's name, the same in every process, e.g. ``"after-restore"``.
      timeout: seconds to wait.

    Raises:
      BarrierTimeoutError: not every process arrived in time; names the
        barrier and the processes that had not arrived.
      DistributedNotInitializedError: several processes but no
        ``jax.distributed.initialize``.

    >>> barrier_sync("after-init")  # one process: returns at once
    """
    if jax.process_count() == 1:
        return
    if timeout <= 0:
        raise ShardingError(f"barrier_sync timeout must be positive seconds; got {timeout!r}.")
    store = KeyValueStore()
    barrier_id, shown = _barrier_id(name)
    me = jax.process_index()
    store.set(f"{Keys.WAITING}{me}", barrier_id)
    store.set(f"{Keys.ARRIVED}{barrier_id}/{me}", "1")
    try:
        store.barrier(barrier_id, max(1, int(timeout * 1000)))
    except jax.errors.JaxRuntimeError as e:
        if e.error_code != DEADLINE_EXCEEDED:  # the status code, not the message's wording
            raise
        report = _missing_report(store, barrier_id, shown, timeout, e)
        # Others may still be reporting: say where this process gave up.
        store.set(f"{Keys.WAITING}{me}", f"gave up:{barrier_id}")
        raise BarrierTimeoutError(report) from None
    store.set(f"{Keys.WAITING}{me}", "")


def _missing_report(
    store: KeyValueStore, barrier_id: str, shown: str, timeout: float, error: BaseException
) -> str:
    n = jax.process_count()
    try:
        arrived = {int(k.rsplit("/", 1)[1]) for k in store.directory(f"{Keys.ARRIVED}{barrier_id}/")}
        waiting = store.directory(Keys.WAITING)
    except jax.errors.JaxRuntimeError:  # the service itself is failing: say what the barrier said
        return (
            f"barrier {shown!r} (id {barrier_id}) timed out after {timeout:g} s in process "
            f"{jax.process_index()} of {n}; the coordination service said: {str(error).splitlines()[0]}"
        )
    missing = sorted(set(range(n)) - arrived)
    where = []
    for p in missing:
        # (The service's get_live_nodes would tell the dead from the busy, but
        # it blocks until every live process calls it, so it cannot be used here.)
        at = waiting.get(f"nnx_shard_waiting/{p}", "")
        if at.startswith("gave up:"):
            where.append(
                f"{p} (gave up waiting at {at.removeprefix('gave up:').removeprefix('nnx_shard/')!r})"
            )
        elif at:
            where.append(f"{p} (waiting at {at.removeprefix('nnx_shard/')!r})")
        else:
            where.append(f"{p} (not at any barrier)")
    return (
        f"barrier {shown!r} (id {barrier_id.removeprefix('nnx_shard/')}) timed out after {timeout:g} s: "
        f"{len(missing)} of {n} processes did not arrive: {', '.join(where)}. A process may have "
        f"crashed, be slower than the timeout, or have called a barrier with another name or "
        f"another number of times."
    )


def data_sharding(mesh: Mesh, data_axes: Sequence[str] | None = None) -> NamedSharding:
    """The sharding of a global batch: dim 0 over the mesh's data axes (``dp``, ``fsdp``, ...).

    >>> from nnx_shard import create_mesh
    >>> data_sharding(create_mesh((2, 2, 2), ("dp", "fsdp", "tp"))).spec
    P(('dp', 'fsdp'),)
    """
    axes = tuple(data_axes) if data_axes is not None else tuple(a for a in mesh.axis_names if a in DATA_AXES)
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ShardingError(f"data axes {missing} are not in the mesh {tuple(mesh.axis_names)}.")
    entry = None if not axes else axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, PartitionSpec(entry))


class DataShard(NamedTuple):
    """This process's share of every global batch: the ``index``-th of ``count`` equal row blocks.

    What a ``step -> batch`` callable or a data loader slices by, in place of ``jax.process_index()`` and
    ``jax.process_count()``, which say the same only while every process holds devices of the mesh.
    """

    index: int
    count: int


def data_shard(
    mesh: Mesh, data_axes: Sequence[str] | None = None, *, process: int | None = None
) -> DataShard | None:
    """Which rows of a global batch on ``mesh`` ``process`` (default: this one) passes to
    :func:`host_local_to_global`.

    The processes holding the same rows (model axes across processes) share a shard; processes are
    numbered by their first row. None when the process holds no device of the mesh: it reads no data
    (a Trainer resized off it, :meth:`nnx_shard.Trainer.resize`).

    >>> from nnx_shard import create_mesh
    >>> data_shard(create_mesh((4, 2), ("dp", "tp")))
    DataShard(index=0, count=1)
    >>> data_shard(create_mesh((4, 2), ("dp", "tp")), process=1) is None
    True
    """
    sharding = data_sharding(mesh, data_axes)
    entry = sharding.spec[0] if len(sharding.spec) else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    blocks = math.prod(mesh.shape[a] for a in names)
    rows: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((blocks,)).items():
        rows.setdefault(device.process_index, set()).add(index[0].start or 0)
    me = jax.process_index() if process is None else process
    if me not in rows:
        return None
    shards = sorted({frozenset(r) for r in rows.values()}, key=min)
    return DataShard(shards.index(frozenset(rows[me])), len(shards))


def host_local_to_global(batch: Any, mesh: Mesh, data_axes: Sequence[str] | None = None) -> Any:
    """Turns each process's host-local batch (a pytree of arrays) into a global batch.

    The global batch is sharded on dim 0 over ``data_axes`` (default: the
    mesh axes among dp, fsdp, data, batch); every process passes its own rows,
    and they are stacked in process order. Built on
    ``jax.make_array_from_process_local_data``.

    Raises:
      LocalSliceError: a leaf whose rows do not split over the data shards
        this process holds.

    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((4, 2), ("dp", "tp"))
    >>> g = host_local_to_global({"x": np.zeros((8, 3))}, mesh)
    >>> g["x"].shape, g["x"].sharding.spec
    ((8, 3), P('dp',))
    """
    sharding = data_sharding(mesh, data_axes)
    entry = sharding.spec[0] if len(sharding.spec) else None
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    shards = math.prod(mesh.shape[a] for a in names)
    # The distinct row blocks this process's devices hold (all of them when
    # the data axes do not span processes, 1/process_count when they do).
    held = sharding.addressable_devices_indices_map((shards,)).values()
    local_shards = len({index[0].start for index in held})

    def one(path: Any, x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % local_shards:
            raise LocalSliceError(
                f"batch leaf {jax.tree_util.keystr(path)!r} of shape {x.shape}: its {x.shape[:1] or 'no'} "
                "rows "
                f"cannot be split over the {local_shards} data shards this process holds "
                f"(data axes {names}); make the per-process batch a multiple of {local_shards}."
            )
        global_shape = (x.shape[0] * shards // local_shards, *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree_util.tree_map_with_path(one, batch)
