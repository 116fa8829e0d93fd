"""Multi-host behaviour, tested for real: several local processes joined by jax.distributed."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.multihost


@pytest.mark.parametrize("n", [2, 4])
def test_barriers_pass_when_every_process_arrives(multiprocess, n):
    results, _ = multiprocess("tests.apps.mh_workers:barriers", n)
    values = [r.ok() for r in results]
    assert all(v["processes"] == n for v in values)


def test_barrier_with_mismatched_or_skipped_names_times_out_clearly(multiprocess):
    results, seconds = multiprocess("tests.apps.mh_workers:mismatched_names", 3, args={"timeout": 3.0})
    p0, p1, p2 = (r.ok() for r in results)
    assert p2 == "skipped"
    assert 2.5 < p0["seconds"] < 15
    assert "barrier 'save' (id save#0) timed out after 3 s: 2 of 3 processes did not arrive" in p0["message"]
    # Each side may already have given up when the other writes its report: either wording is right.
    assert (
        "1 (waiting at 'restore#0')" in p0["message"] or "1 (gave up waiting at 'restore#0')" in p0["message"]
    )
    assert "2 (not at any barrier)" in p0["message"]
    assert "barrier 'restore'" in p1["message"]
    assert "0 (waiting at 'save#0')" in p1["message"] or "0 (gave up waiting at 'save#0')" in p1["message"]
    assert seconds < 60


def test_a_crashed_process_does_not_hold_the_others(multiprocess):
    results, seconds = multiprocess(
        "tests.apps.mh_workers:crash_one", 2, args={"timeout": 5.0}, deadline_s=90
    )
    assert results[1].returncode == 3
    survivor = results[0]
    # The survivor either reports the timeout naming the dead process, or is
    # stopped by the coordination service once heartbeats stop: either way
    # within the timeouts, never waiting out the default 300 s shutdown.
    if survivor.value is not None:
        assert survivor.value["error"] == "BarrierTimeoutError"
        assert "1 of 2 processes did not arrive: 1" in survivor.value["message"]
    else:
        assert survivor.returncode not in (0, None)
    assert seconds < 60


def test_place_like_target_builds_the_global_array(multiprocess):
    results, _ = multiprocess("tests.apps.mh_workers:placement", 2, devices=4)
    full = np.arange(96, dtype=np.float32).reshape(8, 12)
    seen = set()
    for r in results:
        v = r.ok()
        assert v["global_shape"] == [8, 12] and v["tag"] == "x"
        assert v["total"] == pytest.approx(float(full.sum() * 2.5))
        assert len(v["local_shards"]) == 4  # each process built only its own devices' shards
        assert f"none of which process {r.pid} can address" in v["foreign"]
        for shard in v["local_shards"]:
            (r0, r1), (c0, c1) = shard["bounds"]
            np.testing.assert_array_equal(np.asarray(shard["data"]), full[r0:r1, c0:c1])
            seen.add((r0, c0))
    assert len(seen) == 8  # together the processes hold every block once


def test_local_and_global_helpers(multiprocess):
    results, _ = multiprocess("tests.apps.mh_workers:local_global", 2)
    for r in results:
        v = r.ok()
        assert v["global_shape"] == [8, 3]
        assert v["global_sum"] == sum(3 * (p * 4 + 6) for p in range(2))
        assert v["roundtrip"]
        assert v["batch_shape"] == [8, 3] and v["batch_spec"] == "P('dp',)"
        assert v["per_process_sum"] == [0, 4]
        assert any("must be a multiple of 2" in e for e in v["errors"])


@pytest.mark.parametrize("n", [2, 4])
def test_infer_sharding_agrees_across_processes(multiprocess, n):
    results, _ = multiprocess("tests.apps.mh_workers:infer_everywhere", n, devices=8 // n)
    values = [r.ok() for r in results]
    assert all(v["shardings"] == values[0]["shardings"] for v in values)
    assert values[0]["kernel_spec"] == "P(None, 'fsdp')"
    assert all(v["kernel_local_shards"] == 8 // n for v in values)


def test_a_branchs_first_save_sets_the_left_steps_aside_on_every_process_even_when_one_lists_late(
    multiprocess, tmp_path
):
    """After a restore of an older step, the branch's first save sets the newer steps aside: process 0
    moves them, then every process meets at a barrier. A process that lists its steps after the move saw
    none to set aside and went on to the save's agreement, while process 0 waited at the barrier (a stall
    of the whole job for the barrier's timeout, then a restart). The list is now agreed first."""
    results, seconds = multiprocess(
        "tests.apps.mh_workers:branch_with_a_late_listing", 2, args={"workdir": str(tmp_path / "run")}
    )
    first, second = (r.ok() for r in results)
    assert first == second == {"steps": [2, 4], "aside": ["4"]}, (first, second)
    assert seconds < 90


