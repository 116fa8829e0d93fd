"""Where a piece of work's seconds went, phase by phase."""

from __future__ import annotations

import time


class Laps(dict):
    """Seconds by phase: each :meth:`lap` adds the time since the one before (or since it was made).

    >>> laps = Laps()
    >>> laps.lap("layout"); laps.lap("copy"); laps.lap("layout")
    >>> list(laps), all(v >= 0 for v in laps.values())
    (['layout', 'copy'], True)
    """

    def __init__(self) -> None:
        super().__init__()
        self._at = time.perf_counter()

    def lap(self, name: str) -> None:
        """Adds the seconds since the last lap to ``name``'s."""
        now = time.perf_counter()
        self[name] = self.get(name, 0.0) + now - self._at
        self._at = now
