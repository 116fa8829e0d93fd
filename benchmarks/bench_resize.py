"""Resize a live state from 8 devices to 4 and back, in one process: nnx_shard vs what a user would do.

Question: what does ``ShardingHooks.on_mesh_change`` (what ``Trainer.resize`` calls) cost against the two ways
a user would otherwise change the device count of a running job: (a) a synchronous save to local disk, then
``restore_and_reshard`` onto the new mesh (the live state freed before the read), and (b) ``jax.device_put``
of every leaf to the shardings inferred for the new mesh (donated). State: model + adamw + EMA, 8 layers of
3072x3072 with bias (1.125 GiB), fsdp=8 -> fsdp=4 on devices[:4] -> fsdp=8. Each variant runs in a fresh
subprocess (peak RSS only grows) and reports, for a first (cold) round trip and warm ones (the median of the
next three): wall time, process peak RSS growth, live bytes on the fullest device after each move against the
plan (and, for nnx_shard, after every step of a third, untimed round trip), and a bitwise check: after the
round trip, every leaf is compared with ``jnp.array_equal`` against the same state created again from the same
seed, and every sharding against the one inferred for 8 devices. nnx_shard runs under transfer guards that
forbid any host transfer, explicit ones included.

    python benchmarks/bench_resize.py [--smoke]
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time

from common import (
    DeviceMemory,
    live_bytes_per_device,
    machine,
    median_warm,
    no_host_transfers,
    peak_rss_bytes,
    run_variants,
    simulate_devices,
    stack_state_factory,
    variant_args,
    write_json,
)

STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
WARM_ROUNDS = 3
VARIANTS = ("nnx_shard on_mesh_change", "save + restore_and_reshard", "jax.device_put")


def run_variant(variant: str, layers: int, width: int) -> dict[str, object]:
    simulate_devices(8)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import nnx_shard as ns

    devices = jax.devices()
    meshes = {8: ns.create_mesh((8,), ("fsdp",)), 4: ns.create_mesh((4,), ("fsdp",), devices=devices[:4])}
    create = stack_state_factory(layers, width)
    hooks = ns.ShardingHooks(STRATEGY, meshes[8])
    objects = hooks.on_init(create)
    jax.block_until_ready(hooks.states())
    plans = {n: ns.plan_sharding(hooks.states(), STRATEGY, m) for n, m in meshes.items()}
    workdir = tempfile.mkdtemp(prefix="bench_resize_")
    ckpt = ns.Checkpointer(workdir, async_save=False, max_to_keep=1)
    step = 0
    base_rss = peak_rss_bytes()

    def move(n: int) -> dict[str, object]:
        nonlocal step
        out: dict[str, object] = {}
        if variant.startswith("nnx_shard"):
            with no_host_transfers(jax):
                report = hooks.on_mesh_change(meshes[n])
            out.update(report=str(report), bytes_moved=report.bytes_moved, ideal_bytes=report.ideal_bytes)
        elif variant.startswith("save"):
            step += 1
            t = time.perf_counter()
            ckpt.save(step, objects, mesh=meshes[8 if n == 4 else 4])
            out["save_s"] = round(time.perf_counter() - t, 3)
            out["report"] = str(ns.restore_and_reshard(ckpt, objects, STRATEGY, meshes[n], free_live=True))
        else:
            states = {k: nnx.state(v) for k, v in objects.items()}
            moved = jax.device_put(states, plans[n].shardings, donate=True)
            for k, v in objects.items():
                nnx.update(v, moved[k])
        jax.block_until_ready({k: nnx.state(v) for k, v in objects.items()})
        out["fullest_device_after_bytes"] = max(live_bytes_per_device(jax).values())
        out["plan_bytes_per_device"] = plans[n].bytes_per_device
        return out

    rounds = []
    # Cold (compiles, first touch of memory), then three warm round trips, of which the median is
    # reported: the first warm one still pays the allocator's settling (as in bench_reshard).
    for _ in range(1 + WARM_ROUNDS):
        t = time.perf_counter()
        down = move(4)
        down["s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        up = move(8)
        up["s"] = round(time.perf_counter() - t, 3)
        rounds.append({"to_4": down, "to_8": up, "round_trip_s": round(down["s"] + up["s"], 3)})
    rss = peak_rss_bytes() - base_rss
    fullest_during = None
    if variant.startswith("nnx_shard"):  # a third, untimed round trip counts live bytes after every step
        memory = DeviceMemory(jax)
        hooks.on_mesh_change(meshes[4])
        hooks.on_mesh_change(meshes[8])
        memory.close()
        fullest_during = memory.fullest
    ckpt.close()
    shutil.rmtree(workdir, ignore_errors=True)

    # Bitwise: the same state created again from the same seed, leaf by leaf, on the devices.
    states = {k: nnx.state(v) for k, v in objects.items()}
    fresh, _ = ns.create_sharded(create, STRATEGY, meshes[8])
    fresh = {k: nnx.state(v) for k, v in fresh.items()}
    got, want = jax.tree.leaves(states), jax.tree.leaves(fresh)
    targets = jax.tree.leaves(plans[8].shardings)
    bitwise = len(got) == len(want) and all(
        bool(jnp.array_equal(a, b)) for a, b in zip(got, want, strict=True)
    )
    placed = all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(got, targets, strict=True))
    return {
        "variant": variant,
        "state_bytes": plans[8].total_bytes,
        "leaves": len(got),
        "cold": rounds[0],
        "warm": median_warm(rounds),
        "first_warm": rounds[1],
        "peak_rss_growth_bytes": rss,
        "fullest_device_during_bytes": fullest_during,
        "bitwise_equal": bitwise,
        "shardings_as_planned": placed,
    }


def main() -> None:
    args = variant_args(__doc__)
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.layers, args.width)))
        return
    runs = run_variants(__file__, VARIANTS, args)
    simulate_devices(8)
    ours = runs["nnx_shard on_mesh_change"]
    state = ours["state_bytes"]
    result = {
        "benchmark": "bench_resize",
        "machine": machine(),
        "layers": args.layers,
        "width": args.width,
        "state_gib": round(state / 2**30, 3),
        "runs": runs,
        "ratios": {
            key: {
                "time_vs_save_restore": round(
                    ours[key]["round_trip_s"] / runs["save + restore_and_reshard"][key]["round_trip_s"], 3
                ),
                "time_vs_device_put": round(
                    ours[key]["round_trip_s"] / runs["jax.device_put"][key]["round_trip_s"], 3
                ),
            }
            for key in ("cold", "warm")
        },
        "peak_rss_over_state": {k: round(v["peak_rss_growth_bytes"] / state, 2) for k, v in runs.items()},
        "all_bitwise_equal": all(r["bitwise_equal"] and r["shardings_as_planned"] for r in runs.values()),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