@pytest.mark.parametrize("how", ["late", "empty", "resume"])
def test_a_run_acts_on_one_listing_of_the_workdirs_steps_on_every_process(multiprocess, tmp_path, how):
    """A run in a workdir holding steps sets them aside (``overwrite=True``), refuses the workdir, or
    resumes the newest every process lists (``resume="auto"``), decided from listings every process
    gathered: process 1 listing after process 0 moved the steps, or seeing fewer or none, must not leave it
    training alone, or from another step, while process 0 waits or has stopped."""
    results, seconds = multiprocess(
        "tests.apps.mh_workers:fresh_run_with_another_listing",
        2,
        args={"workdir": str(tmp_path / "run"), "how": how},
    )
    first, second = (r.ok() for r in results)
    expected = {
        "late": {"steps": [2], "aside": ["2", "4"], "restored": None},
        "empty": {"refused": True},
        "resume": {"steps": [2, 4], "aside": ["4"], "restored": 2},  # the newest step both list
    }[how]
    assert first == second == expected, (first, second)
    assert seconds < 90


def test_resume_auto_falls_back_alike_on_every_process_when_one_hosts_file_of_the_newest_step_is_damaged(
    multiprocess, tmp_path
):
    """Each process writes its own data files: process 1's file of the newest step cut in half is seen by
    every process's check of the step, so all restore the step before and set the damaged one aside."""
    results, seconds = multiprocess(
        "tests.apps.mh_workers:resume_past_one_hosts_damage", 2, args={"workdir": str(tmp_path / "run")}
    )
    first, second = (r.ok() for r in results)
    assert first == second == {"restored": 2, "aside": ["4"]}, (first, second)
    assert seconds < 90


def test_a_restore_of_the_newest_step_reads_the_one_every_process_lists(multiprocess, tmp_path):
    """``restore_and_reshard()`` with no step, while process 1's listing lags behind process 0's (it lists
    step 2, process 0 steps 2 and 4): every process restores step 2, never each its own newest (each would
    read its shards of another step, and the mix fails verification: a sound step 4 named corrupt)."""
    results, seconds = multiprocess(
        "tests.apps.mh_workers:restore_the_newest_with_a_lagging_listing",
        2,
        args={"workdir": str(tmp_path / "run")},
    )
    first, second = (r.ok() for r in results)
    assert first == second and first["restored"] == 2, (first, second)
    assert seconds < 90


@pytest.mark.parametrize("who", ["all", "one"])
def test_a_restore_of_the_newest_step_where_a_process_lists_none_is_one_error_on_every_process(
    multiprocess, tmp_path, who
):
    """Nothing saved: every process raises the error a single process does; steps saved but process 1
    listing none: every process raises ``NoCheckpointError`` naming it, none reads alone."""
    results, seconds = multiprocess(
        "tests.apps.mh_workers:restore_the_newest_where_a_process_lists_none",
        2,
        args={"workdir": str(tmp_path / "run"), "who": who},
    )
    first, second = (r.ok() for r in results)
    assert first == second, (first, second)
    expected = "save one first" if who == "all" else "processes [1] list none"
    assert expected in first["error"], first
    assert seconds < 90
