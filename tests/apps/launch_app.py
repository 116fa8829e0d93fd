"""A training job run under `nnx-shard launch` by the tests: it may kill one of its own processes mid-run.

python tests/apps/launch_app.py WORKDIR [--kill PROCESS:STEP] [--step-timeout S --hang-at STEP[:S]]
    [--data KIND]

``--data elastic`` reads numbered examples through grain's ElasticIterator, ``--data per-process`` through a
grain iterator of this process's own shard; every process writes the example numbers it fed at each step to
``seen-<restart>-<process>.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nnx_shard as ns

info = ns.cluster.initialize_distributed(heartbeat_timeout=5, shutdown_timeout=5)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from tests.apps.trainer_app import (  # noqa: E402
    RegressionTrainer,
    batch_for,
    config,
    digest,
    multiprocess_startup_timeout,
    multiprocess_step_timeout,
)

STUCK_S = 40  # with --timeline: seconds without a step or phase before the stacks are written
ROWS = 24  # a global batch every process count here divides (1, 2 or 3 processes)
ROOT = Path(__file__).resolve().parents[2]


def run_job(
    workdir: Path,
    processes: int,
    devices: int,
    kill: str,
    steps: int = 8,
    timeout: float = 240,
    extra: tuple[str, ...] = (),
    restarts: int = 1,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """This app under ``nnx-shard launch`` (``restarts`` restarts, 1 s grace), process:step ``kill`` killing
    itself; ``extra``: more of the app's options (``--snapshot-every``, ``--flip``, ``--fault``)."""
    launcher = [sys.executable, "-m", "nnx_shard", "launch", "--grace", "1", "--max-restarts", str(restarts)]
    sizes = ["--processes", str(processes), "--devices-per-process", str(devices)]
    app = [sys.executable, __file__, str(workdir), "--kill", kill, "--steps", str(steps), *extra]
    return subprocess.run(
        [*launcher, *sizes, "--", *app],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(ROOT), **(env or {})},
    )


def example(i: int) -> dict[str, np.ndarray]:
    """Example ``i`` of the numbered data set: its features, its target and its number."""
    x = np.random.default_rng(i).normal(size=8).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(keepdims=True)).astype(np.float32), "id": np.int32(i)}


def numbered_data(kind: str, examples: int = 100_000):
    """The numbered examples as an iterable of host-local batches (``ROWS`` global rows each) of this
    process."""
    import grain

    ds = grain.MapDataset.range(examples).map(example)
    if kind == "elastic":
        shards = grain.sharding.ShardOptions(jax.process_index(), jax.process_count())
        return grain.experimental.ElasticIterator(ds, ROWS, shards)
    per = ROWS // jax.process_count()  # each process its own slice: a position that holds for this count only
    return ds[jax.process_index() :: jax.process_count()].batch(per, drop_remainder=True).to_iter_dataset()


class RecordingTrainer(RegressionTrainer):
    """Writes the example numbers this process feeds at each step to ``path`` (a line per step, flushed)."""

    path: Path | None = None

    def global_batch(self, batch):
        if self.path is not None and "id" in batch:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": self.step + 1, "ids": np.asarray(batch["id"]).tolist()}) + "\n")
        return super().global_batch(batch)


