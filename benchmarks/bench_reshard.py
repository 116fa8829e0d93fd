"""fsdp:8 -> tp:4 on half the devices and back, for a model + adamw + EMA state of at least 1 GiB.

Question: what does nnx_shard.reshard cost against what a user would otherwise do, in one
process: jax.device_put straight to the new shardings, or the seed's host round trip
(device_get, then device_put)? Reported per variant, for a first (cold: compiles, first
touch of memory) round trip and warm ones (the median of the next three; the deep state,
one): wall time, bytes moved between devices
against the ideal, the plan's peak per device and the measured one (live bytes on the
fullest device after every step of a third, untimed round trip, above the larger of the
layouts before and after), process peak RSS, whether the host is
used (nnx_shard runs under transfer guards that forbid any host transfer, explicit ones
included), and bandwidth against this machine's memcpy measured in the same run. A second
state of 10,000 small leaves (a deep model) reports what planning and dispatch cost, beside
jax.device_put of the same state. Each variant runs in a fresh subprocess (peak RSS only
grows).

    python benchmarks/bench_reshard.py           # 8 layers of 3072x3072: 1.1 GiB
    python benchmarks/bench_reshard.py --smoke
"""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np
from common import (
    DeviceMemory,
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

FSDP = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
TP = [(".*kernel", "shard_dim(axis='tp', dim=-1)"), (".*", "replicate")]
WARM_ROUNDS = 3
VARIANTS = (
    "nnx_shard.reshard",
    "nnx_shard.place_like_target",  # device arrays placed on a target: the same engine since 2026-11-27
    "jax.device_put",
    "host round trip",
    "nnx_shard, 10k small leaves",
    "jax.device_put, 10k small leaves",
)


def memcpy_gbps(nbytes: int = 512 * 2**20) -> float:
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(4):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def deep_state_factory(layers: int):
    """A deep model's state, many small leaves: ``layers`` blocks of four 64x64 or 64-wide arrays, + adamw +
    EMA."""
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs)

    class Deep(nnx.Module):
        def __init__(self, rngs):  # one Rngs per block: nnx.eval_shape slows down with one shared by many
            self.blocks = nnx.List([Block(nnx.Rngs(i)) for i in range(layers)])

    def create():
        model = Deep(nnx.Rngs(0))
        return {
            "model": model,
            "optimizer": nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
            "ema": nnx.EMA(model, 0.99, only=nnx.Param),
        }

    return create


