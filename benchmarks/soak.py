"""The multi-process snapshot, restart and rollback tests, run again and again beside a CPU hog on every core.

A hang that shows once in many full runs under load is what this looks for: each round runs the tests below
in one pytest (per-test timeout ``--timeout``), while one busy process per core competes for the CPUs. Each
test run is counted as passed, hung (pytest-timeout's, or a watchdog's exit naming the section and the
collective it was in; or a passed run whose job stalled: its output shows a step timeout or the app's stack
dump), wrong (an assertion failed: a value differs) or failed otherwise. Reports the counts and the slowest
run of each test.

    python benchmarks/soak.py [--runs 30] [--timeout 600] [--out results/soak.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from common import machine, save_json, write_json

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    # snapshots across processes
    "tests/snapshots/test_writer.py::test_each_process_holds_its_shards_and_a_peers_and_together_they_make_the_state",
    "tests/snapshots/test_writer.py::test_processes_issue_the_same_collectives_whatever_one_of_them_is_slow_at",
    "tests/snapshots/test_writer.py::test_the_copy_to_the_peer_never_crosses_a_steps_ppermute_over_the_same_devices",
    "tests/snapshots/test_reader.py::test_a_snapshot_restores_onto_more_processes_than_it_had",
    # restarts from snapshots, on fewer processes
    "tests/cluster/test_launch.py::test_kill_9_restarts_on_the_survivor_from_snapshots_and_matches_an_uninterrupted_run",
    "tests/cluster/test_launch.py::test_losing_process_0_of_3_restarts_on_2_from_snapshots_without_a_checkpoint",
    "tests/cluster/test_launch.py::test_a_restart_on_fewer_processes_reads_each_example_once_from_where_the_run_stopped",
    # a rollback, then a restart
    "tests/cluster/test_launch.py::test_a_restart_after_a_rollback_resumes_the_branch_not_the_snapshots_of_the_one_it_left",
]
HUNG = ("Timeout", "did not finish within")
# in what a passed run printed: a job that stalled (a step timeout, or the app's stacks after 40 s without a
# step) and was restarted, so that the test still passed; counted as hung
STALLED = ("Timeout (0:00:", "did not finish within")


def hog() -> list[subprocess.Popen]:
    """One busy process per core."""
    spin = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]


def one_round(timeout: int, report: Path) -> list[tuple[str, str, float, str]]:
    """``(test, outcome, seconds, text)`` of each test run in one pytest: what went wrong, or for a run that
    passed, the end of what it printed (a job's own output, for the slowest run of each test)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout}"]
    command += [f"--junitxml={report}", "-o", "junit_logging=all", *TESTS]  # a passed test's output too
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout * len(TESTS) + 300
    )
    out = []
    if not report.exists():  # pytest was stopped (or died) before writing its report
        return out
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is None:
            outcome = "skipped" if case.find("skipped") is not None else "passed"
            text = "\n".join((case.findtext(tag) or "") for tag in ("system-out", "system-err"))
            if outcome == "passed" and any(mark in text for mark in STALLED):
                outcome = "hung"
        else:
            text = f"{problem.get('message', '')}\n{problem.text or ''}"
            if any(mark in text for mark in HUNG):
                outcome = "hung"
            elif "AssertionError" in text or "assert " in text:
                outcome = "wrong"
            else:
                outcome = "failed"
        out.append((name, outcome, float(case.get("time", 0.0)), text[-30000:]))
    return out


def summary(runs: list[tuple[str, str, float, str]], rounds: int, hogs: int, began: float) -> dict:
    """The counts of each outcome, the slowest run of each test, and what went wrong in each run that did not
    pass."""
    counts = {o: sum(1 for r in runs if r[1] == o) for o in ("passed", "hung", "wrong", "failed")}
    slowest: dict[str, float] = {}
    printed: dict[str, str] = {}  # what the slowest run of each test printed
    for name, outcome, seconds, text in runs:
        if seconds >= slowest.get(name, 0.0):
            slowest[name] = seconds
            printed[name] = text if outcome == "passed" else ""
    return {
        "benchmark": "soak",
        "machine": machine(),
        "hog_processes": hogs,
        "rounds": rounds,
        "runs": len(runs),
        **counts,
        "slowest_s": {k: round(v, 1) for k, v in sorted(slowest.items(), key=lambda kv: -kv[1])},
        "slowest_printed": {k: v for k, v in printed.items() if v},
        "not_passed": [
            {"test": n, "outcome": o, "text": t} for n, o, _, t in runs if o not in ("passed", "skipped")
        ],
        "wall_s": round(time.perf_counter() - began, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=int(os.environ.get("SOAK_RUNS", 30)))
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hogs = hog()
    runs: list[tuple[str, str, float, str]] = []
    began, rounds = time.perf_counter(), 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.runs):
                got = one_round(args.timeout, Path(tmp) / f"round{k}.xml")
                if not got:
                    print(f"round {k + 1}: pytest wrote no report (stopped?); {k} rounds counted", flush=True)
                    break
                runs, rounds = runs + got, k + 1
                bad = [f"{name}: {outcome}" for name, outcome, _, _ in got if outcome != "passed"]
                print(f"round {k + 1}/{args.runs}: {len(got)} runs, {len(bad)} not passed {bad}", flush=True)
                # the rounds so far, should the soak be stopped early
                save_json(summary(runs, rounds, len(hogs), began), args.out)
    finally:
        for p in hogs:
            p.kill()
    result = summary(runs, rounds, len(hogs), began)
    write_json(result, args.out)
    if result["hung"] or result["wrong"] or result["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
