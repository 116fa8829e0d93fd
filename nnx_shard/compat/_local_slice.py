"""big_vision's host-local slice helpers: rows of every process stacked into one global array and back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard.errors import LocalSliceError


def make_fsarray_from_local_slice(local_slice: Any, global_devices: Sequence[Any]) -> jax.Array:
    """Stacks every process's ``local_slice`` into one array sharded on dim 0 over ``global_devices``.

    Args:
      local_slice: this process's rows (anything ``np.asarray`` takes); its
        first dimension must split evenly over this process's devices.
      global_devices: all devices, in the same order in every process.

    Returns:
      A global array of shape ``(rows * process_count, ...)``.

    >>> x = make_fsarray_from_local_slice(np.arange(16).reshape(8, 2), jax.devices())
    >>> x.shape, x.sharding.spec
    ((8, 2), P('devices',))
    """
    mesh = Mesh(np.asarray(global_devices), ("devices",))
    local = mesh.local_devices
    x = np.asarray(local_slice)
    if x.ndim == 0 or x.shape[0] % len(local):
        raise LocalSliceError(
            f"local slice of shape {x.shape} cannot be split over this process's {len(local)} "
            f"devices: its first dimension must be a multiple of {len(local)}."
        )
    sharding = NamedSharding(mesh, PartitionSpec("devices"))
    global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
    pieces = jax.device_put(np.split(x, len(local), axis=0), local)
    return jax.make_array_from_single_device_arrays(global_shape, sharding, pieces)


def get_local_slice_from_fsarray(global_array: jax.Array) -> np.ndarray:
    """Returns this process's rows of an array sharded on dim 0 only, in device order.

    The inverse of :func:`make_fsarray_from_local_slice`.

    Raises:
      LocalSliceError: the array is sharded along another dimension.

    >>> x = make_fsarray_from_local_slice(np.arange(8), jax.devices())
    >>> get_local_slice_from_fsarray(x).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    for shard in global_array.addressable_shards:
        if any(idx != slice(None) for idx in shard.index[1:]):
            raise LocalSliceError(
                f"the array of shape {global_array.shape} is sharded along a dimension other "
                f"than the first ({global_array.sharding}); only row-sharded arrays have host-local slices."
            )
    by_device = {s.device: s for s in global_array.addressable_shards}
    order = (
        global_array.sharding.mesh.local_devices
        if hasattr(global_array.sharding, "mesh")
        else list(by_device)
    )
    seen, rows = set(), []
    for d in order:
        s = by_device[d]
        start = s.index[0].start if s.index else None
        if start in seen:  # replicated rows: keep one copy
            continue
        seen.add(start)
        rows.append(np.asarray(s.data))
    return np.concatenate(rows, axis=0)