def seen(workdir: Path, restart: int, steps: range) -> dict[int, list[int]]:
    """The example numbers each of ``steps`` fed in run ``restart``, from every process's record, sorted."""
    out: dict[int, list[int]] = {s: [] for s in steps}
    for path in sorted(workdir.glob(f"seen-{restart}-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["step"] in out:
                out[record["step"]] += record["ids"]
    return {s: sorted(ids) for s, ids in out.items()}


def job_events(workdir: Path, name: str) -> list[dict]:
    """The ``name`` events in the job's metrics.jsonl, in the order they were written."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == name]


def recovered_event(workdir: Path) -> dict:
    """The one ``recovered`` event in the job's metrics.jsonl."""
    (recovered,) = job_events(workdir, "recovered")
    return recovered


FAULTS = ("step", "snapshot", "save", "restart")


def branch_data(step: int) -> dict[str, np.ndarray]:
    """The batches of the branch ``--rollback`` starts: not those of the run it left."""
    return {k: v + 1.0 for k, v in batch_for(step, rows=ROWS).items()}


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(trainer, fault: str, at: int) -> None:
    """This process dies (SIGKILL): after step ``at`` (``step``; also ``restart``'s first death), while
    writing the snapshot of step ``at`` (``snapshot``), inside the save of step ``at`` (``save``), or, with
    ``at`` 0, as it restores after a restart (``restart``)."""
    from nnx_shard._checkpoint import _checkpointer
    from nnx_shard._snapshots import _writer
    from nnx_shard._trainer import _trainer

    if fault in ("step", "restart") and at > 0:
        trainer.add_callback(lambda step, metrics, t: _die() if step == at else None)
    elif fault == "snapshot":
        seal = _writer.SnapshotWriter._seal

        def sealing(self, snapshot):
            if snapshot.step == at:
                _die()  # in the background thread, the snapshot's file half written
            return seal(self, snapshot)

        _writer.SnapshotWriter._seal = sealing
    elif fault == "save":
        save = _checkpointer.Checkpointer.save

        def saving(self, step, *a, **k):
            if step == at:
                threading.Timer(0.02, _die).start()  # inside Orbax's write
            return save(self, step, *a, **k)

        _checkpointer.Checkpointer.save = saving
    elif fault == "restart":
        resume = _trainer.resume_auto

        def resuming(host):
            threading.Timer(0.05, _die).start()  # while the restore runs
            return resume(host)

        _trainer.resume_auto = resuming


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument(
        "--kill",
        default="",
        help="PROCESS:STEP: that process kills itself (SIGKILL) after STEP, first run only",
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--bucket", default="", help="the Trainer's workdir, a gs:// URI (the app's files stay local)"
    )
    ap.add_argument("--step-timeout", type=float, default=None)  # None: the test default (trainer_app)
    ap.add_argument("--startup-timeout", type=float, default=None)  # None: the test default (trainer_app)
    ap.add_argument("--hang-at", default="", help="STEP[:SECONDS]: sleep in STEP's callback (60 s)")
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--width", type=int, default=64, help="of the MLP's hidden layers")
    ap.add_argument("--snapshot-every", type=int, default=0)
    ap.add_argument("--flip", action="store_true", help="on a restart, flip a byte of each snapshot file")
    ap.add_argument("--data", choices=("callable", "elastic", "per-process"), default="callable")
    ap.add_argument("--fault", choices=FAULTS, default="step", help="where --kill strikes (see arm)")
    ap.add_argument(
        "--off-host-at",
        type=int,
        default=0,
        help="first run: after STEP, resize onto process 0's devices alone",
    )
    ap.add_argument(
        "--rollback",
        default="",
        help="STEP:TO: first run, train to STEP, restore step TO and train on other data (--kill then "
        "strikes on that branch); a restart goes on with that data",
    )
    ap.add_argument(
        "--timeline", action="store_true", help="print a timestamped line at each step and phase (to stdout)"
    )
    args = ap.parse_args()
    restart = info.restart if info is not None else 0

    def mark(what: str) -> None:  # one write a line: the processes share the launcher's stdout
        if args.timeline:
            stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]  # one reading of the clock
            os.write(1, f"{stamp} run {restart} process {jax.process_index()}: {what}\n".encode())
            # every thread's stack on stderr when nothing happens for STUCK_S (before the step timeout's
            # 60 s; faulthandler's own thread writes it even while another thread holds the GIL)
            faulthandler.dump_traceback_later(STUCK_S, exit=False)

    mark("started")
    RecordingTrainer.path = Path(args.workdir, f"seen-{restart}-{jax.process_index()}.jsonl")
    trainer = RecordingTrainer(
        {
            **config(args.bucket or args.workdir, total_steps=args.steps),
            "save_every": args.save_every,
            "width": args.width,
            "snapshot_every": args.snapshot_every,
            "snapshot_dir": str(Path(args.workdir) / "snapshots"),
            "async_save": False,
            "resume": "auto",
            "step_timeout": multiprocess_step_timeout() if args.step_timeout is None else args.step_timeout,
            "startup_timeout": multiprocess_startup_timeout()
            if args.startup_timeout is None
            else args.startup_timeout,
            "heartbeat_timeout": 5,
            "shutdown_timeout": 5,
        }
    )
    trainer.add_callback(lambda step, metrics, t: mark(f"step {step} done"))
    data = numbered_data(args.data) if args.data != "callable" else lambda step: batch_for(step, rows=ROWS)
    if args.rollback:  # a branch: from step TO on, other data
        if restart == 0:
            until, to = (int(x) for x in args.rollback.split(":"))
            trainer.train(data, steps=until)
            mark(f"restoring step {to}")
            trainer.restore_and_reshard(step=to)
            mark(f"restored step {to}")
        data = branch_data
    if args.kill and restart == 0:
        who, at = (int(x) for x in args.kill.split(":"))
        if jax.process_index() == who:
            arm(trainer, args.fault, at)
    if args.fault == "restart" and restart == 1 and jax.process_index() == 1:
        arm(trainer, "restart", 0)  # a second death, while the survivors restore
    if args.flip and restart > 0:  # memory gone bad on a survivor: every snapshot it holds has a flipped byte
        for f in Path(args.workdir, "snapshots").glob(
            f"run-{restart - 1}/process-{info.previous_id}/*/*.bin"
        ):
            raw = bytearray(f.read_bytes())
            raw[8] ^= 0xFF  # the first byte of the first piece (after the 8 bytes saying where the header is)
            f.write_bytes(bytes(raw))
    if args.hang_at:
        hang_step, _, seconds = args.hang_at.partition(":")
        trainer.add_callback(
            lambda step, m, t: time.sleep(float(seconds or 60)) if step == int(hang_step) else None
        )
    if args.off_host_at and restart == 0:  # the others on standby: they join the saves, run no step
        trainer.train(data, steps=args.off_host_at)
        trainer.resize("fsdp:-1", devices=[d for d in jax.devices() if d.process_index == 0])
    history = trainer.train(data)
    mark("trained")
    kernel = trainer.states["model"]["out"]["kernel"].get_value()
    result = {
        "restart": restart,
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "restored_step": trainer.restored_step,
        "restored_from": trainer.lineage.restored_from,
        "losses": {int(h["step"]): h["loss"] for h in history},
        "digest": digest(trainer),
        "kernel": [float(v) for v in multihost_utils.process_allgather(kernel, tiled=True).ravel()],
    }
    if jax.process_index() == 0:
        Path(args.workdir, f"result-{restart}.json").write_text(json.dumps(result))
    mark("done")


if __name__ == "__main__":
    main()
