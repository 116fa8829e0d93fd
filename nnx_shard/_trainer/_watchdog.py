"""Hangs become failures: a section of the run (startup, a step, a save) that overruns its time ends the
process.

A peer that dies mid-collective leaves the survivors waiting inside XLA,
where no Python exception can reach them. A daemon thread watches the
deadline of the section the loop is in; past it, it prints one line naming
the section, the step, the config key and, where JAX's coordination service
answers, the processes it no longer hears from; then it ends the process
with status 124 (as ``timeout(1)`` does), so that a launcher or scheduler
can restart the job.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import jax

from nnx_shard._cluster import Keys, KeyValueStore
from nnx_shard.errors import DistributedNotInitializedError

logger = logging.getLogger("nnx_shard")
EXIT_STATUS = 124
POLL_S = 0.2
ASK_S = 3.0  # how long the coordination service may take to say who is alive


def _enter(what: str) -> None:
    """Records in the coordination service that this process entered ``what`` (one small RPC)."""
    try:
        KeyValueStore().set(f"{Keys.WATCHDOG}{jax.process_index()}", what)
    except (DistributedNotInitializedError, RuntimeError) as e:  # the timeout still ends a hang
        logger.debug("could not record the section %r: %s", what, e)


def missing_processes(what: str) -> str:
    """Which processes never entered section ``what``, from JAX's coordination service ("" with one process).

    Each process records the section it enters (:meth:`Watchdog.arm`); read
    from a thread with a deadline, since a dead coordinator never answers.
    """
    n = jax.process_count()
    if n == 1:
        return ""
    answer: dict[str, Any] = {}

    def ask() -> None:
        try:
            answer["at"] = KeyValueStore().directory(Keys.WATCHDOG)
        except (DistributedNotInitializedError, RuntimeError) as e:  # XlaRuntimeError is a RuntimeError
            answer["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(ASK_S)
    if "at" not in answer:
        why = answer.get("error", f"no answer within {ASK_S:g} s")
        return f"; the coordination service (process 0) does not answer ({why}): it may be the one lost"
    at = {int(k.rstrip("/").rsplit("/", 1)[-1]): v for k, v in answer["at"].items()}
    behind = [f"process {p} is still in {at.get(p, 'its startup')}" for p in range(n) if at.get(p) != what]
    return "; " + ", ".join(behind) if behind else f"; all {n} processes entered it: one is hung inside"


class Watchdog:
    """One armed section at a time; ``arm`` replaces it, ``disarm`` ends it.

    >>> dog = Watchdog()
    >>> dog.arm("step 3", 0, "step_timeout")  # 0: no limit
    >>> dog.armed is None
    True
    """

    def __init__(self) -> None:
        self.armed: tuple[str, float, str, float] | None = None  # (what, seconds, key, deadline)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self, what: str, seconds: float, key: str) -> None:
        """Watches ``what`` for ``seconds`` (0: unwatched) from now."""
        with self._lock:
            self.armed = (what, seconds, key, time.monotonic() + seconds) if seconds and seconds > 0 else None
        if self.armed is not None and jax.process_count() > 1:
            _enter(what)
        if self.armed is not None and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="nnx_shard-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self.armed = None

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                armed = self.armed
            if armed is not None and time.monotonic() > armed[3]:
                what, seconds, key, _ = armed
                where = f"process {jax.process_index()} of {jax.process_count()}"
                message = (
                    f"nnx_shard: {what} did not finish within {seconds:g} s (config.{key}) in {where}"
                    f"{missing_processes(what)}: a peer may have died or hung. Ending this process (exit "
                    f"status {EXIT_STATUS}) so "
                    "that the job can be restarted; resume='auto' goes on from the newest snapshot or "
                    "checkpoint.\n"
                )
                os.write(sys.stderr.fileno(), message.encode())
                os._exit(EXIT_STATUS)
