"""make chaos: a seeded campaign of kills and damaged checkpoints; counts go to RESULTS.md.

Every trial restarts the job with ``resume="auto"`` and judges the outcome:
recovered bitwise, a named error, wrong values (must be 0; a silent start from
scratch while a usable checkpoint exists counts here), or a hang.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.apps.chaos_app import campaign  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results, counts = campaign(Path(tmp), trials=args.trials, seed=args.seed)
    counts["seconds"] = round(time.perf_counter() - start, 1)
    by_kind = collections.Counter(
        f"{' '.join(r['trial'].split(' ')[:2])}{' (every step)' if 'every step' in r['trial'] else ''}: {r['outcome']}"
        for r in results
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"counts": counts, "by_kind": by_kind, "results": results}, indent=1)
    )
    print(json.dumps(counts))
    for line, n in sorted(by_kind.items()):
        print(f"  {n:3d}  {line}")
    section = (
        f"\n## make chaos ({datetime.date.today()}, {platform.machine()}, {args.trials} trials, seed {args.seed})\n\n"
        "| trials | recovered bitwise | named errors | wrong values | unnamed errors | hangs | max stderr lines | seconds |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {counts['trials']} | {counts['recovered_bitwise']} | {counts['named_errors']} | {counts['wrong_values']} "
        f"| {counts['unnamed_errors']} | {counts['hangs']} | {counts['max_stderr_lines']} | {counts['seconds']} |\n\n"
        + "\n".join(f"- {line}: {n}" for line, n in sorted(by_kind.items()))
        + "\n"
    )
    with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
        f.write(section)
    if counts["wrong_values"] or counts["hangs"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
