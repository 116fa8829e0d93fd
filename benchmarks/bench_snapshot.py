"""What in-memory snapshots cost a step: the same Trainer with snapshot_every 0, 10 and 1, in one process.

Question: does copying each process's shards to host memory (plus the peer copy's
collective) every N steps slow training? Three Trainers, identical but for
``snapshot_every``, run in alternating rounds (4.2M-parameter MLP, adamw + EMA, fsdp:8, one
process: the peer copy is this process's own). Target: snapshot_every=10 costs < 2%.

    python benchmarks/bench_snapshot.py [--smoke]
"""

from __future__ import annotations

import statistics
import time

from common import machine, simulate_devices, step_args, write_json

simulate_devices(8)

import jax  # noqa: E402
from bench_step import quiet_trainer  # noqa: E402

from nnx_shard._checkpoint._snapshot import snapshot_own_bytes  # noqa: E402


def build(width, depth, rows, every):
    trainer, batch = quiet_trainer(width, depth, rows, snapshot_every=every)  # snapshots in /dev/shm
    trainer.train(lambda s: batch, steps=1)
    return trainer, batch


def main() -> None:
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
    ms = {every: statistics.median(t) * 1e3 for every, t in times.items()}
    own = snapshot_own_bytes(built[10][0].states)
    result = {
        "benchmark": "bench_snapshot",
        "machine": machine(),
        "params": sum(x.size for x in jax.tree.leaves(built[0][0].states["model"])),
        "snapshot_bytes_per_process": own,
        "step_ms_no_snapshot": round(ms[0], 3),
        "step_ms_every_10": round(ms[10], 3),
        "step_ms_every_1": round(ms[1], 3),
        "ratio_every_10": round(ms[10] / ms[0], 3),
        "ratio_every_1": round(ms[1] / ms[0], 3),
        "target_ratio_every_10": 1.02,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
