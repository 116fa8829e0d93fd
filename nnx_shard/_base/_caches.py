"""The one owner of nnx_shard's process-wide caches: compiled programs, plans of repeated signatures.

Every module-level cache is made with :func:`cached`, so :func:`clear_caches`
empties them all at once (in tests, or to free the compiled programs of a
mesh that is gone). The one other piece of process state, the listener for
JAX's compile events (:data:`COMPILE_CLOCK`), is owned here too: started
explicitly, stopped by :func:`clear_caches`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])
_CACHES: list[Any] = []


def cached(maxsize: int | None = 256) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered for :func:`clear_caches`."""

    def deco(fn: F) -> F:
        wrapped = functools.lru_cache(maxsize=maxsize)(fn)
        _CACHES.append(wrapped)
        return wrapped  # type: ignore[return-value]

    return deco


class CompileClock:
    """Seconds JAX spends compiling in this process, from its monitoring events, while started.

    Reading :attr:`seconds` registers nothing; :meth:`start` adds the listener
    (once) and :meth:`stop` (or :func:`clear_caches`) removes it.

    >>> clock = CompileClock()
    >>> clock.listening, clock.seconds
    (False, 0.0)
    >>> clock.start(); _ = jax.jit(lambda x: x * 3)(1.0); clock.stop()
    >>> clock.listening, clock.seconds > 0
    (False, True)
    """

    def __init__(self) -> None:
        self._seconds = 0.0
        self._listening = False
        self._lock = threading.Lock()

    @property
    def seconds(self) -> float:
        """The compile seconds counted while started (it keeps counting across starts)."""
        return self._seconds

    @property
    def listening(self) -> bool:
        return self._listening

    def _listen(self, name: str, seconds: float, **kwargs: Any) -> None:
        if name.startswith("/jax/core/compile/"):
            self._seconds += seconds

    def start(self) -> None:
        """Listens to JAX's compile events (a second call does nothing)."""
        with self._lock:
            if not self._listening:
                jax.monitoring.register_event_duration_secs_listener(self._listen)
                self._listening = True

    def stop(self) -> None:
        """Removes the listener (a stopped clock does nothing)."""
        with self._lock:
            if self._listening:
                jax.monitoring.unregister_event_duration_listener(self._listen)
                self._listening = False


COMPILE_CLOCK = CompileClock()  # the process's one listener: started by the Trainer, stopped by clear_caches


def clear_caches() -> int:
    """Empties every cache nnx_shard keeps in this process and removes its JAX listeners; returns how many
    cached entries were dropped. Compiled programs are rebuilt on next use.

    >>> import jax, nnx_shard as ns
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    >>> _ = ns.resharding.plan_reshard(jax.numpy.zeros(8), one)
    >>> ns.clear_caches() >= 0, ns.clear_caches()
    (True, 0)
    """
    dropped = sum(c.cache_info().currsize for c in _CACHES)
    for c in _CACHES:
        c.cache_clear()
    COMPILE_CLOCK.stop()
    return dropped
