"""What in-memory snapshots cost a step: the same Trainer with snapshot_every 0, 10 and 1, in one process.

Question: does taking a snapshot of each process's shards in host memory every N
steps slow training? Three Trainers, identical but for ``snapshot_every``, run
in alternating rounds (4.2M-parameter MLP, adamw + EMA, fsdp:8, one process: the
peer copy is this process's own); each round gives a ratio against the Trainer
without snapshots, and the median of the rounds is reported. Target:
snapshot_every=10 costs at most 2%.

Where a snapshot's time goes is measured apart, from outside, on the same state:
what ``write`` takes on the step's path (CPU devices: the agreement and the copy
straight into the snapshot file, before the next step may donate the buffers)
and what ``wait`` then waits for, the work left to a background thread beside
the next steps (each piece's fingerprint share, the header). At snapshot_every=1
a snapshot still being written when the next is due is skipped: the count is
reported. On GPUs and TPUs a snapshot starts with one program per device that
copies its shards and sums their fingerprint shares (``_snapshots._device``):
XLA's bytes accessed by those programs, over one read and one write of the
shards, says whether the shares are summed in the copy's pass (1.0) or in
passes of their own (the CPU, which does not stage, compiles them for the figure).

With several processes each snapshot also goes to a peer process. The ``two_processes`` part runs a
job of 2 processes x 2 CPU devices (``nnx_shard.cluster.launch``) whose steps leave the host idle, as
on a GPU (``time.sleep``; the CPUs here are too few for two processes' real steps to say anything),
with a snapshot every 10 steps or none in alternating rounds: the ratio of the two, and what the steps
that start a snapshot (``write``) and send its copy to the peer (``poll``; on CPU devices it hands the
copy to the writer's thread) took, timed around the calls.

    python benchmarks/bench_snapshot.py [--smoke]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from common import machine, simulate_devices, step_args, write_json

WORKER = "--worker" in sys.argv  # a process of the two-process part: its devices are set by its launch
if not WORKER:
    simulate_devices(8)

import jax  # noqa: E402
from bench_step import quiet_trainer  # noqa: E402

from nnx_shard._snapshots import SnapshotWriter, _device, own_shards, snapshot_own_bytes  # noqa: E402


def build(width, depth, rows, every):
    trainer, batch = quiet_trainer(width, depth, rows, snapshot_every=every)  # snapshots in /dev/shm
    trainer.train(lambda s: batch, steps=1)
    return trainer, batch


def where_the_time_goes(states, repeats: int = 5) -> dict[str, object]:
    """One snapshot of ``states``, ``repeats`` times: ms on the step's path (``write``) and in the
    background (what ``wait`` then waits for), the best of each."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # host memory, as the Trainer's snapshots
    writer = SnapshotWriter(tempfile.mkdtemp(prefix="bench_snapshot_", dir=shm), keep=2)
    on_path, total = [], []
    for k in range(repeats):
        jax.block_until_ready(states)
        began = time.perf_counter()
        writer.write(k, states)
        on_path.append(time.perf_counter() - began)
        writer.wait()
        total.append(time.perf_counter() - began)
    writer.close(remove=True)
    return {"on_path_ms": min(on_path) * 1e3, "background_ms": (min(total) - min(on_path)) * 1e3}


def stage_traffic(states) -> float:
    """XLA's bytes accessed by the devices' stage programs (each shard's copy and its fingerprint share, as on
    GPUs and TPUs), over one read and one write of the shards: 1.0 when each shard is read once."""
    shards = own_shards(states)
    accessed = 0.0
    args = [jax.ShapeDtypeStruct(s.data.shape, s.data.dtype, sharding=s.data.sharding) for s in shards]
    for _, members, key in _device._work(shards):
        cost = _device._program(key).lower([args[k] for k in members]).compile().cost_analysis()
        accessed += (cost if isinstance(cost, dict) else cost[0])["bytes accessed"]
    return accessed / (2 * sum(int(s.data.nbytes) for s in shards))


def snapshot_events(trainer) -> tuple[int, int]:
    """How many snapshots ``trainer`` took and skipped (its ``snapshot`` and ``snapshot_skipped`` events)."""
    lines = trainer.observer.metrics_path.read_text().splitlines()
    events = [json.loads(line).get("event") for line in lines]
    return events.count("snapshot"), events.count("snapshot_skipped")


