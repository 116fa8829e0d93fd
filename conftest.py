"""The one place that fakes devices: 8 simulated CPU devices for tests and doctests.

Tests that start their own processes pass the count they want the same way
(``jax.config.update("jax_num_cpu_devices", n)``); nothing else sets it.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("XLA_FLAGS", None)  # one mechanism only: the config below
# gcsfs reads this once, at its import, whichever test imports it first: the bucket tests' emulator speaks
# HTTP only, and gcsfs 2026.10 would try gRPC, 60 s a call (tests/bucket.py points every client there).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEVICES = 8
jax.config.update("jax_num_cpu_devices", DEVICES)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    """What every docstring example may use without importing it."""
    doctest_namespace.update(
        jax=jax, jnp=jnp, np=np, nnx=nnx, Mesh=Mesh, NamedSharding=NamedSharding, PartitionSpec=PartitionSpec
    )
