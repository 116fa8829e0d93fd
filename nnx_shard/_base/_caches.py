"""The one owner of nnx_shard's process-wide caches: compiled programs, plans of repeated signatures.

Every module-level cache is made with :func:`cached`, so :func:`clear_caches`
empties them all at once (in tests, or to free the compiled programs of a
mesh that is gone). Anything else that holds process state (the listener for
JAX's compile events) registers a ``clear`` callback here too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_CACHES: list[Any] = []
_CLEARERS: list[Callable[[], None]] = []


def cached(maxsize: int | None = 256) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered for :func:`clear_caches`."""

    def deco(fn: F) -> F:
        wrapped = functools.lru_cache(maxsize=maxsize)(fn)
        _CACHES.append(wrapped)
        return wrapped  # type: ignore[return-value]

    return deco


def on_clear(fn: Callable[[], None]) -> Callable[[], None]:
    """Registers ``fn`` to run in :func:`clear_caches` (process state that is not an ``lru_cache``)."""
    _CLEARERS.append(fn)
    return fn


def clear_caches() -> int:
    """Empties every cache nnx_shard keeps in this process and removes its JAX listeners; returns how many
    cached entries were dropped. Compiled programs are rebuilt on next use.

    >>> import jax, nnx_shard as ns
    >>> _ = ns.plan_reshard(jax.numpy.zeros(8), jax.sharding.SingleDeviceSharding(jax.devices()[1]))
    >>> ns.clear_caches() >= 0, ns.clear_caches()
    (True, 0)
    """
    dropped = sum(c.cache_info().currsize for c in _CACHES)
    for c in _CACHES:
        c.cache_clear()
    for fn in _CLEARERS:
        fn()
    return dropped
