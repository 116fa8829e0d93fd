"""A 1.125 GiB state saved to and restored from a GCS bucket: nnx_shard's Checkpointer against plain Orbax.

The bucket is fake-gcs-server on 127.0.0.1 (the test extra's wheel), every client pointed at it, so the
figures price what each side sends and does, not a network. Both sides write the same states to the same
bucket in one process on 8 CPU devices, in alternating rounds, and read them back into the same target
shardings:
- nnx_shard: ``Checkpointer.save`` (fingerprints, metadata, the file manifest) and ``Checkpointer.restore``
  (structure check, Orbax's read, fingerprints verified on the devices);
- orbax: ``CheckpointManager.save`` / ``restore`` of the same states with a target built by hand.
Each side saves and restores once untimed first (its process's first pays the client's set-up). Target:
within 10% of plain Orbax both ways (the medians of the rounds).

    python benchmarks/bench_bucket.py [--smoke] [--rounds 3] [--out results/bench_bucket.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import machine, simulate_devices, stack_state_factory, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/bucket.py: the emulator

STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    layers, width = (2, 256) if args.smoke else (args.layers, args.width)
    simulate_devices(8)
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import nnx_shard as ns
    from nnx_shard.placement import abstract_target
    from tests.bucket import FakeGCS, point_at

    with FakeGCS() as gcs:
        point_at(gcs.url)
        bucket = "gs://" + gcs.make_bucket("bench")
        mesh = ns.create_mesh((8,), ("fsdp",))
        hooks = ns.ShardingHooks(STRATEGY, mesh)
        hooks.on_init(stack_state_factory(layers, width))
        states = hooks.states()
        target = abstract_target(states, hooks.plan)
        times: dict[str, list[float]] = {"save": [], "orbax_save": [], "restore": [], "orbax_restore": []}
        ours = ns.Checkpointer(f"{bucket}/nnx_shard", async_save=False, max_to_keep=None)
        theirs = ocp.CheckpointManager(
            f"{bucket}/orbax", options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True)
        )
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        checks = []

        def restore_theirs(step: int) -> object:
            item = ocp.args.PyTreeRestore(target, restore_args=restore_args)
            return theirs.restore(step, args=ocp.args.Composite(state=item))["state"]

        # a warm-up save and restore a side, untimed: each side's first pays the process's client set-up
        ours.save(0, states, mesh=mesh)
        theirs.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states)))
        theirs.wait_until_finished()
        jax.block_until_ready((ours.restore(0, target)[1], restore_theirs(0)))
        for step in range(1, args.rounds + 1):
            order = ("ours", "orbax") if step % 2 else ("orbax", "ours")
            for side in order:  # saves, alternating which goes first
                t = time.perf_counter()
                if side == "ours":
                    ours.save(step, states, mesh=mesh)
                    times["save"].append(time.perf_counter() - t)
                else:
                    theirs.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states)))
                    theirs.wait_until_finished()
                    times["orbax_save"].append(time.perf_counter() - t)
            for side in order:  # reads into the same target shardings
                t = time.perf_counter()
                if side == "ours":
                    got = ours.restore(step, target)[1]
                    key = "restore"
                else:
                    got = restore_theirs(step)
                    key = "orbax_restore"
                jax.block_until_ready(got)
                times[key].append(time.perf_counter() - t)
                checks.append(float(np.asarray(jax.tree.leaves(got)[0]).sum()))
                del got
        ours.close()
        theirs.close()
    assert len(set(checks)) == 1, "the two sides restored different values"
    median = {k: round(statistics.median(v), 3) for k, v in times.items()}
    result = {
        "benchmark": "bench_bucket",
        "machine": machine(),
        "storage": "fake-gcs-server on 127.0.0.1 (filesystem backend)",
        "state_gib": round(hooks.plan.total_bytes / 2**30, 3),
        "rounds": args.rounds,
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "median_s": median,
        "save_ratio_vs_orbax": round(median["save"] / median["orbax_save"], 3),
        "restore_ratio_vs_orbax": round(median["restore"] / median["orbax_restore"], 3),
        "targets": {"save_ratio_vs_orbax": 1.10, "restore_ratio_vs_orbax": 1.10},
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
