"""Collectives between processes that cannot cross, and a flight recorder of the ones each process issued.

JAX pairs the collectives of several processes by the program they run, not by
what the caller meant: two small allgathers of the same shape answer each other
whatever their purpose. So every small allgather here is one program, an
``int32[16]`` row, that carries ``[site, sequence, step]`` before its values;
after gathering, every process compares the rows it got, and a difference is a
:class:`~nnx_shard.errors.CollectiveMismatchError` on every process (each got
the same rows), naming the site each process was at, never a silent answer.

The flight recorder keeps each process's last collectives (site, sequence,
step, shape, when it entered and left), as PyTorch's does for NCCL: a mismatch
or a step timeout writes them to a file beside the error, and the error names
the first collective at which the processes' records part. Collectives issued
from a thread of their own (a snapshot's copy to its peer) are numbered in a
stream of their own, so that the main thread's numbers agree across processes
however the two threads interleave.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from nnx_shard.errors import CollectiveMismatchError

WIDTH = 16  # int32 entries in every small allgather's row
HEAD = 4  # site, sequence, step, how many values
MAX_VALUES = (WIDTH - HEAD) // 2  # each value travels as two 31-bit halves (int32 without jax_enable_x64)
FLIGHT_DIR = "NNX_SHARD_FLIGHT_DIR"  # where flight records go (the temp folder by default)
MAIN = "main"  # the stream of the collectives the caller's thread issues
_SITES: dict[int, str] = {}


def site_id(site: str) -> int:
    """A site's number in the rows (31 bits of its name's CRC-32), remembered to name it back."""
    number = zlib.crc32(site.encode()) & 0x7FFFFFFF
    _SITES[number] = site
    return number


@dataclasses.dataclass
class Entry:
    """One collective this process issued: where, its number among them, the step, its shape, its times."""

    site: str
    sequence: int
    step: int
    shape: tuple[int, ...]
    entered: float
    left: float | None = None
    stream: str = MAIN

    def named(self) -> str:
        on = "" if self.stream == MAIN else f" on the {self.stream} thread"
        return f"#{self.sequence} {self.site!r} at step {self.step}{on}"


class FlightRecorder:
    """This process's last ``size`` collectives, and optionally a journal of every one, by stream.

    >>> recorder = FlightRecorder(size=2)
    >>> with recorder.entered("demo", 3, (2,)):
    ...     pass
    >>> [(e.site, e.step, e.shape, e.sequence) for e in recorder.entries()], recorder.waiting()
    ([('demo', 3, (2,), 0)], None)
    """

    def __init__(self, size: int = 64):
        self._entries: collections.deque[Entry] = collections.deque(maxlen=size)
        self._lock = threading.Lock()
        self._issued: collections.Counter[str] = collections.Counter()  # collectives so far, by stream
        self.journal: dict[str, list[tuple[str, int, tuple[int, ...]]]] | None = None

    def keep_journal(self) -> None:
        """From now on, each collective's ``(site, step, shape)`` goes to ``journal[stream]`` (tests)."""
        self.journal = {}

    @contextlib.contextmanager
    def entered(self, site: str, step: int, shape: tuple[int, ...], stream: str = MAIN) -> Iterator[Entry]:
        """Records a collective from its start to its end (``left`` stays None while it waits); ``stream``
        numbers the collectives of a thread of their own apart from the main thread's."""
        with self._lock:
            entry = Entry(site, self._issued[stream], int(step), tuple(shape), time.time(), stream=stream)
            self._issued[stream] += 1
            self._entries.append(entry)
            if self.journal is not None:
                self.journal.setdefault(stream, []).append((site, int(step), tuple(shape)))
        yield entry
        entry.left = time.time()

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries)

    def waiting(self) -> Entry | None:
        """The collective this process is inside now, if any: the main thread's, else another stream's."""
        inside = [e for e in self.entries() if e.left is None]
        return next((e for e in reversed(inside) if e.stream == MAIN), inside[-1] if inside else None)

    def as_json(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(e) for e in self.entries()]

    def dump(self, why: str) -> str:
        """Writes the entries and ``why`` to ``nnx_shard-flight-process-<i>-<pid>.json`` in
        ``$NNX_SHARD_FLIGHT_DIR`` (the temp folder by default); returns its path."""
        folder = os.environ.get(FLIGHT_DIR) or tempfile.gettempdir()
        path = os.path.join(folder, f"nnx_shard-flight-process-{jax.process_index()}-{os.getpid()}.json")
        record = {"process": jax.process_index(), "why": why, "collectives": self.as_json()}
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=1)
        except OSError as e:  # the error it goes with matters more than the file
            return f"(not written: {e})"
        return path


