"""The host route: data in host memory onto a sharding, each device given only its own shard."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding


def from_host(value: Any, sharding: Sharding) -> jax.Array:
    """Host data onto ``sharding``, each device given only its shard (each process sends only its own)."""
    host = np.asarray(value)
    # A process with no device in ``sharding`` makes an array with no shard: JAX needs its dtype then (the
    # one a device would hold); elsewhere it comes from the shards.
    dtype = None if sharding.addressable_devices else jax.dtypes.canonicalize_dtype(host.dtype)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=dtype)
