"""The one place nnx_shard reaches into JAX's private modules: the coordination-service client, one
workaround for tracing a model's construction, and JAX's threefry kernel scoped to one lowering.

``barrier_sync`` needs the distributed client's key-value store and barriers,
which JAX does not export. Everything else in the package uses public JAX.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from nnx_shard.errors import DistributedNotInitializedError


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


@contextlib.contextmanager
def abstract_construction() -> Iterator[None]:
    """While a model is built abstractly (``nnx.eval_shape``): no origin message for tracer attribute errors.

    flax probes ``getattr(value, "sharding", None)`` on every RNG-counter update;
    on a tracer, jax 0.10 answers with an AttributeError whose message walks
    the whole trace so far (``find_progenitors``), and ``getattr`` then drops
    it. An 80-layer model paid that 1,446 times: 8-10 s of a 70B plan, growing
    with the square of the depth. The message is never shown, so it is not
    built; newer jax no longer builds it eagerly either.
    """
    try:
        from jax._src.interpreters import partial_eval as pe
    except ImportError:  # pragma: no cover - moved in a future JAX
        yield
        return
    cls = getattr(pe, "DynamicJaxprTracer", None)
    original = getattr(cls, "_origin_msg", None)
    if original is None:
        yield
        return
    cls._origin_msg = lambda self: ""
    try:
        yield
    finally:
        cls._origin_msg = original


@contextlib.contextmanager
def threefry_kernel(platform: str) -> Iterator[None]:
    """On GPUs, lowers threefry (``jax.random``) to JAX's own kernel while this context is open; elsewhere
    nothing.

    XLA's GPU compile of the inlined threefry hash takes minutes for a model of
    200 arrays (ViT-B's init: > 140 s on an H200, 4.5 s with the kernel, which
    computes the same bits). The flag is ``jax_threefry_gpu_kernel_lowering``,
    part of jit's cache key and trace context, and read when a program is
    lowered; here it holds for the lowerings inside the context only, so no
    setting of the user's changes after the call. JAX exports it only as a
    global ``jax.config`` option, hence this private reach.
    """
    if platform != "gpu":
        yield
        return
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - moved in a future JAX
        yield
        return
    flag = getattr(config, "threefry_gpu_kernel_lowering", None)
    if flag is None:  # pragma: no cover - renamed in a future JAX
        yield
        return
    with flag(True):
        yield
