"""Collectives that cannot cross: every small allgather checked after gathering, and a flight recorder of
each process's last collectives."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nnx_shard._cluster import FlightRecorder, agree, first_divergence
from nnx_shard._cluster._collectives import FLIGHT_DIR, WIDTH


def test_an_agreement_carries_up_to_six_values_of_62_bits_as_one_program():
    got = agree("test.values", [0, 3, 2**40, 2**62 - 1], step=7)
    assert got.tolist() == [[0, 3, 2**40, 2**62 - 1]] and got.dtype == np.int64
    with pytest.raises(ValueError, match=r"at most 6 values; 'test.many' gave 7"):
        agree("test.many", list(range(7)))
    with pytest.raises(ValueError, match=r"in \[0, 2\*\*62\); got -1"):
        agree("test.negative", [-1])
    assert WIDTH == 16  # every agreement, whatever it carries: one shape, so that a crossing is seen


def test_the_recorder_keeps_the_last_collectives_and_says_which_one_waits(tmp_path, monkeypatch):
    recorder = FlightRecorder(size=3)
    recorder.keep_journal()
    for step in range(5):
        with recorder.entered("test.site", step, (2,)):
            pass
    with recorder.entered("test.open", 5, (1,)) as entry:
        assert recorder.waiting() is entry and entry.named() == "#5 'test.open' at step 5"
    assert recorder.waiting() is None
    assert [e.step for e in recorder.entries()] == [3, 4, 5]  # the last three
    assert len(recorder.journal["main"]) == 6 and recorder.journal["main"][0] == ("test.site", 0, (2,))
    monkeypatch.setenv(FLIGHT_DIR, str(tmp_path))
    written = json.loads(open(recorder.dump("a test")).read())
    assert written["why"] == "a test" and [c["sequence"] for c in written["collectives"]] == [3, 4, 5]


def test_a_thread_of_its_own_numbers_its_collectives_apart_and_is_named_while_it_waits():
    """The snapshot's copy goes to its peer from the writer's thread while the main thread issues its own:
    each stream is numbered apart (the main thread's numbers, which every agreement carries, do not depend
    on how the threads interleave), and a process whose main thread waits in none is reported inside the
    other thread's."""
    recorder = FlightRecorder()
    recorder.keep_journal()
    with recorder.entered("snapshot.exchange", 10, (2, 8), stream="snapshot") as sending:
        assert recorder.waiting() is sending
        assert sending.named() == "#0 'snapshot.exchange' at step 10 on the snapshot thread"
        with recorder.entered("snapshot.agree", 20, (2,)) as agreeing:
            assert (agreeing.sequence, recorder.waiting()) == (0, agreeing)  # the main thread's first
        assert recorder.waiting() is sending
    with recorder.entered("snapshot.agree", 30, (2,)) as later:
        assert later.sequence == 1
    assert recorder.journal == {
        "snapshot": [("snapshot.exchange", 10, (2, 8))],
        "main": [("snapshot.agree", 20, (2,)), ("snapshot.agree", 30, (2,))],
    }


def test_the_first_divergence_names_each_process_and_where_it_waits():
    def record(*entries):
        return [{"sequence": s, "site": site, "step": step, "left": left} for s, site, step, left in entries]

    same = record((0, "a", 1, 1.0), (1, "b", 2, None))
    assert first_divergence({0: same, 1: same}) == "none: the processes issued the same collectives"
    other = record((0, "a", 1, 1.0), (1, "c", 2, None))
    assert first_divergence({0: same, 1: other}) == (
        "collective #1: process 0 at 'b' (step 2, waiting), process 1 at 'c' (step 2, waiting)"
    )
    behind = record((0, "a", 1, None))
    assert first_divergence({0: same, 1: behind}) == (
        "collective #1: process 0 at 'b' (step 2, waiting), process 1 never issued it"
    )
    # a recorder keeps its last entries only: the comparison starts where every record still holds
    late = record((5, "x", 9, 1.0), (6, "y", 9, None))
    early = record((4, "w", 9, 1.0), (5, "x", 9, 1.0), (6, "z", 9, None))
    assert first_divergence({0: late, 1: early}).startswith("collective #6: process 0 at 'y'")
    # another thread's collectives are compared among themselves, after the main thread's agree
    sent = {"sequence": 0, "site": "snapshot.exchange", "step": 10, "left": None, "stream": "snapshot"}
    assert first_divergence({0: [*same, sent], 1: same}) == (
        "collective #0 on the snapshot thread: process 0 at 'snapshot.exchange' (step 10, waiting), "
        "process 1 never issued it"
    )


def test_one_extra_agreement_is_a_named_error_on_every_process_not_a_hang(multiprocess, tmp_path):
    """Process 1 snapshots a step process 0 does not: its agreement meets process 0's next one, and both
    raise within seconds, naming the site, each process's step and collective number, and the flight
    record written beside the error."""
    results, seconds = multiprocess(
        "tests.apps.collective_workers:extra_agreement",
        2,
        args={"folder": str(tmp_path / "s")},
        deadline_s=90,
    )
    assert seconds < 60  # an error, not a hang to the deadline
    for r in results:
        got = r.ok()
        assert got["raised"] == "CollectiveMismatchError", got
        message = got["message"]
        assert "the processes were at different collectives when they gathered at 'snapshot.agree'" in message
        assert "process 0: 'snapshot.agree' (collective #" in message and ", step 10)" in message
        assert "process 1: 'snapshot.agree' (collective #" in message and ", step 5)" in message
        path = message.rsplit("are in ", 1)[1].rstrip(".")
        record = json.loads(open(path).read())
        assert record["collectives"][-1]["site"] == "snapshot.agree"


def test_a_timeout_names_the_collective_at_which_the_processes_parted(multiprocess):
    results, _ = multiprocess("tests.apps.collective_workers:diverge_and_time_out", 2, deadline_s=60)
    for r in results:
        assert r.returncode == 124, r.log[-2000:]
        assert "step 2 did not finish within 3 s (config.step_timeout)" in r.log
    zero = results[0].log
    assert "this process is inside collective #" in zero and "'snapshot.agree' at step 2" in zero
    parted = (
        "process 0 at 'snapshot.agree' (step 2, waiting), process 1 at 'snapshot.exchange' (step 1, waiting)"
    )
    assert "of processes 0, 1, the records part at collective #" in zero and parted in zero
