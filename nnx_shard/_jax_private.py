"""The one place nnx_shard reaches into JAX's private modules: the coordination-service client.

``barrier_sync`` needs the distributed client's key-value store and barriers,
which JAX does not export. Everything else in the package uses public JAX.
"""

from __future__ import annotations

from typing import Any

import jax

from nnx_shard._errors import DistributedNotInitializedError


def distributed_client() -> Any:
    """JAX's coordination-service client (``jax._src.distributed.global_state.client``).

    Raises:
      DistributedNotInitializedError: ``jax.distributed.initialize`` was not called.
    """
    state = None
    for module in ("jax._src.distributed", "jax.distributed"):
        try:
            mod = __import__(module, fromlist=["global_state"])
        except ImportError:  # pragma: no cover - moved in a future JAX
            continue
        state = getattr(mod, "global_state", None)
        if state is not None:
            break
    client = getattr(state, "client", None)
    if client is None:
        raise DistributedNotInitializedError(
            f"{jax.process_count()} processes but no distributed client; call "
            f"jax.distributed.initialize(...) in every process before barrier_sync."
        )
    return client