def run_variant(variant: str, layers: int, width: int) -> dict[str, object]:
    simulate_devices(8)
    import jax
    from flax import nnx

    import nnx_shard as ns

    devices = jax.devices()
    fsdp = ns.create_mesh((8,), ("fsdp",))
    tp = ns.create_mesh((4,), ("tp",), devices=devices[:4])
    deep = variant.endswith("small leaves")
    # 625 blocks: 2,500 model leaves, 10,000 with adamw's mu and nu and the EMA (a few in the smoke run).
    if (
        deep
    ):  # created eagerly, then placed: XLA's CPU compile of 1,250 separate inits in one jit takes minutes
        objects = deep_state_factory(625 if width >= 1024 else 8)()
        plan = ns.plan_sharding(objects, FSDP, fsdp)
        state = jax.device_put({k: nnx.state(v) for k, v in objects.items()}, plan.shardings)
    else:
        objects, plan = ns.create_sharded(stack_state_factory(layers, width), FSDP, fsdp)
        state = {k: nnx.state(v) for k, v in objects.items()}
    state = jax.block_until_ready(state)
    del objects
    to_tp = ns.infer_sharding(state, TP, tp)
    to_fsdp = ns.infer_sharding(state, FSDP, fsdp)
    reference = [np.asarray(x) for x in jax.tree.leaves(state)[:4]]
    base_rss = peak_rss_bytes()

    def move(tree, target):
        if variant == "nnx_shard.place_like_target":  # not donating: the inputs are deleted after it
            out = ns.place_like_target(tree, target)
            jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, tree)
            return out
        if variant.startswith("nnx_shard"):
            return ns.reshard(tree, target, donate=True)
        if variant.startswith("jax.device_put"):
            return jax.device_put(tree, target, donate=True)
        host = jax.device_get(tree)  # the seed's approach
        jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, tree)
        return jax.device_put(host, target)

    result: dict[str, object] = {
        "variant": variant,
        "state_bytes": plan.total_bytes,
        "leaves": len(plan.leaves),
    }
    ours = variant.startswith("nnx_shard")
    if ours:
        t = time.perf_counter()
        there_plan, back_plan = ns.resharding.plan_reshard(state, to_tp), None
        result["plan_s"] = round(time.perf_counter() - t, 3)
    else:  # does the baseline copy through the host? A small probe under the guard says.
        probe = jax.device_put(
            np.ones((64, 64), np.float32),
            jax.sharding.NamedSharding(fsdp, jax.sharding.PartitionSpec("fsdp")),
        )
        try:
            with no_host_transfers(jax):
                jax.block_until_ready(
                    move(
                        {"w": probe},
                        {"w": jax.sharding.NamedSharding(tp, jax.sharding.PartitionSpec(None, "tp"))},
                    )
                )
            result["goes_through_host"] = False
        except Exception:
            result["goes_through_host"] = True
    rounds = []
    # Cold (first compile, first touch of memory), then warm: the median of three round trips for
    # the big state (the first warm one still pays the allocator's settling, by up to 2x here).
    for _ in range(2 if deep else 1 + WARM_ROUNDS):
        with (
            no_host_transfers(jax) if ours else contextlib.nullcontext()
        ):  # nnx_shard runs under the guard: no step goes through the host
            t = time.perf_counter()
            state = jax.block_until_ready(move(state, to_tp))
            there = time.perf_counter() - t
            if ours and back_plan is None:
                back_plan = ns.resharding.plan_reshard(state, to_fsdp)
            t = time.perf_counter()
            state = jax.block_until_ready(move(state, to_fsdp))
            back = time.perf_counter() - t
        rounds.append(
            {"there_s": round(there, 3), "back_s": round(back, 3), "round_trip_s": round(there + back, 3)}
        )
    if ours:
        result["goes_through_host"] = False
    if ours and not deep:  # a third, untimed round trip counts live bytes per device after every step
        memory = DeviceMemory(jax)
        at_rest = [max(memory.sample().values())]
        state = move(state, to_tp)
        at_rest.append(max(memory.sample().values()))
        state = move(state, to_fsdp)
        at_rest.append(max(memory.sample().values()))
        memory.close()
        # Above the larger of the layouts before and after: the transient the plan's peak bounds.
        result["measured_transient_bytes_per_device"] = memory.fullest - max(at_rest)
        result["fullest_device_bytes"] = memory.fullest
    got = [np.asarray(x) for x in jax.tree.leaves(state)[:4]]
    assert all((a == b).all() for a, b in zip(got, reference, strict=True)), (
        "the round trip changed the values"
    )
    result.update(
        cold=rounds[0],
        warm=median_warm(rounds),
        first_warm=rounds[1],
        peak_rss_growth_bytes=peak_rss_bytes() - base_rss,
    )
    if variant.startswith("nnx_shard"):
        result.update(
            bytes_moved=there_plan.bytes_moved + back_plan.bytes_moved,
            ideal_bytes=there_plan.ideal_bytes + back_plan.ideal_bytes,
            peak_bytes_per_device=max(there_plan.peak_bytes_per_device, back_plan.peak_bytes_per_device),
            steps=len(there_plan.jobs) + len(back_plan.jobs),
            routes=there_plan.summary().split(";")[0] + " | back: " + back_plan.summary().split(";")[0],
        )
    return result


def share_of_memcpy(bytes_moved: int, seconds: float, gbps: float) -> float:
    """The rate at which the moved bytes went, as a share of this machine's memcpy."""
    return bytes_moved / 1e9 / seconds / gbps


