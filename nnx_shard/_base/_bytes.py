"""Bytes and tables in words (and sizes read back from words): the one format every report and error
prints."""

from __future__ import annotations

import re
from collections.abc import Sequence

from nnx_shard.errors import ConfigError


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


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(budget: int | float | str) -> int:
    """``"16GiB"`` -> ``17179869184``; ``"512 MB"``, ``2**30`` and ``"1.5G"`` (binary) work too.

    >>> parse_bytes("16GiB"), parse_bytes("512MB"), parse_bytes(1024)
    (17179869184, 512000000, 1024)
    """
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0:
        return int(budget)
    m = _SIZE.match(budget) if isinstance(budget, str) else None
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(
            "a memory budget is a number of bytes or a size such as '16GiB', '512MB' or '1.5G'; got "
            f"{budget!r}."
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
