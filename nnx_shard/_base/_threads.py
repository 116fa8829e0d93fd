"""Work split over one thread per core, each thread given about equal bytes."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

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
