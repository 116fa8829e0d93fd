"""Where the seconds of a small real model's sharded creation go, against ``nnx.eval_shape`` plus one compile.

Question: what does ``ns.create_sharded`` add to what any sharded init must pay, on a model users bring
(google-tunix's Llama3, built from the tiny Hugging Face folder in tests/data/hf/llama, 417 KiB)?

The baseline is what a user would write by hand: ``nnx.eval_shape(factory)`` for the shapes, then one
``jax.jit`` of the init, lowered, compiled and run. ``create_sharded`` is timed in the same process on
a fresh factory each round (nothing cached between rounds), with its parts: the abstract creation, the
plan, and the compile and run of the sharded init. Goal: at most 1.5x the baseline.

    python benchmarks/bench_create.py [--rounds 3] [--out results/bench_create.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import machine, simulate_devices, write_json

FOLDER = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf" / "llama"
STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def one_round(ns, nnx, jax, cls, config, mesh) -> dict[str, float]:
    factory = lambda: cls(config, rngs=nnx.Rngs(0))
    t0 = time.perf_counter()
    nnx.eval_shape(factory)
    t1 = time.perf_counter()
    jax.block_until_ready(jax.jit(lambda: nnx.state(factory())).lower().compile()())
    t2 = time.perf_counter()
    factory = lambda: cls(config, rngs=nnx.Rngs(0))
    init, _, _ = ns.placement.sharded_init_fn(factory, STRATEGY, mesh)
    t3 = time.perf_counter()
    compiled = init.lower().compile()
    t4 = time.perf_counter()
    jax.block_until_ready(compiled())
    t5 = time.perf_counter()
    factory = lambda: cls(config, rngs=nnx.Rngs(0))
    model, _ = ns.create_sharded(factory, STRATEGY, mesh)
    jax.block_until_ready(nnx.state(model))
    t6 = time.perf_counter()
    return {
        "baseline_eval_shape_s": t1 - t0,
        "baseline_compile_and_run_s": t2 - t1,
        "baseline_s": t2 - t0,
        "abstract_and_plan_s": t3 - t2,
        "compile_s": t4 - t3,
        "run_s": t5 - t4,
        "create_sharded_s": t6 - t5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one round")
    parser.add_argument("--out")
    args = parser.parse_args()
    simulate_devices(8)
    import jax
    from flax import nnx

    import nnx_shard as ns

    cls, config = ns.key_maps.tunix_model(FOLDER)
    mesh = ns.create_mesh((8,), ("fsdp",))
    rounds = [one_round(ns, nnx, jax, cls, config, mesh) for _ in range(1 if args.smoke else args.rounds)]
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    result = {
        "benchmark": "create",
        "machine": machine(),
        "model": "google-tunix Llama3 from tests/data/hf/llama (417 KiB), fsdp:8",
        "rounds": rounds,
        "median": {k: round(v, 4) for k, v in median.items()},
        "ratio_create_sharded_vs_baseline": round(median["create_sharded_s"] / median["baseline_s"], 3),
    }
    for k, v in result["median"].items():
        print(f"{k:28s} {v:.3f} s")
    print(f"create_sharded / (eval_shape + one compile): {result['ratio_create_sharded_vs_baseline']:.2f}x")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
