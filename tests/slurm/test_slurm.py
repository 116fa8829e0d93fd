"""The SLURM recipe users copy (examples/cluster/slurm.sbatch), submitted with sbatch to a one-node cluster:
2 tasks x 4 CPU devices, the tiny ViT reading digits through grain's ElasticIterator. Run by
``make test-slurm`` (tests/slurm/cluster.sh starts the cluster); skipped elsewhere.

Every scenario is compared step by step with one uninterrupted run: the examples each step fed (each once)
and the losses (within 1e-4).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = "examples/cluster/slurm.sbatch"
STEPS = 8
pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("SLURM_CONF") or shutil.which("sbatch") is None,
        reason="needs a SLURM cluster: make test-slurm starts one",
    ),
    pytest.mark.timeout(600),  # a job, its requeue (held 10 s), its second run; finished() waits 300 s
]


def submit(workdir: Path, tasks: int = 2, steps: int = STEPS, step_timeout: int = 120) -> str:
    """Submits the recipe as a user would (sizes as sbatch options and variables); returns the job id."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "JAX_PLATFORMS": "cpu",
        "CONFIG": "tiny",
        "DEVICES_PER_TASK": "4",
        "WORKDIR": str(workdir),
        "STEPS": str(steps),
        "STEP_TIMEOUT": str(step_timeout),
        "TRAIN_ARGS": "--data elastic --record-examples --batch-size 32 --log-every 1 --save-every 2",
    }
    sizes = ["--nodes=1", f"--ntasks-per-node={tasks}", "--gpus-per-node=0"]
    out = subprocess.run(
        ["sbatch", "--parsable", *sizes, f"--output={workdir}/slurm.log", SBATCH],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, Reason, Restarts, ExitCode, ...)."""
    text = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def wait(what, timeout: float, every: float = 0.5):
    """Polls ``what()`` until it returns something true; its value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"waited {timeout} s")


def requeued(job_id: str, runs: int) -> bool:
    """True once the job has been requeued ``runs`` times and waits to run again (SLURM holds a requeued job
    for its credentials' lifetime, here 10 s: cluster.sh's cred_expire)."""
    info = job(job_id)
    return int(info.get("Restarts", 0)) >= runs and info.get("JobState") == "PENDING"


def finished(job_id: str, timeout: float = 300) -> dict[str, str]:
    """Waits for the job to end, requeues in between included; its final fields."""

    def done():
        info = job(job_id)
        return info if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None

    return wait(done, timeout)


def trained_to(workdir: Path, step: int) -> bool:
    """True once some process recorded the examples of ``step``."""
    return any(
        json.loads(line)["step"] >= step
        for f in workdir.glob("examples-*.jsonl")
        for line in f.read_text().splitlines()
    )


def saved(workdir: Path, step: int) -> bool:
    """True once step ``step``'s checkpoint is committed (Orbax renames its temporary folder at the end)."""
    return (workdir / "checkpoints" / str(step)).is_dir()


def task_pid(job_id: str, task: int) -> int:
    """The PID of task ``task``'s Python process (the Trainer) of the job."""

    def find():
        for proc in Path("/proc").iterdir():
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"examples/vit/train.py" in cmd and f"SLURM_JOB_ID={job_id}".encode() in env:
                if f"SLURM_PROCID={task}".encode() in env:
                    return int(proc.name)
        return None

    return wait(find, 30)


def examples(workdir: Path) -> dict[int, list[int]]:
    """The examples each step fed: per process the last lines written for it (a resumed run's), all
    processes."""
    out: dict[int, list[int]] = {}
    for f in sorted(workdir.glob("examples-*.jsonl")):
        last: dict[int, list[int]] = {}
        for line in f.read_text().splitlines():
            record = json.loads(line)
            last[record["step"]] = record["index"]
        for step, ids in last.items():
            out.setdefault(step, []).extend(ids)
    return {step: sorted(ids) for step, ids in sorted(out.items())}


def losses(workdir: Path) -> dict[int, float]:
    """Each step's loss in metrics.jsonl (the last logged for the step: a resumed run's)."""
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "event" not in record:
            out[int(record["step"])] = record["loss"]
    return out


def events(workdir: Path, name: str) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == name]


def log(workdir: Path) -> str:
    return (workdir / "slurm.log").read_text()