def repeated(args) -> dict:
    """The big state's nnx_shard and host round-trip variants ``args.repeat`` times, alternating, with
    memcpy measured beside each pair: the median warm share of memcpy and time against the host."""
    import statistics

    shares, ratios, pairs = {"warm": [], "first_warm": []}, {"warm": [], "first_warm": []}, []
    simulate_devices(8)
    for _ in range(args.repeat):
        runs = run_variants(__file__, ("nnx_shard.reshard", "host round trip"), args)
        gbps = memcpy_gbps()
        ours, host = runs["nnx_shard.reshard"], runs["host round trip"]
        pair = {"memcpy_gb_per_s": round(gbps, 2)}
        for key in shares:  # the median of the warm round trips, and the first of them alone
            mine, theirs = ours[key]["round_trip_s"], host[key]["round_trip_s"]
            shares[key].append(share_of_memcpy(ours["bytes_moved"], mine, gbps))
            ratios[key].append(mine / theirs)
            pair.update({f"{key}_s": mine, f"host_{key}_s": theirs})
        pairs.append(pair)
    return {
        "benchmark": "bench_reshard --repeat",
        "machine": machine(),
        "layers": args.layers,
        "width": args.width,
        "runs": pairs,
        "median_warm_share_of_memcpy": round(statistics.median(shares["warm"]), 3),
        "median_warm_time_vs_host_round_trip": round(statistics.median(ratios["warm"]), 3),
        "median_first_warm_share_of_memcpy": round(statistics.median(shares["first_warm"]), 3),
        "median_first_warm_time_vs_host_round_trip": round(statistics.median(ratios["first_warm"]), 3),
        "targets": {"share_of_memcpy": 0.25, "time_vs_host_round_trip": 1.0},
    }


def main() -> None:
    args = variant_args(__doc__)
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.layers, args.width)))
        return
    if args.repeat > 1:
        write_json(repeated(args), args.out)
        return
    runs = run_variants(__file__, VARIANTS, args)
    simulate_devices(8)
    gbps = memcpy_gbps()
    big = {k: v for k, v in runs.items() if not k.endswith("small leaves")}
    ours = runs["nnx_shard.reshard"]
    moved_gb = ours["bytes_moved"] / 1e9
    for r in big.values():
        for key in ("cold", "warm"):
            r[key]["gb_per_s_of_bytes_moved"] = round(moved_gb / r[key]["round_trip_s"], 2)
            r[key]["share_of_memcpy"] = round(
                share_of_memcpy(ours["bytes_moved"], r[key]["round_trip_s"], gbps), 3
            )
    deep = runs["nnx_shard, 10k small leaves"]
    result = {
        "benchmark": "bench_reshard",
        "machine": machine(),
        "layers": args.layers,
        "width": args.width,
        "state_gib": round(ours["state_bytes"] / 2**30, 3),
        "memcpy_gb_per_s": round(gbps, 2),
        "runs": runs,
        "ratios": {
            key: {
                "time_vs_host_round_trip": round(
                    ours[key]["round_trip_s"] / runs["host round trip"][key]["round_trip_s"], 3
                ),
                "time_vs_device_put": round(
                    ours[key]["round_trip_s"] / runs["jax.device_put"][key]["round_trip_s"], 3
                ),
            }
            for key in ("cold", "warm")
        },
        "place_like_target_vs_device_put": {
            key: round(
                runs["nnx_shard.place_like_target"][key]["round_trip_s"]
                / runs["jax.device_put"][key]["round_trip_s"],
                3,
            )
            for key in ("cold", "warm")
        },
        "rss_vs_device_put": round(
            ours["peak_rss_growth_bytes"] / max(1, runs["jax.device_put"]["peak_rss_growth_bytes"]), 3
        ),
        "rss_vs_host_round_trip": round(
            ours["peak_rss_growth_bytes"] / max(1, runs["host round trip"]["peak_rss_growth_bytes"]), 3
        ),
        "deep_model": {
            "leaves": deep["leaves"],
            "plan_s": deep["plan_s"],
            "cold_round_trip_s": deep["cold"]["round_trip_s"],
            "warm_round_trip_s": deep["warm"]["round_trip_s"],
            "plan_share_of_cold_there": round(deep["plan_s"] / deep["cold"]["there_s"], 3),
            "warm_ms_per_leaf_per_direction": round(
                1e3 * deep["warm"]["round_trip_s"] / 2 / deep["leaves"], 4
            ),
            "steps": deep["steps"],
            "device_put_warm_round_trip_s": runs["jax.device_put, 10k small leaves"]["warm"]["round_trip_s"],
            "warm_time_vs_device_put": round(
                deep["warm"]["round_trip_s"]
                / runs["jax.device_put, 10k small leaves"]["warm"]["round_trip_s"],
                3,
            ),
        },
        "targets": {
            "bytes_moved": "= ideal",
            "through_host": False,
            "time_vs_host_round_trip": 1.0,
            "share_of_memcpy": 0.25,
        },
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
