"""Notes: why a leaf stayed replicated (and other soft findings), each of a kind that says how it is
logged."""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any


class NoteKind(enum.Enum):
    """What a note says, which decides how planning logs it: ``(level or None, leaves left replicated)``."""

    SCALAR = (None, True)  # a scalar: nothing to shard
    SKIPPED = (None, False)  # a tactic passed over a leaf it cannot apply to (ignore_ndim_error)
    NO_RULE = (logging.INFO, True)  # no rule matched the leaf (strict=False)
    BELOW_MIN_SIZE = (logging.INFO, True)  # fsdp: smaller than min_size_to_shard_mb
    NO_DIVISIBLE_DIM = (logging.WARNING, True)  # fsdp: no free dimension divides by the axis size
    NO_ANNOTATION = (logging.WARNING, True)  # annotated: the leaf carries no sharding annotation
    TRIMMED = (logging.INFO, False)  # a spec longer than the leaf's rank was trimmed to it
    KEPT_WHOLE = (logging.INFO, False)  # a stacked layer axis kept whole
    EXPLICIT_AXES = (logging.INFO, False)  # the plan: Explicit mesh axes shard leaves

    @property
    def level(self) -> int | None:
        """The logging level planning logs it at (None: not logged)."""
        return self.value[0]

    @property
    def replicates(self) -> bool:
        """True when the note says the leaf was left replicated."""
        return self.value[1]


class Note(str):
    """A note's text (a ``str``, as the plan prints it) with its :class:`NoteKind`.

    >>> note = Note(NoteKind.BELOW_MIN_SIZE, "fsdp: replicated, 64 bytes is below min_size_to_shard_mb=4")
    >>> note.kind.replicates, "below" in note
    (True, True)
    """

    kind: NoteKind

    def __new__(cls, kind: NoteKind, text: str) -> Note:
        note = super().__new__(cls, text)
        note.kind = kind
        return note

    def __reduce__(self) -> Any:
        return (Note, (self.kind, str(self)))


@dataclasses.dataclass(frozen=True)
class Noted:
    """What a tactic returns when it has something to say: the spec, and the notes explaining it.

    A tactic returns a plain spec, or ``Noted(spec, notes)``; :func:`split_noted` takes either.
    """

    spec: Any
    notes: tuple[Note, ...]


def noted(spec: Any, notes: tuple[Note, ...] | list[Note]) -> Any:
    """``spec`` alone when there is nothing to say, else a :class:`Noted`."""
    return Noted(spec, tuple(notes)) if notes else spec


def split_noted(result: Any) -> tuple[Any, tuple[Note, ...]]:
    """A tactic's result as ``(spec, notes)``."""
    return (result.spec, result.notes) if isinstance(result, Noted) else (result, ())