def assert_like_uninterrupted(workdir: Path, baseline: Path) -> None:
    """Every step fed the examples the uninterrupted run fed, each example once, and lost as it did."""
    seen, expected = examples(workdir), examples(baseline)
    assert sorted(seen) == list(range(1, STEPS + 1))
    assert seen == expected
    every = [i for ids in seen.values() for i in ids]
    assert len(every) == len(set(every)) == STEPS * 32
    got, want = losses(workdir), losses(baseline)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) < 1e-4, (got, want)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """One uninterrupted run of the recipe: 2 tasks x 4 CPU devices, 8 steps."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    started = time.monotonic()
    info = finished(submit(workdir))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log(workdir)
    print(f"uninterrupted run: {time.monotonic() - started:.0f} s")
    return workdir


def test_the_recipe_trains_with_jax_distributed_set_up_from_slurms_variables_alone(baseline):
    text = log(baseline)
    assert "process 0 of 2: 4 of 8 devices, mesh fsdp=8" in text
    assert "process 1 of 2: 4 of 8 devices, mesh fsdp=8" in text
    (summary,) = [json.loads(line[8:]) for line in text.splitlines() if line.startswith("SUMMARY ")]
    assert (summary["processes"], summary["devices"], summary["mesh"]) == (2, 8, "fsdp=8")
    assert summary["stop_reason"] == "finished" and summary["final_step"] == STEPS
    assert "nnx-shard: finished" in text
    assert examples(baseline)[1] != examples(baseline)[2]  # the data moves on from step to step


def test_a_sigterm_saves_and_stops_the_job_which_is_requeued_and_resumes_there(baseline, tmp_path):
    job_id = submit(tmp_path)
    wait(lambda: trained_to(tmp_path, 3), 180)
    started = time.monotonic()
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True)  # as --signal=TERM@120 does
    wait(lambda: requeued(job_id, 1), 120)
    print(f"SIGTERM to requeued: {time.monotonic() - started:.1f} s")
    (stopped,) = [e for e in events(tmp_path, "train") if e.get("stop_reason") == "preempted"]
    assert "stopped by SIGTERM after a save; requeued" in log(tmp_path)
    assert finished(job_id)["JobState"] == "COMPLETED"
    (restored,) = events(tmp_path, "restore")
    assert restored["report"].startswith(f"restored step {stopped['step']},")  # where it stopped, not earlier
    assert_like_uninterrupted(tmp_path, baseline)


def test_a_task_killed_mid_run_ends_the_step_and_the_requeued_job_resumes_from_the_newest_checkpoint(
    baseline, tmp_path
):
    job_id = submit(tmp_path)
    wait(lambda: saved(tmp_path, 4) and trained_to(tmp_path, 5), 180)
    os.kill(task_pid(job_id, 1), signal.SIGKILL)
    started = time.monotonic()
    wait(lambda: requeued(job_id, 1), 120)
    print(f"SIGKILL to requeued: {time.monotonic() - started:.1f} s")
    assert "a task failed or hung" in log(tmp_path)
    on_disk = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert finished(job_id)["JobState"] == "COMPLETED"
    (restored,) = events(tmp_path, "restore")
    newest = max(on_disk)  # the requeued run resumes from the newest that verifies
    assert restored["report"].startswith(f"restored step {newest},"), (restored, on_disk)
    assert_like_uninterrupted(tmp_path, baseline)


def test_resubmitted_with_one_task_it_restores_onto_the_smaller_mesh_and_feeds_each_example_once(
    baseline, tmp_path
):
    first = finished(submit(tmp_path, steps=4))
    assert first["JobState"] == "COMPLETED"
    started = time.monotonic()
    second = finished(submit(tmp_path, tasks=1))  # as --nodes=MIN-MAX gives after a node loss
    print(f"one task, from step 4: {time.monotonic() - started:.0f} s")
    assert second["JobState"] == "COMPLETED"
    assert "process 0 of 1: 4 of 4 devices, mesh fsdp=4" in log(tmp_path)
    (restored,) = events(tmp_path, "restore")
    assert restored["report"] == (
        "restored step 4, saved on 8 devices (fsdp=8) in 2 processes, onto 4 devices (fsdp=4) in 1 process"
    )
    assert_like_uninterrupted(tmp_path, baseline)


def test_a_stopped_task_makes_the_others_exit_on_the_step_timeout_and_the_job_is_requeued(baseline, tmp_path):
    timeout = 20
    job_id = submit(tmp_path, step_timeout=timeout)
    wait(lambda: saved(tmp_path, 4) and trained_to(tmp_path, 5), 180)
    pid = task_pid(job_id, 1)
    os.kill(pid, signal.SIGSTOP)  # alive, silent: nothing a scheduler sees
    started = time.monotonic()
    try:
        wait(lambda: requeued(job_id, 1), timeout + 60)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    took = time.monotonic() - started
    print(f"SIGSTOP to requeued: {took:.1f} s (step_timeout {timeout} s)")
    text = log(tmp_path)
    assert "status 124" in text and "step_timeout" in text, text[-3000:]
    assert took < timeout + 60
    assert finished(job_id)["JobState"] == "COMPLETED"
    (restored,) = events(tmp_path, "restore")
    assert restored["report"].startswith("restored step "), restored
    assert_like_uninterrupted(tmp_path, baseline)
