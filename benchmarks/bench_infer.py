"""infer_sharding on an abstract train state of 10,000+ leaves (deep stack + adamw + EMA).

Question: how long does inference take, and does it allocate anything? The
baseline is the seed's approach written by hand: a loop of regex searches
over flattened paths, first match wins, no mirroring, no checks and no plan.

    python benchmarks/bench_infer.py            # 160 layers, 10,000+ leaves
    python benchmarks/bench_infer.py --smoke    # a few layers, for the tests
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from common import machine, peak_rss_bytes, simulate_devices, write_json

simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import nnx_shard as ns  # noqa: E402


class Block(nnx.Module):
    """A transformer block's parameters: 16 leaves."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.q, self.k = nnx.Linear(d, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
        self.v, self.o = nnx.Linear(d, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)


def abstract_train_state(layers: int, d: int) -> dict[str, nnx.State]:
    """Model, nnx.Optimizer(adamw) and EMA states of ``layers`` blocks, all abstract.

    One block's abstract state is repeated: ``nnx.eval_shape`` of a deep
    unscanned model grows faster than quadratically on flax 0.12.
    """
    block = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Block(d, nnx.Rngs(0)))))
    params = {"layers": {i: block for i in range(layers)}}
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
    step = jax.ShapeDtypeStruct((), np.uint32)
    return {
        "model": nnx.State(params),
        "optimizer": nnx.State({"step": step, "opt_state": opt_state}),
        "ema": nnx.State({"params": params}),
    }


STRATEGY = [
    (r"^layers/\d+/(q|k|v)/kernel$", "shard_dim(axis='tp', dim=-1)|fsdp(axis='fsdp')"),
    (r"^layers/\d+/o/kernel$", "shard_dim(axis='tp', dim=0)|fsdp(axis='fsdp')"),
    (r"^layers/\d+/up/kernel$", "shard_dim(axis='tp', dim=-1)|fsdp(axis='fsdp')"),
    (r"^layers/\d+/down/kernel$", "shard_dim(axis='tp', dim=0)|fsdp(axis='fsdp')"),
    (r".*/ln\d/.*", "replicate"),
    (r".*", "fsdp(axis='fsdp')"),
]


def seed_style(state, mesh):
    """The baseline: regex first-match over flattened paths, fsdp or replicate, nothing else."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in flat]
    compiled = [re.compile(p) for p, _ in STRATEGY]
    out = []
    for name, (_, x) in zip(names, flat, strict=True):
        spec = [None] * len(x.shape)
        for rx, (_, tactic) in zip(compiled, STRATEGY, strict=True):
            if rx.search(name):
                if "fsdp" in tactic and x.ndim:
                    for i in np.argsort(x.shape)[::-1]:
                        if x.shape[i] % mesh.shape["fsdp"] == 0:
                            spec[i] = "fsdp"
                            break
                break
        out.append(NamedSharding(mesh, PartitionSpec(*spec)))
    return jax.tree_util.tree_unflatten(treedef, out)


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    layers = 4 if args.smoke else args.layers
    repeats = 2 if args.smoke else 5
    mesh = ns.create_mesh((4, 2), ("fsdp", "tp"))
    state = abstract_train_state(layers, d=1024)
    n_leaves = len(jax.tree.leaves(state))

    arrays_before = len(jax.live_arrays())
    rss_before = peak_rss_bytes()
    (_shardings, plan), t_ours = timed(
        lambda: ns.infer_sharding(state, STRATEGY, mesh, return_plan=True), repeats
    )
    arrays_after = len(jax.live_arrays())
    _, t_seed = timed(lambda: seed_style(state, mesh), repeats)

    mirrored = sum(1 for p in plan.leaves if p.matched)
    result = {
        "benchmark": "bench_infer",
        "machine": machine(),
        "layers": layers,
        "leaves": n_leaves,
        "state_bytes": plan.total_bytes,
        "bytes_per_device": plan.bytes_per_device,
        "infer_sharding_s": round(t_ours, 4),
        "seed_style_loop_s": round(t_seed, 4),
        "ratio_vs_seed_style": round(t_ours / t_seed, 2),
        "us_per_leaf": round(1e6 * t_ours / n_leaves, 1),
        "leaves_matched_by_parameter_path": mirrored,
        "jax_arrays_allocated": arrays_after - arrays_before,
        "peak_rss_growth_bytes": peak_rss_bytes() - rss_before,
        "target_under_1s_for_10k_leaves": t_ours < 1.0 * max(n_leaves, 10_000) / 10_000,
    }
    assert result["jax_arrays_allocated"] == 0, "inference allocated device arrays"
    write_json(result, args.out)


if __name__ == "__main__":
    main()
