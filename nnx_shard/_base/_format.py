"""Bytes and tables in words: the one format every report and error prints."""

from __future__ import annotations

from collections.abc import Sequence


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, the last one (free text) left as it is: the one table format.

    >>> print(format_table([("path", "size", "notes"), ("a/kernel", "4 B", "")]))
    path      size  notes
    a/kernel  4 B
    """
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]).rstrip() for r in rows
    )
