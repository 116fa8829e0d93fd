"""Sharded init vs "init, then device_put" for a model + adamw + EMA state of at least 1 GiB.

Question: does creating the state directly in its shardings (nnx_shard.create_sharded,
a jax.jit with out_shardings) save memory and time over the usual path, building
everything unsharded on one device and then jax.device_put-ing it?

Each variant runs in a fresh subprocess of this script (peak RSS only grows within a
process), on 8 simulated CPU devices; the parent compares them.

    python benchmarks/bench_init.py            # 8 layers of 3072x3072: 1.1 GiB of state
    python benchmarks/bench_init.py --smoke
"""

from __future__ import annotations

import json
import time

from common import (
    create_state,
    machine,
    peak_rss_bytes,
    run_variants,
    simulate_devices,
    stack_state_factory,
    variant_args,
    write_json,
)

STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def run_variant(variant: str, layers: int, width: int) -> dict[str, object]:
    simulate_devices(8)
    import jax
    import numpy as np

    import nnx_shard as ns

    mesh = ns.create_mesh((8,), ("fsdp",))
    create = stack_state_factory(layers, width)
    base_rss = peak_rss_bytes()
    start = time.perf_counter()
    result: dict[str, object] = {}
    states, plan, memory = create_state(variant, create, STRATEGY, mesh)
    if memory is not None:
        result["xla_output_bytes_per_device"] = memory.output_size_in_bytes
        result["xla_temp_bytes_per_device"] = memory.temp_size_in_bytes
    seconds = time.perf_counter() - start
    per_device: dict[object, int] = {}
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    kernel = states["optimizer"]["opt_state"][0]["mu"]["layers"][0]["kernel"].get_value()
    checksum = float(
        np.asarray(jax.device_get(states["model"]["layers"][layers - 1]["kernel"].get_value()))
        .astype(np.float64)
        .sum()
    )
    result.update(
        variant=variant,
        seconds=round(seconds, 3),
        state_bytes=plan.total_bytes,
        plan_bytes_per_device=plan.bytes_per_device,
        live_bytes_fullest_device=max(per_device.values()),
        peak_rss_bytes=peak_rss_bytes(),
        peak_rss_growth_bytes=peak_rss_bytes() - base_rss,
        mu_spec=str(kernel.sharding.spec),
        checksum=checksum,
    )
    return result


def main() -> None:
    args = variant_args(__doc__)
    layers, width = args.layers, args.width
    if args.variant:
        print(json.dumps(run_variant(args.variant, layers, width)))
        return
    runs = run_variants(__file__, ("create_sharded", "init_then_device_put"), args)
    ours, base = runs["create_sharded"], runs["init_then_device_put"]
    assert ours["checksum"] == base["checksum"], "the two inits differ"
    simulate_devices(8)
    result = {
        "benchmark": "bench_init",
        "machine": machine(),
        "layers": layers,
        "width": width,
        "state_gib": round(ours["state_bytes"] / 2**30, 3),
        "runs": runs,
        "time_ratio_ours_over_baseline": round(ours["seconds"] / base["seconds"], 3),
        "peak_rss_growth_ratio_ours_over_baseline": round(
            ours["peak_rss_growth_bytes"] / base["peak_rss_growth_bytes"], 3
        ),
        "peak_rss_growth_over_state": {
            "create_sharded": round(ours["peak_rss_growth_bytes"] / ours["state_bytes"], 2),
            "init_then_device_put": round(base["peak_rss_growth_bytes"] / base["state_bytes"], 2),
        },
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
