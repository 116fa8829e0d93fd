"""Work split over one thread per core, each thread given about equal bytes; a thread that runs jobs in
turn."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def balanced_shares(sizes: Sequence[int], workers: int) -> list[list[int]]:
    """Indices into ``sizes`` split into ``workers`` lists of about equal total size (largest first,
    each to the least loaded list)."""
    shares: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        least = load.index(min(load))
        shares[least].append(k)
        load[least] += sizes[k]
    return shares


def in_threads(work: Callable[[int], T], sizes: Sequence[int], *, serial_below: int = 0) -> list[T]:
    """``[work(k) for k in range(len(sizes))]``, run in one thread per core (NumPy lets go of the GIL
    while it copies or sums), each thread given items of about equal ``sizes``; in this thread when there
    is one core or the sizes add up to less than ``serial_below``."""
    workers = min(os.cpu_count() or 1, len(sizes))
    if workers <= 1 or sum(sizes) < serial_below:
        return [work(k) for k in range(len(sizes))]
    results: list[T | None] = [None] * len(sizes)

    def run(share: list[int]) -> None:
        for k in share:
            results[k] = work(k)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for done in [pool.submit(run, share) for share in balanced_shares(sizes, workers)]:
            done.result()
    return results  # type: ignore[return-value]


class Worker:
    """A daemon thread, started with a job, that runs the jobs handed to it one after another and ends
    once it has had none for ``idle_s`` seconds.

    Handing it a job costs a queue put. Starting a thread per job costs the caller
    more: ``Thread.start()`` returns once the new thread has run, and when that
    thread begins with Python work, the caller then waits up to the interpreter's
    switch interval (5 ms) for the GIL. A job that raises ends the thread (the
    exception is printed, as a thread's); the jobs after it run on another.

    >>> worker = Worker("example")
    >>> ran = []
    >>> done = worker.submit(ran.append, 1)
    >>> done.wait(5), ran
    (True, [1])
    """

    def __init__(self, name: str, idle_s: float = 10.0) -> None:
        self.name = name
        self.idle_s = idle_s
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> threading.Event:
        """Queues ``fn(*args)``; the event is set once it has returned or raised."""
        done = threading.Event()
        with self._lock:
            self._jobs.put((fn, args, done))
            if self._thread is None:
                self._start()
        return done

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    fn, args, done = self._jobs.get(timeout=self.idle_s)
                except queue.Empty:
                    if self._jobs.empty():
                        return
                    continue
                try:
                    fn(*args)
                finally:
                    done.set()
        finally:  # idle, or a job raised: a job queued meanwhile gets a thread of its own
            with self._lock:
                self._thread = None
                if not self._jobs.empty():
                    self._start()
