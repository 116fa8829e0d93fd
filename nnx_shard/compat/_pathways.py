"""pathwaysutils' name for a reshard through an intermediate sharding, on plain JAX (its ``experimental``
API)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp  # noqa: F401  (used by the doctest)
import numpy as np  # noqa: F401  (used by the doctest)
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding  # noqa: F401  (the doctest's names)

from nnx_shard._reshard import reshard
from nnx_shard.errors import ReshardError


def reshard_with_intermediate_sharding(
    x: Any, in_sharding: Sharding, out_sharding: Sharding, *, donate: bool = False
) -> Any:
    """Reshards ``x`` (an array or pytree on ``in_sharding``) to ``out_sharding`` through an intermediate.

    The name and signature of pathwaysutils' experimental API, on plain JAX:
    the intermediate is the common refinement of the two shardings, whose
    pieces each travel once, inside one program over both device sets
    (see :func:`reshard`).

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp"))
    >>> dst = NamedSharding(Mesh(np.array(devs[:4]), ("tp",)), PartitionSpec("tp"))
    >>> reshard_with_intermediate_sharding(jax.device_put(jnp.arange(8.0), src), src, dst).sharding == dst
    True
    """
    for leaf in jax.tree_util.tree_leaves(x):
        if isinstance(leaf, jax.Array) and not leaf.sharding.is_equivalent_to(in_sharding, leaf.ndim):
            raise ReshardError(f"an input array is on {leaf.sharding}, not on in_sharding {in_sharding}.")
    return reshard(x, out_sharding, donate=donate)
