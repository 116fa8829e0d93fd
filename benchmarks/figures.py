"""The figures the README and the site cite, rendered from their one record, ``benchmarks/figures.toml``.

    python benchmarks/figures.py            # print the tables
    python benchmarks/figures.py --write    # put the CPU table into README.md (between its markers)

The site's build calls :func:`table` for the performance page; ``tests/package/test_figures.py`` fails when
README.md shows anything else, or when a figure's record is not a section of ``RESULTS.md`` of its date.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RECORD = HERE / "figures.toml"
README = HERE.parent / "README.md"
BEGIN = "<!-- figures: generated from benchmarks/figures.toml by `python benchmarks/figures.py --write` -->"
END = "<!-- end of figures -->"


def load() -> dict[str, Any]:
    """The record: ``machines`` (name -> description) and ``figure`` (a list of dicts)."""
    with RECORD.open("rb") as f:
        return tomllib.load(f)


def table(machine: str, record: dict[str, Any] | None = None) -> str:
    """The Markdown table of the figures measured on ``machine`` (a key of ``[machines]``)."""
    record = record or load()
    rows = [
        "| question | nnx_shard | baseline | measured | command |",
        "|---|---|---|---|---|",
    ]
    for f in record["figure"]:
        if f["machine"] == machine:
            rows.append(
                f"| {f['question']} | {f['nnx_shard']} | {f['baseline']} | {f['date']} | `{f['command']}` |"
            )
    return f"On {record['machines'][machine]}:\n\n" + "\n".join(rows) + "\n"


def readme_block(record: dict[str, Any] | None = None) -> str:
    """What README.md holds between its markers: the CPU figures."""
    return f"{BEGIN}\n{table('cpu', record)}{END}"


def write_readme() -> bool:
    """Rewrites README.md's figures block; True when it changed."""
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + readme_block() + text[end:]
    README.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="put the CPU table into README.md")
    args = parser.parse_args(argv)
    if args.write:
        print("README.md", "updated" if write_readme() else "already up to date")
        return 0
    record = load()
    for machine in record["machines"]:
        print(table(machine, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
