"""The chaos suite: training processes killed at ten points, checkpoints damaged in twelve ways, each
restarted.

Each trial must end in an exact recovery (the final state bitwise equal to an
uninterrupted run's) or a named nnx_shard error: never wrong values, never a
silent start from scratch while a usable checkpoint exists, never a hang.
``make chaos`` runs a longer seeded campaign (benchmarks/chaos.py).
"""

from __future__ import annotations

from tests.apps.chaos_app import DAMAGE, KILL_POINTS, campaign


def test_every_kill_point_and_every_damage_recovers_exactly_or_names_the_fault(tmp_path):
    results, counts = campaign(tmp_path, seed=0)
    assert counts["trials"] == len(KILL_POINTS) - 1 + len(DAMAGE) + 1 >= 20
    report = "\n".join(f"{r['trial']}: {r['outcome']} ({r['last']})" for r in results)
    assert counts["wrong_values"] == 0 and counts["hangs"] == 0 and counts["unnamed_errors"] == 0, report
    killed = [r for r in results if r["trial"].startswith("kill")]
    assert sum(r["killed"] for r in killed) >= 8, report  # the kills really happened
    newest = [r for r in results if r["trial"].startswith("damage") and "every step" not in r["trial"]]
    assert all(r["outcome"] == "recovered" and r["restored"] == 9 for r in newest), report
    every = [r for r in results if "every step" in r["trial"]]
    assert every and all(
        r["outcome"] == "named_error" and r["error"] == "nnx_shard.errors.CheckpointCorruptError"
        for r in every
    )
    assert counts["max_stderr_lines"] <= 20, report
