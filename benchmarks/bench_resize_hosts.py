"""Resize a live state off a host and back, in the processes: nnx_shard vs going through the host.

Question: when a job of 2 processes x 4 devices moves its model, optimizer and EMA onto
process 0's 4 devices and back (the host count changes, every process stays), what does
``ShardingHooks.on_mesh_change`` cost against what a user would otherwise do? ``jax.device_put``
refuses a move onto another set of processes' devices, and Orbax 0.12.8 cannot restore onto a
mesh that leaves a process out, so the baseline goes through the host: off the host with
``multihost_utils.process_allgather`` then ``jax.make_array_from_callback``, back with
``multihost_utils.broadcast_one_to_all`` from process 0 then the same. State: 4 layers of 2048x2048 with
bias, adamw + EMA (256 MiB), fsdp=8 -> fsdp=4 on process 0's devices -> fsdp=8. Each variant
is its own job under ``nnx_shard.launch``; process 0 reports a cold round trip and the median
of three warm ones, the bytes moved against the plan's ideal, the devices of process 1 left
holding nothing in between, and a bitwise check of every leaf against the state created again.

A save while the state is off a host costs more: Orbax 0.12 writes only arrays that every process
holds, so the Trainer copies the state onto the whole mesh first (``ShardingHooks.states_on``) and the
process left out joins the write. The nnx_shard variant times a synchronous, verified save of the
state on the whole mesh and one of it while off (the copy included), each the median of three.

    python benchmarks/bench_resize_hosts.py [--smoke]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from common import machine, no_host_transfers, write_json

STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
VARIANTS = ("nnx_shard on_mesh_change", "through the host")
WARM_ROUNDS = 3


def worker(variant: str, layers: int, width: int, out: str) -> None:
    import jax
    import jax.numpy as jnp
    from common import stack_state_factory
    from flax import nnx

    import nnx_shard as ns

    ns.cluster.initialize_distributed()
    everywhere = ns.create_mesh((-1,), ("fsdp",))
    first = ns.create_mesh((-1,), ("fsdp",), devices=[d for d in jax.devices() if d.process_index == 0])
    meshes = {"off": first, "back": everywhere}
    create = stack_state_factory(layers, width)
    hooks = ns.ShardingHooks(STRATEGY, everywhere)
    objects = hooks.on_init(create)
    jax.block_until_ready(hooks.states())
    plans = {where: ns.plan_sharding(hooks.states(), STRATEGY, m) for where, m in meshes.items()}
    state_bytes = plans["back"].total_bytes
    held_off = None

    def move(where: str) -> dict[str, object]:
        nonlocal held_off
        began = time.perf_counter()
        result: dict[str, object] = {}
        if variant.startswith("nnx_shard"):
            with no_host_transfers(jax):
                report = hooks.on_mesh_change(meshes[where])
            result.update(bytes_moved=report.bytes_moved, ideal_bytes=report.ideal_bytes)
        else:
            states = {k: nnx.state(v) for k, v in objects.items()}
            leaves, treedef = jax.tree.flatten(states)
            targets = jax.tree.leaves(plans[where].shardings)
            moved = treedef.unflatten(
                [through_host(x, t, where) for x, t in zip(leaves, targets, strict=True)]
            )
            for k, v in objects.items():
                nnx.update(v, moved[k])
        jax.block_until_ready({k: nnx.state(v) for k, v in objects.items()})
        result["s"] = round(time.perf_counter() - began, 3)
        if where == "off":
            held_off = sum(len(x.addressable_shards) for x in jax.tree.leaves(nnx.state(objects["model"])))
        return result

    rounds = []
    for _ in range(1 + WARM_ROUNDS):
        off, back = move("off"), move("back")
        rounds.append({"off": off, "back": back, "round_trip_s": round(off["s"] + back["s"], 3)})
    saves = saves_on_and_off(hooks, move, everywhere, out) if variant.startswith("nnx_shard") else None
    fresh, _ = ns.create_sharded(create, STRATEGY, everywhere)
    got = jax.tree.leaves({k: nnx.state(v) for k, v in objects.items()})
    want = jax.tree.leaves({k: nnx.state(v) for k, v in fresh.items()})
    bitwise = len(got) == len(want) and all(
        bool(jnp.array_equal(a, b)) for a, b in zip(got, want, strict=True)
    )
    warm = sorted(rounds[1:], key=lambda r: r["round_trip_s"])[len(rounds[1:]) // 2]
    result = {
        "variant": variant,
        "process": jax.process_index(),
        "state_bytes": state_bytes,
        "cold": rounds[0],
        "warm": warm,
        "model_shards_on_this_process_while_off": held_off,
        "bitwise_equal": bitwise,
        "saves": saves,
    }
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump(result, f)


def saves_on_and_off(hooks, move, everywhere, out: str) -> dict[str, float]:
    """Median seconds of a synchronous save on the whole mesh, and of one while the state is off process 1
    (copied onto the whole mesh first, as the Trainer does); the state ends on the whole mesh."""
    import nnx_shard as ns

    checkpointer = ns.Checkpointer(f"{out}.ckpt", max_to_keep=1, async_save=False)
    times: dict[str, list[float]] = {"on_whole_mesh": [], "while_off": [], "copy": []}
    step = 0
    for _ in range(WARM_ROUNDS):
        step += 1
        began = time.perf_counter()
        hooks.save(checkpointer, step)
        times["on_whole_mesh"].append(time.perf_counter() - began)
        move("off")
        step += 1
        began = time.perf_counter()
        copy = hooks.states_on(everywhere)
        times["copy"].append(time.perf_counter() - began)
        checkpointer.save(step, copy, mesh=everywhere)
        times["while_off"].append(time.perf_counter() - began)
        del copy
        move("back")
    checkpointer.close()
    shutil.rmtree(f"{out}.ckpt", ignore_errors=True)
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def through_host(x, target, where: str):
    """What a user writes without nnx_shard: the whole array on the host of every process, then placed."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if where == "off":  # from every process's devices: gathered to every host
        host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    else:  # from process 0's devices alone: broadcast from its host
        mine = np.asarray(x) if jax.process_index() == 0 else np.zeros(x.shape, x.dtype)
        host = np.asarray(multihost_utils.broadcast_one_to_all(mine))
    x.delete()
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index], dtype=host.dtype)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        variant, layers, width, out = args.worker
        worker(variant, int(layers), int(width), out)
        return
    from nnx_shard.cluster import launch

    layers, width = (2, 256) if args.smoke else (4, 2048)
    folder = tempfile.mkdtemp(prefix="bench_resize_hosts_")
    runs = {}
    for n, variant in enumerate(VARIANTS):
        out = os.path.join(folder, f"v{n}")
        command = [sys.executable, __file__, "--worker", variant, str(layers), str(width), out]
        if launch(command, 2, devices_per_process=4):
            raise SystemExit(f"{variant}: the job failed (its output is above)")
        runs[variant] = [json.load(open(f"{out}.{p}.json")) for p in range(2)]
    shutil.rmtree(folder, ignore_errors=True)
    ours, theirs = (runs[v][0] for v in VARIANTS)
    result = {
        "benchmark": "bench_resize_hosts",
        "machine": {**machine(), "devices": "2 processes x 4 cpu"},
        "state_bytes": ours["state_bytes"],
        "runs": runs,
        "warm_round_trip_s": {v: runs[v][0]["warm"]["round_trip_s"] for v in VARIANTS},
        "warm_ratio_vs_through_host": round(
            ours["warm"]["round_trip_s"] / max(theirs["warm"]["round_trip_s"], 1e-9), 3
        ),
        "bytes_moved_over_ideal": round(
            statistics.fmean(
                ours["warm"][k]["bytes_moved"] / max(ours["warm"][k]["ideal_bytes"], 1)
                for k in ("off", "back")
            ),
            3,
        ),
        "process_1_shards_while_off": runs[VARIANTS[0]][1]["model_shards_on_this_process_while_off"],
        "save_s": ours["saves"],
        "save_while_off_ratio": round(
            ours["saves"]["while_off"] / max(ours["saves"]["on_whole_mesh"], 1e-9), 3
        ),
        "bitwise_equal": all(r["bitwise_equal"] for v in VARIANTS for r in runs[v]),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