RECORDER = FlightRecorder()


def recorded(site: str, step: int, shape: Sequence[int], stream: str = MAIN) -> Any:
    """A context that records a collective issued some other way (a ``ppermute``, an array allgather)."""
    return RECORDER.entered(site, step, tuple(shape), stream)


def _halves(values: Sequence[int]) -> list[int]:
    out = []
    for v in values:
        v = int(v)
        if not 0 <= v < 2**62:
            raise ValueError(f"a collective's value must be in [0, 2**62); got {v}")
        out += [v >> 31, v & 0x7FFFFFFF]
    return out


def agree(site: str, values: Sequence[int], *, step: int = -1) -> np.ndarray:
    """Every process's ``values`` (up to 6 integers in ``[0, 2**62)``), one row per process in process
    order: a collective of every process, checked.

    Raises:
      CollectiveMismatchError: the processes were not all at this site, with this sequence number and step.

    >>> agree("doc", [3, 2**40], step=5)  # one process
    array([[          3, 1099511627776]])
    """
    if len(values) > MAX_VALUES:
        raise ValueError(f"agree() carries at most {MAX_VALUES} values; {site!r} gave {len(values)}")
    n, halves = jax.process_count(), _halves(values)
    with RECORDER.entered(site, step, (len(values),)) as entry:
        if n == 1:
            return np.asarray([[int(v) for v in values]], np.int64)
        row = np.zeros(WIDTH, np.int32)
        row[:HEAD] = [site_id(site), entry.sequence & 0x7FFFFFFF, max(step, -1), len(values)]
        row[HEAD : HEAD + len(halves)] = halves
        rows = np.asarray(multihost_utils.process_allgather(row)).reshape(n, WIDTH).astype(np.int64)
    if (rows[:, :HEAD] != rows[jax.process_index(), :HEAD]).any():
        raise _mismatch(rows, site, entry)
    got = rows[:, HEAD : HEAD + len(halves)]
    return (got[:, 0::2] << 31) | got[:, 1::2]


def _mismatch(rows: np.ndarray, site: str, entry: Entry) -> CollectiveMismatchError:
    at = [
        f"process {p}: {_SITES.get(int(r[0]), f'an unknown site {int(r[0]):#x}')!r} "
        f"(collective #{int(r[1])}, step {int(r[2])})"
        for p, r in enumerate(rows)
    ]
    first = min(int(r[1]) for r in rows)
    path = RECORDER.dump(f"mismatch at {entry.named()}")
    return CollectiveMismatchError(
        f"the processes were at different collectives when they gathered at {site!r}: {'; '.join(at)}. "
        f"They parted at or before collective #{first}: one process issued a collective the others did "
        f"not (a decision taken from its own view). This process's last collectives are in {path}."
    )


def first_divergence(records: dict[int, list[dict[str, Any]]]) -> str:
    """The first collective at which the processes' flight records (``{process: entries}``) part, in words.

    >>> a = [{"sequence": 0, "site": "x", "step": 1, "left": 1.0}, {"sequence": 1, "site": "y", "step": 2,
    ...      "left": None}]
    >>> b = [{"sequence": 0, "site": "x", "step": 1, "left": 1.0}, {"sequence": 1, "site": "z", "step": 2,
    ...      "left": None}]
    >>> first_divergence({0: a, 1: b})
    "collective #1: process 0 at 'y' (step 2, waiting), process 1 at 'z' (step 2, waiting)"
    """
    by_key: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for p, entries in records.items():
        for e in entries:
            by_key.setdefault((e.get("stream", MAIN), int(e["sequence"])), {})[p] = e
    for stream in sorted({s for s, _ in by_key}, key=lambda s: (s != MAIN, s)):  # the main thread's first
        held = [[q for (s, q) in by_key if s == stream and p in by_key[s, q]] for p in records]
        first = max((min(seqs) for seqs in held if seqs), default=0)  # what every record still holds
        for seq in sorted(q for s, q in by_key if s == stream and q >= first):
            seen = by_key[stream, seq]
            if len({(e["site"], e["step"]) for e in seen.values()}) == 1 and len(seen) == len(records):
                continue
            parts = []
            for p in sorted(records):
                e = seen.get(p)
                if e is None:
                    parts.append(f"process {p} never issued it")
                else:
                    state = "waiting" if e["left"] is None else "done"
                    parts.append(f"process {p} at {e['site']!r} (step {e['step']}, {state})")
            on = "" if stream == MAIN else f" on the {stream} thread"
            return f"collective #{seq}{on}: " + ", ".join(parts)
    return "none: the processes issued the same collectives"