def worker(mb: int, steps: int, rounds: int, step_s: float, out: str) -> None:
    """One process of the two-process part: ``steps`` steps of ``step_s`` seconds that leave the host idle,
    with a snapshot every 10 or none, in alternating rounds; process 0 writes what it measured."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import nnx_shard as ns

    ns.cluster.initialize_distributed()
    mesh = ns.create_mesh((-1,), ("fsdp",))
    rows = mb * 2**20 // 4096
    data = jnp.arange(rows * 1024, dtype=jnp.float32).reshape(rows, 1024)
    states = {"w": jax.device_put(data, NamedSharding(mesh, PartitionSpec("fsdp")))}
    times, calls = {0: [], 10: []}, {"write": [], "poll": []}
    for r in range(rounds):
        for every in (0, 10):  # one writer per round, as one per train() call
            writer = SnapshotWriter(f"{out}_snapshots", keep=2) if every else None
            began = time.perf_counter()
            # the steps go on from round to round, as a Trainer's from one train() call to the next (a writer
            # that found its folder's snapshots newer than its own would reuse the wrong files first), and
            # each round has its snapshots at the same of its steps
            first = r * -(-steps // 10) * 10
            for step in range(first + 1, first + steps + 1):
                if writer is not None:
                    t = time.perf_counter()
                    writer.poll(step - 1)  # before the step, as the Trainer's loop
                    if (step - 1) % every == 1:  # the poll that sends the copy to the peer
                        calls["poll"].append(time.perf_counter() - t)
                time.sleep(step_s)
                if writer is not None and step % every == 0:
                    t = time.perf_counter()
                    writer.write(step, states, skip_if_busy=True)
                    calls["write"].append(time.perf_counter() - t)
            times[every].append(time.perf_counter() - began)  # to the last step's end, not the last write's
            if writer is not None:
                writer.close(remove=r == rounds - 1)
    if jax.process_index() == 0:
        ratios = [t / t0 for t, t0 in zip(times[10], times[0], strict=True)]
        with open(f"{out}.json", "w") as f:
            json.dump(
                {
                    "ratio_every_10": round(statistics.median(ratios), 4),
                    "by_round": ratios,
                    "step_ms": step_s * 1e3,
                    "median_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in calls.items()},
                },
                f,
            )


def two_processes(smoke: bool) -> dict[str, object]:
    """The two-process part (``worker``), run as a job of 2 processes x 2 CPU devices."""
    from nnx_shard.cluster import launch

    mb, steps, rounds, step_s = (4, 25, 2, 0.01) if smoke else (128, 65, 5, 0.03)
    folder = tempfile.mkdtemp(
        prefix="bench_snapshot_2p_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    out = os.path.join(folder, "result")
    command = [sys.executable, __file__, "--worker", str(mb), str(steps), str(rounds), str(step_s), out]
    if launch(command, 2, devices_per_process=2):
        raise SystemExit("the two-process part failed (its output is above)")
    result = json.load(open(f"{out}.json"))
    shutil.rmtree(folder, ignore_errors=True)
    return {"state_mb": mb, "steps_per_round": steps, "rounds": rounds, **result}


def main() -> None:
    if WORKER:
        mb, steps, rounds, step_s, out = sys.argv[sys.argv.index("--worker") + 1 :]
        worker(int(mb), int(steps), int(rounds), float(step_s), out)
        return
    args, (width, depth, rows, steps, rounds) = step_args()
    steps = max(steps, 10)
    built = {every: build(width, depth, rows, every) for every in (0, 10, 1)}
    times = {every: [] for every in built}
    for _ in range(rounds):
        for every, (trainer, batch) in built.items():
            t = time.perf_counter()
            trainer.train(lambda s, b=batch: b, steps=steps)
            jax.block_until_ready(trainer.states)
            times[every].append((time.perf_counter() - t) / steps)
    ratios = {every: [t / t0 for t, t0 in zip(times[every], times[0], strict=True)] for every in (10, 1)}
    ms = {every: statistics.median(t) * 1e3 for every, t in times.items()}
    taken, skipped = snapshot_events(built[1][0])
    states = built[0][0].hooks.states()
    where = where_the_time_goes(states)
    own = snapshot_own_bytes(built[10][0].states)
    traffic = stage_traffic(states)
    two = two_processes(args.smoke)
    result = {
        "benchmark": "bench_snapshot",
        "machine": machine(),
        "params": sum(x.size for x in jax.tree.leaves(built[0][0].states["model"])),
        "snapshot_bytes_per_process": own,
        "step_ms_no_snapshot": round(ms[0], 3),
        "step_ms_every_10": round(ms[10], 3),
        "step_ms_every_1": round(ms[1], 3),
        "ratio_every_10": round(statistics.median(ratios[10]), 4),
        "ratio_every_1": round(statistics.median(ratios[1]), 4),
        "ratios_every_10_by_round": [round(r, 4) for r in ratios[10]],
        "snapshot_ms_on_the_steps_path": round(where["on_path_ms"], 2),
        "snapshot_ms_in_the_background": round(where["background_ms"], 2),
        "stage_bytes_over_one_read_and_write": round(traffic, 3),
        "snapshots_taken_every_1": taken,
        "snapshots_skipped_every_1": skipped,
        "target_ratio_every_10": 1.02,
        "two_processes": two,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
