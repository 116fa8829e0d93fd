"""Faults for real: damage a checkpoint in one of many ways, kill a training process at a chosen point.

Used by tests/scenarios/test_reliability.py, tests/scenarios/test_chaos.py and ``make chaos``
(benchmarks/chaos.py). A worker runs as ``python tests/apps/chaos_app.py WORKDIR
KILL SEED`` and prints one JSON line: the digest of its final state and the
step it restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

TOTAL, EVERY = 12, 3  # the run the chaos campaign interrupts: 12 steps, a checkpoint every 3


def files_of(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file())


def largest(step_dir: Path) -> Path:
    return max((p for p in files_of(step_dir) if "/d/" in str(p)), key=lambda p: p.stat().st_size)


def _flip(p: Path, at: float = 0.5) -> None:
    data = bytearray(p.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    p.write_bytes(bytes(data))


def _garbage(p: Path) -> None:
    p.write_bytes(b"\x00not what was written{")


DAMAGE = {
    "flip_data": lambda s: _flip(largest(s)),
    "truncate_data": lambda s: os.truncate(largest(s), largest(s).stat().st_size // 2),
    "delete_data": lambda s: largest(s).unlink(),
    "empty_all": lambda s: [os.truncate(p, 0) for p in files_of(s)],
    "garbage_tree_metadata": lambda s: _garbage(s / "state" / "_METADATA"),
    "garbage_json_metadata": lambda s: _garbage(s / "meta" / "metadata"),
    "delete_state_folder": lambda s: shutil.rmtree(s / "state"),
    "delete_checkpoint_metadata": lambda s: (s / "_CHECKPOINT_METADATA").unlink(),
    "truncate_ocdbt_manifest": lambda s: os.truncate(s / "state" / "manifest.ocdbt", 7),
    "garbage_array_metadata": lambda s: _garbage(next((s / "state" / "array_metadatas").iterdir())),
    "garbage_sharding": lambda s: _garbage(s / "state" / "_sharding"),
    "flip_manifest_of_files": lambda s: _garbage(s / "nnx_shard_files.json"),
}


def damage(step_dir: str | Path, kind: str) -> None:
    """Damages a saved step in place, as a bad disk, a full disk or a careless hand would."""
    DAMAGE[kind](Path(step_dir))


# -- the worker: a short run, killed at a chosen point --------------------------------

KILL_POINTS = (
    "none",
    "after_step_1",  # before any checkpoint
    "after_step_3",  # just after the async save of step 3 started
    "after_step_4",
    "after_step_7",
    "before_save_6",  # fingerprints computed, Orbax not started
    "before_manifest_9",  # step 9 finalised by Orbax, its file manifest not yet written
    "in_orbax_write_3",  # inside Orbax's write of step 3
    "in_orbax_write_12",  # inside the final save
    "timer",  # after a seeded random delay: anywhere, async saves included
)


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(trainer, kill: str, seed: int) -> None:
    import orbax.checkpoint as ocp

    import nnx_shard._checkpoint._checkpointer as ckpt_module

    if kill.startswith("after_step_"):
        at = int(kill.rsplit("_", 1)[1])
        trainer.add_callback(lambda step, metrics, t: _kill() if step == at else None)
    elif kill == "before_save_6":
        save = ckpt_module.Checkpointer.save

        def patched(self, step, *a, **k):
            if step == 6:
                _kill()
            return save(self, step, *a, **k)

        ckpt_module.Checkpointer.save = patched
    elif kill == "before_manifest_9":
        write = ckpt_module.write_file_manifest

        def patched_write(step_dir):
            if step_dir.name == "9":
                _kill()
            return write(step_dir)

        ckpt_module.write_file_manifest = patched_write
    elif kill.startswith("in_orbax_write_"):
        at = kill.rsplit("_", 1)[1]
        handler = ocp.JsonCheckpointHandler
        original = handler.async_save

        async def patched_async(self, directory, *a, **k):
            if f"/{at}." in str(directory) or str(directory).endswith(f"/{at}"):
                threading.Timer(0.02, _kill).start()
            return await original(self, directory, *a, **k)

        handler.async_save = patched_async
    elif kill == "timer":
        delay = random.Random(seed).uniform(2.0, 9.0)
        threading.Timer(delay, _kill).start()


def digest(trainer) -> str:
    import jax
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree.leaves(trainer.states):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()


def run(workdir: str, kill: str = "none", seed: int = 0) -> dict:
    """Trains 12 steps with async saves every 3 and ``resume="auto"``; may be killed on the way."""
    from tests.apps.trainer_app import RegressionTrainer, batch_for, config

    trainer = RegressionTrainer(
        {**config(workdir, total_steps=TOTAL), "save_every": EVERY, "resume": "auto", "max_to_keep": 2}
    )
    _arm(trainer, kill, seed)
    start = time.perf_counter()
    trainer.init()
    trainer.train(batch_for)
    return {
        "digest": digest(trainer),
        "restored": trainer.restored_step,
        "step": trainer.step,
        "stop_reason": trainer.stop_reason,
        "seconds": time.perf_counter() - start,
    }


# -- the campaign: trials and what came of them ----------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _worker(workdir: Path, kill: str, seed: int, timeout: float = 240.0) -> dict:
    """Runs the worker in a fresh process: its exit code, its JSON line, its stderr's length and last line."""
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    try:
        p = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "apps" / "chaos_app.py"), str(workdir), kill, str(seed)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "hang": True, "stderr_lines": 0, "last": ""}
    out = next((json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")), None)
    err = p.stderr.strip().splitlines()
    return {"rc": p.returncode, "out": out, "stderr_lines": len(err), "last": err[-1] if err else ""}


def usable_steps(workdir: Path) -> list[int]:
    """Steps a restore could use: finalised by Orbax (a step folder; temporaries are not steps)."""
    folder = workdir / "checkpoints"
    if not folder.exists():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def judge(restart: dict, reference: str, had_usable: bool) -> str:
    """``recovered`` (bitwise), ``named_error``, ``wrong`` (values differ, or a silent start from scratch),
    ``hang``."""
    if restart.get("hang"):
        return "hang"
    if restart["rc"] != 0:
        return "named_error" if "nnx_shard.errors." in restart["last"] else "unnamed_error"
    out = restart["out"]
    if out["digest"] != reference:
        return "wrong"
    if had_usable and out["restored"] is None:
        return "wrong"  # started from scratch although a usable checkpoint was there
    return "recovered"


def kill_trial(tmp: Path, point: str, seed: int, reference: str) -> dict:
    workdir = tmp / f"kill-{point}-{seed}"
    first = _worker(workdir, point, seed)
    had = bool(usable_steps(workdir))
    restart = _worker(workdir, "none", seed)
    return {
        "trial": f"kill {point} (seed {seed})",
        "killed": first["rc"] == -9,
        **_outcome(restart, reference, had),
    }


def damage_trial(
    tmp: Path, finished: Path, kind: str, seed: int, reference: str, *, every_step: bool = False
) -> dict:
    """Damages the newest step (or every step) of a finished run and restarts it with ``resume="auto"``.

    With one step damaged the restart must recover from the one before; with
    every step damaged it must stop with a named error rather than start over.
    """
    workdir = tmp / f"damage-{kind}-{seed}-{'all' if every_step else 'newest'}"
    shutil.copytree(finished, workdir)
    steps = usable_steps(workdir)
    for step in steps if every_step else steps[-1:]:
        damage(workdir / "checkpoints" / str(step), kind)
    restart = _worker(workdir, "none", seed)
    what = f"every step {steps}" if every_step else f"step {steps[-1]}"
    return {"trial": f"damage {kind} of {what}", **_outcome(restart, reference, True)}


# -- lost processes under nnx-shard launch: 2 or 3 processes of 2 devices, elastic data, snapshots every 2 --

LAUNCH_FAULTS = ("step", "snapshot", "save", "restart")  # where a process dies (tests/apps/launch_app.py)
LAUNCH_STEPS = 8


def launch_reference(tmp: Path) -> dict:
    """The uninterrupted job on one process: its final kernel and the examples of each step."""
    from tests.apps.launch_app import run_job, seen

    workdir = tmp / "launch-reference"
    done = run_job(workdir, 1, 2, "", steps=LAUNCH_STEPS, extra=_LAUNCH_OPTIONS, timeout=240)
    if done.returncode != 0:
        raise RuntimeError(f"the reference job failed: {done.stderr[-2000:]}")
    result = json.loads((workdir / "result-0.json").read_text())
    return {"kernel": result["kernel"], "seen": seen(workdir, 0, range(1, LAUNCH_STEPS + 1))}


_LAUNCH_OPTIONS = ("--data", "elastic", "--save-every", "4", "--snapshot-every", "2")


def launch_trial(tmp: Path, fault: str, seed: int, reference: dict) -> dict:
    """A job of 2 processes (3 when a second one dies in the restart) losing one at a seeded step; judged
    on its final kernel and on the examples each step saw, against the uninterrupted job."""
    import numpy as np

    from tests.apps.launch_app import job_events, run_job, seen

    rng = random.Random(seed)
    processes = 3 if fault == "restart" else 2
    who, at = rng.randrange(processes), rng.randint(2, LAUNCH_STEPS - 1)
    if fault == "snapshot":
        at = 2 * rng.randint(1, (LAUNCH_STEPS - 1) // 2)  # a step that takes one
    if fault == "save":
        at = 4
    workdir = tmp / f"launch-{fault}-{seed}"
    extra = (*_LAUNCH_OPTIONS, "--fault", fault)
    trial = {"trial": f"lost process {who} of {processes}, {fault} {at} (seed {seed})"}
    import subprocess

    try:
        done = run_job(
            workdir, processes, 2, f"{who}:{at}", steps=LAUNCH_STEPS, extra=extra, restarts=2, timeout=300
        )
    except subprocess.TimeoutExpired:
        return {**trial, "outcome": "hang", "stderr_lines": 0, "last": "", "error": None, "restored": None}
    err = done.stderr.strip().splitlines()
    final = sorted(workdir.glob("result-*.json"))
    out = {"stderr_lines": len(err), "last": err[-1][-300:] if err else "", "error": None, "restored": None}
    if done.returncode != 0 or not final:
        named = any("nnx_shard.errors." in line for line in err[-5:])
        return {**trial, **out, "outcome": "named_error" if named else "unnamed_error", "error": out["last"]}
    result = json.loads(final[-1].read_text())
    runs = int(result["restart"])
    # each step's examples, from the run whose state went on: the last run after the final restore point,
    # and before it the latest earlier run that reached the step
    recovered = job_events(workdir, "recovered")
    kept = int(result["restored_step"] or 0)
    got = seen(workdir, runs, range(kept + 1, LAUNCH_STEPS + 1))
    earlier = [seen(workdir, run, range(1, kept + 1)) for run in range(runs)]
    for step in range(1, kept + 1):
        got[step] = next((ids[step] for ids in reversed(earlier) if ids[step]), [])
    close = np.allclose(result["kernel"], reference["kernel"], rtol=1e-4, atol=1e-6)
    phases = ("detection_s", "relaunch_s", "read_reshard_s", "compile_s", "first_step_s")
    return {
        **trial,
        **out,
        "outcome": "recovered" if close and got == reference["seen"] and runs >= 1 else "wrong",
        "restored": result["restored_step"],
        "source": result["restored_from"],
        "restarts": runs,
        "death_to_first_step_s": [round(sum(r[p] or 0.0 for p in phases), 3) for r in recovered],
    }


def _outcome(restart: dict, reference: str, had_usable: bool) -> dict:
    return {
        "outcome": judge(restart, reference, had_usable),
        "stderr_lines": restart["stderr_lines"],
        "last": restart["last"][-300:],
        "error": restart["last"].split(":", 1)[0] if restart.get("rc") not in (0, None) else None,
        "restored": (restart.get("out") or {}).get("restored"),
    }


def campaign(
    tmp: Path, *, trials: int | None = None, seed: int = 0, launch: int = 0
) -> tuple[list[dict], dict]:
    """Every kill point and damage kind once (``trials`` None), or ``trials`` seeded draws of them, of which
    ``launch`` are lost processes under ``nnx-shard launch`` (each fault kind in turn, a seeded process and
    step)."""
    tmp.mkdir(parents=True, exist_ok=True)
    finished = tmp / "reference"
    ref = _worker(finished, "none", 0)
    if ref["rc"] != 0:
        raise RuntimeError(f"the reference run failed: {ref['last']}")
    reference = ref["out"]["digest"]
    rng = random.Random(seed)
    plan = [("kill", p, 0) for p in KILL_POINTS[1:]] + [("damage", k, 0) for k in DAMAGE]
    plan.append(("damage_all", "truncate_data", 0))
    plan += [("launch", LAUNCH_FAULTS[k % len(LAUNCH_FAULTS)], rng.randrange(10**6)) for k in range(launch)]
    if trials is not None:
        kinds = ["kill", "damage", "damage", "damage_all"]
        plan = plan + [
            (rng.choice(kinds), None, rng.randrange(10**6)) for _ in range(max(0, trials - len(plan)))
        ]
    launched = launch_reference(tmp) if launch else None
    results = []
    for what, name, s in plan:
        if what == "launch":
            results.append(launch_trial(tmp, name, s, launched))
        elif what == "kill":
            results.append(kill_trial(tmp, name or rng.choice(KILL_POINTS[1:]), s, reference))
        else:
            kind = name or rng.choice(sorted(DAMAGE))
            results.append(damage_trial(tmp, finished, kind, s, reference, every_step=what == "damage_all"))
    counts = {
        "trials": len(results),
        "recovered_bitwise": sum(r["outcome"] == "recovered" for r in results),
        "named_errors": sum(r["outcome"] == "named_error" for r in results),
        "unnamed_errors": sum(r["outcome"] == "unnamed_error" for r in results),
        "wrong_values": sum(r["outcome"] == "wrong" for r in results),
        "hangs": sum(r["outcome"] == "hang" for r in results),
        "max_stderr_lines": max(r["stderr_lines"] for r in results if not r["trial"].startswith("lost")),
    }
    # the anchors' count: recovered over faults injected (a step damaged on every copy cannot be recovered:
    # its named error is the right outcome, and it counts against the rate here as there)
    counts["recovery_rate"] = round(counts["recovered_bitwise"] / len(results), 3)
    deaths = [t for r in results for t in r.get("death_to_first_step_s", [])]
    if deaths:
        counts["lost_processes"] = sum(r["trial"].startswith("lost") for r in results)
        counts["median_death_to_first_step_s"] = round(statistics.median(deaths), 3)
    return results, counts


if __name__ == "__main__":  # python tests/apps/chaos_app.py WORKDIR KILL SEED
    import jax

    os.environ.pop("XLA_FLAGS", None)
    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import nnx_shard as ns

    try:
        print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
    except (
        ns.NnxShardError
    ) as e:  # as a job script reports it: one line (what the library printed stays above)
        print(f"{type(e).__module__}.{type(e).__name__}: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(1)
