"""What the non-finite check costs a step: the Trainer's step with it against the same step without it.

Question: does not applying a NaN/Inf step (``config.on_nonfinite``) slow the step down? The
check reads the loss and the global gradient norm the step computes anyway, and selects
between the new and the given state inside the same program. Both Trainers are identical but
for the check (the unguarded one is traced with the selection replaced by the new state);
they run in alternating rounds in one process. Target: ratio <= 1.02. XLA's compiled
``memory_analysis()`` says whether the selection needs more temporary memory.

    python benchmarks/bench_guard.py [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import machine, simulate_devices, write_json

simulate_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_step import STRATEGY, Bench  # noqa: E402

import nnx_shard as ns  # noqa: E402
from nnx_shard._trainer import _guard  # noqa: E402


def unguarded(new, old, guard, metrics, mode):
    """The step without the check: the new state always, the counters unchanged."""
    return new, guard


def build(width, depth, rows, *, guard: bool):
    trainer = Bench(
        {
            "mesh": "fsdp:8",
            "sharding_strategy": STRATEGY,
            "width": width,
            "depth": depth,
            "progress": "off",
            "log_every": 10**9,
            "total_steps": 10**9,
            "workdir": tempfile.mkdtemp(),
            "save_at_end": False,
        }
    )
    rng = np.random.default_rng(0)
    host = {k: rng.normal(size=(rows, width)).astype(np.float32) for k in ("x", "y")}
    batch = ns.host_local_to_global(host, trainer.mesh)
    original = _guard.guarded
    if not guard:
        _guard.guarded = unguarded
    try:
        trainer.train(lambda s: batch, steps=1)  # traces and compiles now
        lowered = trainer.compiled_step(batch).lower(trainer.states, trainer.guard, batch)
        memory = lowered.compile().memory_analysis()
    finally:
        _guard.guarded = original
    return trainer, batch, memory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    width, depth, rows, steps, rounds = (64, 2, 16, 5, 2) if args.smoke else (1024, 4, 256, 30, 9)
    guarded, batch, mem_on = build(width, depth, rows, guard=True)
    plain, _, mem_off = build(width, depth, rows, guard=False)
    times = {"on": [], "off": []}
    for _ in range(rounds):  # alternate, so machine noise hits both alike
        for name, trainer in (("on", guarded), ("off", plain)):
            t = time.perf_counter()
            trainer.train(lambda s: batch, steps=steps)
            jax.block_until_ready(trainer.states)
            times[name].append((time.perf_counter() - t) / steps)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    result = {
        "benchmark": "bench_guard",
        "machine": machine(),
        "params": sum(x.size for x in jax.tree.leaves(guarded.states["model"])),
        "step_ms_with_check": round(1e3 * on, 3),
        "step_ms_without_check": round(1e3 * off, 3),
        "ratio": round(on / off, 3),
        "target_ratio": 1.02,
        "temp_bytes_with_check": getattr(mem_on, "temp_size_in_bytes", None),
        "temp_bytes_without_check": getattr(mem_off, "temp_size_in_bytes", None),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
