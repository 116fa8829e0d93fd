"""nnx-shard launch: a job restarted on its survivors after kill -9, its exit status, and hangs that end a
process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nnx_shard as ns
from tests.apps.launch_app import (
    ROWS,
    RecordingTrainer,
    branch_data,
    job_events,
    numbered_data,
    recovered_event,
    run_job,
    seen,
)
from tests.apps.trainer_app import RegressionTrainer, batch_for, config

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "tests" / "apps" / "launch_app.py")


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nnx_shard", "launch", "--grace", "3", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(ROOT)},
    )


def events(done: subprocess.CompletedProcess) -> list[str]:
    return [
        line.removeprefix("nnx-shard launch: ")
        for line in done.stdout.splitlines()
        if line.startswith("nnx-shard launch: ")
    ]


PHASES = ("detection_s", "relaunch_s", "read_reshard_s", "compile_s", "first_step_s")
SNAPSHOTS = ("--save-every", "4", "--snapshot-every", "1")  # a checkpoint at 4, a snapshot every step


_REFERENCE: dict[int, tuple[dict[int, float], np.ndarray]] = {}


def uninterrupted(tmp_path: Path, steps: int = 8) -> tuple[dict[int, float], np.ndarray]:
    """The losses and final kernel of the same run without a death, in this process on 8 devices (once)."""
    if steps not in _REFERENCE:
        reference = RegressionTrainer({**config(str(tmp_path / "ref"), total_steps=steps), "save_every": 2})
        history = {int(h["step"]): h["loss"] for h in reference.train(lambda s: batch_for(s, rows=24))}
        _REFERENCE[steps] = (
            history,
            np.asarray(reference.states["model"]["out"]["kernel"].get_value()).ravel(),
        )
    return _REFERENCE[steps]


def finished(
    workdir: Path, done: subprocess.CompletedProcess, death: str, processes: int, devices: int
) -> dict:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    plural = "es" if processes > 1 else ""
    assert events(done)[1:] == [
        f"{death}; restart 1 on {processes} process{plural} x {devices} devices",
        f"job finished on {processes} process{plural}",
    ]
    return json.loads((workdir / "result-1.json").read_text())


@pytest.mark.parametrize("lost", [1, 0])
def test_kill_9_restarts_on_the_survivor_from_snapshots_and_matches_an_uninterrupted_run(tmp_path, lost):
    workdir = tmp_path / "job"
    done = run_job(workdir, 2, 4, f"{lost}:6", extra=SNAPSHOTS)
    result = finished(workdir, done, f"process {lost} killed by SIGKILL", 1, 4)
    # step 6 ran but its snapshot was never taken: the survivor goes on from the snapshot of step 5, or of
    # step 4 when the one of step 5 was skipped (the one of step 4 was still being written on a process)
    restored = result["restored_step"]
    assert (result["processes"], result["devices"]) == (1, 4) and restored in (4, 5)
    recovered = recovered_event(workdir)
    assert recovered["source"] == "snapshot" and recovered["restored_step"] == restored
    assert (recovered["processes_before"], recovered["processes_after"], recovered["restart"]) == (2, 1, 1)
    assert all(recovered[p] >= 0 for p in PHASES), recovered
    assert recovered["compile_s"] > 0 and recovered["read_reshard_s"] > 0
    # the survivor's train() call: its own goodput (not driven to 0 by seconds spent before it), and the
    # goodput since the death, which counts detection, relaunch and restore as lost time
    train = job_events(workdir, "train")[-1]
    before = recovered["detection_s"] + recovered["relaunch_s"] + recovered["read_reshard_s"]
    assert 0 < train["goodput_since_failure"] < train["goodput"] <= 1, train
    assert train["recovery_s"] == pytest.approx(before, abs=0.5), (train, recovered)
    assert train["goodput_since_failure"] == pytest.approx(
        1
        - (train["recovery_s"] + (1 - train["goodput"]) * train["seconds"])
        / (train["recovery_s"] + train["seconds"]),
        abs=0.01,
    )
    history, kernel = uninterrupted(tmp_path)
    after = range(restored + 1, 9)
    np.testing.assert_allclose(
        [result["losses"][str(s)] for s in after], [history[s] for s in after], rtol=1e-4
    )
    np.testing.assert_allclose(result["kernel"], kernel, rtol=1e-4, atol=1e-6)
    snapshots = workdir / "snapshots"  # the survivor's own of the run before, and the lost one's, are freed
    assert not (snapshots / "run-0").exists() or not list((snapshots / "run-0").iterdir())


def test_a_restart_after_a_rollback_resumes_the_branch_not_the_snapshots_of_the_one_it_left(tmp_path):
    """A run of 12 steps trains to step 8 (a snapshot every step, a checkpoint every 2), restores step 4 and
    trains on other data; after that branch's step 7 a process is killed. The branch's save of step 6 set
    the left run's checkpoints 6 and 8 aside; its snapshots of steps 7 and 8 are gone too (the code before
    resumed from the left run's step 8), so the restart resumes from the branch's own state and ends where
    the same run without a death ends."""
    workdir = tmp_path / "job"
    extra = ("--snapshot-every", "1", "--rollback", "8:4", "--timeline")
    done = run_job(workdir, 2, 4, "1:7", steps=12, extra=extra)
    # the job's timeline, kept by pytest with the test (make soak records it for the slowest run), then the
    # stacks of a process that went 40 s without a step, and any step timeout (make soak counts them as hung)
    print("\n".join(line for line in done.stdout.splitlines() if "Gloo" not in line))
    stuck = done.stderr.find("Timeout (0:00:")  # the app's stack dump of a process with no step for 40 s
    print(done.stderr[stuck : stuck + 20000] if stuck >= 0 else "no process went 40 s without a step")
    watchdog = [line for line in done.stderr.splitlines() if line.startswith("nnx_shard: ")]
    print("\n".join(watchdog) or "no step timeout")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    said = events(done)  # the death named may be process 0's, aborted by the service once its peer was gone
    assert said[1].endswith("; restart 1 on 1 process x 4 devices"), said
    assert said[2:] == ["job finished on 1 process"], said
    result = json.loads((workdir / "result-1.json").read_text())
    # the branch's newest state both processes completed, never the left run's 8: its snapshot of step 6, or,
    # when the death came while that snapshot's copy was still going to the peer (beside step 7), its
    # checkpoint of step 6 (or its snapshot of step 5, when that save had not finished either)
    assert result["restored_from"] in ("snapshot", "checkpoint") and 4 < result["restored_step"] < 8, result
    reference = RegressionTrainer({**config(str(tmp_path / "ref"), total_steps=12), "save_every": 2})
    reference.train(lambda s: batch_for(s, rows=ROWS), steps=8)
    reference.restore_and_reshard(step=4)
    reference.train(branch_data)
    kernel = np.asarray(reference.states["model"]["out"]["kernel"].get_value()).ravel()
    np.testing.assert_allclose(result["kernel"], kernel, rtol=1e-4, atol=1e-6)


def test_a_snapshot_with_a_flipped_byte_is_refused_and_the_checkpoint_used(tmp_path):
    workdir = tmp_path / "job"
    done = run_job(workdir, 2, 4, "1:6", extra=(*SNAPSHOTS, "--flip"))
    result = finished(workdir, done, "process 1 killed by SIGKILL", 1, 4)
    # the newest snapshot (of step 5, or of step 4 when 5's was skipped while 4's was written) is refused
    assert re.search(r"the snapshot of step [45] does not read", done.stderr), done.stderr[-3000:]
    assert "differs from what was written" in done.stderr
    assert (result["restored_step"], result["restored_from"]) == (4, "checkpoint")
    assert recovered_event(workdir)["source"] == "checkpoint"
    history, kernel = uninterrupted(tmp_path)
    np.testing.assert_allclose(
        [result["losses"][str(s)] for s in range(5, 9)], [history[s] for s in range(5, 9)], rtol=1e-4
    )
    np.testing.assert_allclose(result["kernel"], kernel, rtol=1e-4, atol=1e-6)


def test_losing_process_0_of_3_restarts_on_2_from_snapshots_without_a_checkpoint(tmp_path):
    workdir = tmp_path / "job"
    done = run_job(workdir, 3, 2, "0:3", steps=6, extra=SNAPSHOTS)
    result = finished(workdir, done, "process 0 killed by SIGKILL", 2, 2)
    restored = result["restored_step"]  # 2, or 1 when the snapshot of step 2 was skipped
    assert (result["processes"], result["devices"]) == (2, 4) and restored in (1, 2)
    after = [str(s) for s in range(restored + 1, 7)]
    assert result["restored_from"] == "snapshot" and sorted(result["losses"]) == after
    history, kernel = uninterrupted(tmp_path, steps=6)
    np.testing.assert_allclose(
        [result["losses"][s] for s in after], [history[int(s)] for s in after], rtol=1e-4
    )
    np.testing.assert_allclose(result["kernel"], kernel, rtol=1e-4, atol=1e-6)


_NUMBERED: dict[int, tuple[dict[int, float], dict[int, list], list[float]]] = {}


def uninterrupted_on_numbered_data(
    tmp_path: Path, steps: int = 8
) -> tuple[dict[int, float], dict[int, list]]:
    """The losses and the example numbers of each step of a run on the numbered data without a death."""
    return numbered_reference(tmp_path, steps)[:2]


def numbered_reference(
    tmp_path: Path, steps: int = 8
) -> tuple[dict[int, float], dict[int, list], list[float]]:
    """The uninterrupted run on the numbered data (once): losses, examples of each step, final out kernel."""
    if steps not in _NUMBERED:
        RecordingTrainer.path = tmp_path / "seen-reference.jsonl"
        try:
            reference = RecordingTrainer(
                {**config(str(tmp_path / "ref-data"), total_steps=steps), "save_every": 2}
            )
            history = {int(h["step"]): h["loss"] for h in reference.train(numbered_data("elastic"))}
        finally:
            RecordingTrainer.path = None
        fed = [json.loads(line) for line in (tmp_path / "seen-reference.jsonl").read_text().splitlines()]
        kernel = np.asarray(reference.states["model"]["out"]["kernel"].get_value()).ravel().tolist()
        _NUMBERED[steps] = (history, {r["step"]: sorted(r["ids"]) for r in fed}, kernel)
    return _NUMBERED[steps]


@pytest.mark.parametrize("fault", ["snapshot", "save", "restart"])
def test_a_process_lost_in_a_snapshot_a_save_or_the_restart_recovers_with_each_example_once(tmp_path, fault):
    # the chaos campaign's trial: a process dies while its snapshot is written, inside a save, or (a second
    # death) while the survivors restore; the job must end as the uninterrupted run did, examples included
    from tests.apps.chaos_app import launch_trial

    _, expected, kernel = numbered_reference(tmp_path)
    result = launch_trial(tmp_path, fault, seed=3, reference={"kernel": kernel, "seen": expected})
    assert result["outcome"] == "recovered", result
    assert result["restarts"] == (2 if fault == "restart" else 1), result
    assert all(0 < s < 120 for s in result["death_to_first_step_s"]), result


@pytest.mark.parametrize(
    "processes, devices, kill, restored, extra",
    [(4, 2, "2:6", (4, 5), SNAPSHOTS), (2, 4, "1:5", (4,), ())],
    ids=["4->3 from snapshots", "2->1 from a checkpoint"],
)
def test_a_restart_on_fewer_processes_reads_each_example_once_from_where_the_run_stopped(
    tmp_path, processes, devices, kill, restored, extra
):
    workdir = tmp_path / "job"
    done = run_job(workdir, processes, devices, kill, extra=(*extra, "--data", "elastic"), timeout=400)
    lost = kill.split(":")[0]
    result = finished(workdir, done, f"process {lost} killed by SIGKILL", processes - 1, devices)
    assert result["restored_step"] in restored  # a snapshot due while the last is written is skipped
    restored = result["restored_step"]
    assert "DataPositionWarning" not in done.stderr
    history, expected = uninterrupted_on_numbered_data(tmp_path)
    # the steps kept from the first run, then the restart's: each the examples of the uninterrupted run's step
    got = {**seen(workdir, 0, range(1, restored + 1)), **seen(workdir, 1, range(restored + 1, 9))}
    assert got == expected
    assert expected == {
        s: list(range((s - 1) * ROWS, s * ROWS)) for s in range(1, 9)
    }  # none twice, none skipped
    np.testing.assert_allclose(
        [result["losses"][str(s)] for s in range(restored + 1, 9)],
        [history[s] for s in range(restored + 1, 9)],
        rtol=1e-4,
    )


def test_a_process_lost_on_standby_restarts_the_job_with_each_example_once(tmp_path):
    # 2 processes: after step 3 the Trainer resizes onto process 0's devices, process 1 is on standby and
    # joins the saves (step 4); it is killed inside the save of step 6. The job restarts on 1 process
    # from step 4 and every step feeds the examples of the uninterrupted run.
    workdir = tmp_path / "job"
    extra = ("--data", "elastic", "--fault", "save", "--off-host-at", "3")
    done = run_job(workdir, 2, 4, "1:6", extra=extra, timeout=400)
    result = finished(workdir, done, "process 1 killed by SIGKILL", 1, 4)
    assert result["restored_step"] == 4 and "DataPositionWarning" not in done.stderr
    history, expected = uninterrupted_on_numbered_data(tmp_path)
    got = {**seen(workdir, 0, range(1, 5)), **seen(workdir, 1, range(5, 9))}
    assert got == expected
    standby = [json.loads(line)["step"] for line in (workdir / "seen-0-1.jsonl").read_text().splitlines()]
    assert standby == [1, 2, 3]  # process 1 read nothing after the resize: process 0 read all 24 rows
    np.testing.assert_allclose(
        [result["losses"][str(s)] for s in range(5, 9)], [history[s] for s in range(5, 9)], rtol=1e-4
    )


def test_an_iterator_whose_position_is_per_process_starts_again_with_a_warning(tmp_path):
    workdir = tmp_path / "job"
    done = run_job(workdir, 2, 4, "1:5", extra=("--data", "per-process"))
    result = finished(workdir, done, "process 1 killed by SIGKILL", 1, 4)
    assert result["restored_step"] == 4
    assert "DataPositionWarning: the data position was saved by 2 processes and this run has 1" in done.stderr
    assert "starts again from its beginning" in done.stderr and "ElasticIterator" in done.stderr
    # what the warning says happened: the survivor read its data from the beginning, not from example 96
    assert seen(workdir, 1, range(5, 6))[5] == list(range(ROWS))


def test_the_job_exit_status_and_when_it_gives_up(tmp_path):
    code = "import os, sys; sys.exit(3 if os.environ['NNX_SHARD_PROCESS_ID'] == '1' else 0)"
    done = launch(
        "--processes", "2", "--min-processes", "2", "--max-restarts", "5", "--", sys.executable, "-c", code
    )
    assert done.returncode == 3
    assert (
        events(done)[1]
        == "process 1 exited with status 3; not restarting (1 left, below --min-processes 2); exit status 3"
    )
    names = ("PROCESS_ID", "NUM_PROCESSES", "RESTART")
    # one write per line: the two processes share the launcher's stdout
    env = (
        f"import os; os.write(1, (' '.join([*(os.environ['NNX_SHARD_' + n] for n in {names}), "
        "os.environ['JAX_NUM_CPU_DEVICES']]) + chr(10)).encode())"
    )
    done = launch("--processes", "2", "--devices-per-process", "3", "--", sys.executable, "-c", env)
    printed = sorted(line for line in done.stdout.splitlines() if not line.startswith("nnx-shard launch"))
    assert done.returncode == 0 and printed == ["0 2 0 3", "1 2 0 3"]
    bad = launch("--processes", "2", "--min-processes", "3", "--", "true")
    assert bad.returncode == 2 and "ConfigError" in bad.stderr and "--min-processes" in bad.stderr


def test_a_hung_step_ends_the_process_naming_the_section(tmp_path):
    done = subprocess.run(
        [sys.executable, APP, str(tmp_path / "job"), "--step-timeout", "2", "--hang-at", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 124, done.stderr[-2000:]
    assert (
        "nnx_shard: step 3 did not finish within 2 s (config.step_timeout) in process 0 of 1" in done.stderr
    )


def test_the_first_step_and_its_compile_are_held_to_the_startup_timeout_not_the_step_timeout(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        job = [sys.executable, APP, str(tmp_path / f"job{len(list(tmp_path.iterdir()))}"), "--steps", "3"]
        return subprocess.run(
            [*job, "--step-timeout", "2", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        )

    # a first step of 4 s (a long compile) under a 2 s step timeout: the startup's 120 s hold it
    slow_first = run("--startup-timeout", "120", "--hang-at", "1:4")
    assert slow_first.returncode == 0, slow_first.stderr[-2000:]
    hung_first = run("--startup-timeout", "5", "--hang-at", "1")
    assert hung_first.returncode == 124, hung_first.stderr[-2000:]
    assert (
        "nnx_shard: startup (init, restore, the first step) did not finish within 5 s "
        "(config.startup_timeout) in process 0 of 1" in hung_first.stderr
    )
    # without one (0, off) the startup has no limit, its first step included (the steps after have theirs:
    # test_a_hung_step_ends_the_process_naming_the_section)
    no_startup = run("--hang-at", "1:4")
    assert no_startup.returncode == 0, no_startup.stderr[-2000:]


def test_the_watchdog_says_what_the_coordination_service_knows_of_the_peers(multiprocess):
    results, _ = multiprocess(
        "tests.apps.mh_workers:hang_in_a_collective", 2, args={"hang": 1}, deadline_s=60
    )
    assert results[0].returncode == 124, results[0].log[-2000:]
    assert (
        "step 3 did not finish within 2 s (config.step_timeout) in process 0 of 2; process 1 is still in "
        "step 2; this process is in no collective (its last collectives: " in results[0].log
    )
    # process 1 sleeps in step 2, its watchdog not yet due: no record of its own comes
    assert (
        "; no other process's record came within the deadline: a peer may have died or hung" in results[0].log
    )


def test_launch_info_reads_the_launcher_variables(monkeypatch):
    assert ns.cluster.launch_info() is None
    monkeypatch.setenv("NNX_SHARD_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("NNX_SHARD_NUM_PROCESSES", "2")
    monkeypatch.setenv("NNX_SHARD_PROCESS_ID", "1")
    monkeypatch.setenv("NNX_SHARD_RESTART", "2")
    monkeypatch.setenv("NNX_SHARD_PREVIOUS_ID", "2")
    monkeypatch.setenv("NNX_SHARD_LOST", "1")
    assert ns.cluster.launch_info() == ns.cluster.LaunchInfo(
        "127.0.0.1:1234", 2, 1, restart=2, previous_id=2, lost=(1,)
    )
    monkeypatch.setenv("NNX_SHARD_PROCESS_ID", "two")
    with pytest.raises(ns.ConfigError, match="NNX_SHARD_PROCESS_ID must be an integer; got 'two'"):
        ns.cluster.launch_info()
    monkeypatch.setenv("NNX_SHARD_PROCESS_ID", "5")
    with pytest.raises(ns.ConfigError, match="not a process of NNX_SHARD_NUM_PROCESSES=2"):
        ns.cluster.launch_info()


def test_cluster_examples_are_well_formed():
    cluster = ROOT / "examples" / "cluster"
    for script in ("slurm.sbatch", "train.sh"):
        assert subprocess.run(["bash", "-n", str(cluster / script)], capture_output=True).returncode == 0
    sys.path.insert(0, str(ROOT))
    from examples.vit.train import parse

    args = parse(
        ["--workdir", "w", "--real-devices", "--distributed", "--resume-auto", "--step-timeout", "600"]
        + ["--startup-timeout", "1800"]
    )
    assert args.resume_auto and args.step_timeout == 600 and args.distributed and args.startup_timeout == 1800
    entry = (cluster / "train.sh").read_text()  # the one command the sbatch's tasks and the JobSet's pods run
    for option in ("--resume-auto", "--step-timeout", "--startup-timeout", "--distributed"):
        assert option in entry
    for text in ((cluster / "slurm.sbatch").read_text(), (cluster / "jobset.yaml").read_text()):
        assert "examples/cluster/train.sh" in text
