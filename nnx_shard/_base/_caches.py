"""The one owner of nnx_shard's process-wide caches: compiled programs, plans of repeated signatures.

Every module-level cache is made with :func:`cached`, so :func:`clear_caches`
empties them all at once (in tests, or to free the compiled programs of a
mesh that is gone). The one other piece of process state, the listener for
JAX's compile events (:data:`COMPILE_CLOCK`), is owned here too: started
explicitly, stopped by :func:`clear_caches`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])
_CACHES: list[Any] = []
_AHEAD: list[CompiledAhead] = []
logger = logging.getLogger("nnx_shard")


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


class CompiledAhead:
    """Programs compiled in a background thread, by key, for calls that come later.

    An executable from ``jit(f).lower(...).compile()`` is not in jit's own
    cache (a jit call would compile again), so what is compiled ahead is kept
    here, for the process, and :func:`clear_caches` empties it too.

    >>> ahead = CompiledAhead("doubling")
    >>> sds = jax.ShapeDtypeStruct((4,), jax.numpy.float32)
    >>> ahead.start({"x4": (jax.jit(lambda x: x * 2), (sds,))}).join()
    >>> ahead.get("x4")(jax.numpy.ones(4)).tolist(), ahead.get("other"), len(ahead)
    ([2.0, 2.0, 2.0, 2.0], None, 1)
    """

    def __init__(self, what: str) -> None:
        self.what = what  # named in the log line each batch of compiles ends with
        self._done: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        _AHEAD.append(self)

    def __len__(self) -> int:
        return len(self._done)

    def get(self, key: Hashable) -> Any:
        """The executable compiled for ``key``, or None (not asked for, or still compiling)."""
        with self._lock:
            return self._done.get(key)

    def start(self, work: Mapping[Hashable, tuple[Any, tuple[Any, ...]]]) -> threading.Thread | None:
        """Compiles ``{key: (jitted, abstract args)}`` in a thread (XLA lets go of the GIL), the keys not
        compiled already; returns the thread, or None when there is nothing to compile."""
        with self._lock:
            todo = {k: v for k, v in work.items() if k not in self._done}
        if not todo:
            return None

        def run() -> None:
            start = time.perf_counter()
            for key, (jitted, args) in todo.items():
                compiled = jitted.lower(*args).compile()
                with self._lock:
                    self._done[key] = compiled
            seconds = time.perf_counter() - start
            logger.info("compiled %d %s programs ahead in %.3f s", len(todo), self.what, seconds)

        thread = threading.Thread(target=run, daemon=True, name=f"nnx_shard-{self.what}-compile")
        thread.start()
        return thread

    def clear(self) -> int:
        with self._lock:
            dropped, self._done = len(self._done), {}
        return dropped


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
    dropped = sum(c.cache_info().currsize for c in _CACHES) + sum(a.clear() for a in _AHEAD)
    for c in _CACHES:
        c.cache_clear()
    COMPILE_CLOCK.stop()
    return dropped
