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

import json
import logging
import os
import sys
import threading
import time
from typing import Any

import jax

from nnx_shard._cluster import RECORDER, Keys, KeyValueStore, first_divergence
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


def flight_report(what: str) -> tuple[str, set[int]]:
    """This process's flight record (its last collectives) written to a file, and, from the records every
    process that also timed out left in the coordination service within ``ASK_S``, the first collective at
    which they part; in words, for the timeout's message, with the processes heard from."""
    path = RECORDER.dump(f"{what} timed out")
    waiting = RECORDER.waiting()
    inside = f"inside collective {waiting.named()}" if waiting is not None else "in no collective"
    report = f"; this process is {inside} (its last collectives: {path})"
    n = jax.process_count()
    if n == 1:
        return report, set()
    mine = [{k: e[k] for k in ("sequence", "site", "step", "left", "stream")} for e in RECORDER.as_json()]
    records: dict[int, Any] = {}

    def exchange() -> None:
        try:
            store, me = KeyValueStore(), jax.process_index()
            store.set(f"{Keys.FLIGHT}{me}", json.dumps(mine))
            deadline = time.monotonic() + ASK_S
            while time.monotonic() < deadline and len(records) < n:
                for key, value in store.directory(Keys.FLIGHT).items():
                    records[int(key.rstrip("/").rsplit("/", 1)[-1])] = json.loads(value)
                time.sleep(POLL_S)
        except (DistributedNotInitializedError, RuntimeError, ValueError) as e:
            logger.debug("could not exchange flight records: %s", e)

    thread = threading.Thread(target=exchange, daemon=True)
    thread.start()
    thread.join(ASK_S + 1)
    if len(records) < 2:
        return report + "; no other process's record came within the deadline", set(records)
    heard = ", ".join(str(p) for p in sorted(records))
    return report + f"; of processes {heard}, the records part at {first_divergence(dict(records))}", set(
        records
    )


def leave_together(heard: set[int]) -> None:
    """After this process's message: it says so in the coordination service, and process 0, whose end ends
    the service and every other process with it, waits (up to ``ASK_S``) until each process it heard from
    has written its own."""
    if len(heard) < 2:
        return

    def wait() -> None:
        try:
            store = KeyValueStore()
            store.set(f"{Keys.FLIGHT_DONE}{jax.process_index()}", "1")
            deadline = time.monotonic() + ASK_S
            while jax.process_index() == 0 and time.monotonic() < deadline:
                if len(store.directory(Keys.FLIGHT_DONE)) >= len(heard):
                    return
                time.sleep(POLL_S)
        except (DistributedNotInitializedError, RuntimeError) as e:
            logger.debug("could not wait for the other processes' messages: %s", e)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(ASK_S + 1)


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
                report, heard = flight_report(what)
                message = (
                    f"nnx_shard: {what} did not finish within {seconds:g} s (config.{key}) in {where}"
                    f"{missing_processes(what)}{report}: a peer may have died or hung. Ending "
                    f"this process (exit status {EXIT_STATUS}) so that the job can be restarted; "
                    "resume='auto' goes on from the newest snapshot or checkpoint.\n"
                )
                os.write(sys.stderr.fileno(), message.encode())
                leave_together(heard)
                os._exit(EXIT_STATUS)
