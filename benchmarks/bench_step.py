"""A Trainer step against a hand-written jax.jit step with the same shardings, in one run.

Question: does the Trainer add anything to the cost of a step? Both loops get the same
pre-placed global batch, the same model, adamw and EMA on the same shardings with the state
donated; metrics are fetched only at the end. Target: ratio <= 1.03. ``host_bound`` says the
same of a step so small that it is all dispatch, in a child process on one device: the host's
work per step that the Trainer adds (``host_overhead_ms``).

    python benchmarks/bench_step.py [--smoke]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from common import (
    call_fixed_cost,
    hand_written_step,
    interleaved_timing,
    machine,
    simulate_devices,
    step_args,
    write_json,
)

HOST_BOUND = "--host-bound"  # the child process that measures the host's work per step, on one device
simulate_devices(1 if HOST_BOUND in sys.argv else 8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import nnx_shard as ns  # noqa: E402

STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


class MLP(nnx.Module):
    def __init__(self, rngs, width, depth):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return x


class Bench(ns.Trainer):
    @classmethod
    def default_config(cls):
        c = super().default_config()
        c.width, c.depth = 1024, 4
        return c

    def create_model(self, rngs):
        return MLP(rngs, self.config.width, self.config.depth)

    def create_optimizer(self):
        return optax.adamw(1e-3)

    def loss_fn(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def quiet_trainer(width, depth, rows, cls=Bench, **config):
    """A Trainer that logs nothing and never saves, and a pre-placed global batch of ``rows`` rows.

    ``config`` adds to or overrides the defaults (``mesh`` is ``"fsdp:8"``). Nothing is compiled yet.
    """
    trainer = cls(
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
            **config,
        }
    )
    rng = np.random.default_rng(0)
    host = {k: rng.normal(size=(rows, width)).astype(np.float32) for k in ("x", "y")}
    return trainer, ns.cluster.host_local_to_global(host, trainer.mesh)


def host_bound(smoke: bool) -> dict[str, float]:
    """The host's work per step: a model so small that a step is all dispatch (64 x 64, 2 layers, 16 rows),
    on one device, quiet, 200 steps a round (20 with ``smoke``). What a user of a small model, or of an
    accelerator much faster than its host, pays per step beyond the hand-written loop; and what a ``train()``
    call costs beyond its steps (its files, lock, final flush), which a short call spreads over few steps."""
    import jax.numpy as jnp

    trainer, batch = quiet_trainer(64, 2, 16, mesh="fsdp:1")
    trainer.init()
    jitted, states = hand_written_step(trainer, batch, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    ours, theirs, _ = interleaved_timing(
        trainer, batch, jitted, states, 20 if smoke else 200, 3 if smoke else 7
    )
    return {
        "trainer_step_ms": round(1e3 * ours, 4),
        "hand_jit_step_ms": round(1e3 * theirs, 4),
        "host_overhead_ms": round(1e3 * (ours - theirs), 4),
        "ratio": round(ours / theirs, 3),
        "train_call_fixed_ms": round(1e3 * call_fixed_cost(trainer, batch, 10 if smoke else 60), 3),
    }


def main() -> None:
    args, (width, depth, rows, steps, rounds) = step_args(HOST_BOUND)
    if args.host_bound:
        print(json.dumps(host_bound(args.smoke)))
        return
    cfg = {
        "mesh": "fsdp:8",
        "sharding_strategy": STRATEGY,
        "width": width,
        "depth": depth,
        # Logging on every step, as a user watching a run would: stdout, metrics.jsonl, TensorBoard.
        "progress": "lines",
        "log_every": 1,
        "total_steps": 10**9,
        "workdir": tempfile.mkdtemp(),
        "save_at_end": False,  # steps, not checkpoints, are compared
    }
    trainer = Bench(cfg)
    mesh = trainer.mesh
    rng = np.random.default_rng(0)
    host = {
        "x": rng.normal(size=(rows, width)).astype(np.float32),
        "y": rng.normal(size=(rows, width)).astype(np.float32),
    }
    batch = ns.cluster.host_local_to_global(host, mesh)
    trainer.init()
    jitted, states = hand_written_step(trainer, batch, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    ours, theirs, diff = interleaved_timing(trainer, batch, jitted, states, steps, rounds)
    result = {
        "benchmark": "bench_step",
        "machine": machine(),
        "params": sum(x.size for x in jax.tree.leaves(trainer.states["model"])),
        "batch": rows,
        "trainer_step_ms": round(1e3 * ours, 3),
        "hand_jit_step_ms": round(1e3 * theirs, 3),
        "ratio": round(ours / theirs, 3),
        "max_param_diff_vs_hand": diff,  # the same steps from the same state: float noise only
        "target_ratio": 1.03,
        "trainer_logging": "every step: stdout line, metrics.jsonl, TensorBoard",
    }
    child = [sys.executable, __file__, HOST_BOUND] + (["--smoke"] if args.smoke else [])
    done = subprocess.run(child, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the host-bound measurement failed:\n{done.stderr[-3000:]}")
    result["host_bound"] = json.loads(done.stdout.strip().splitlines()[-1])
    write_json(result, args.out)


if __name__ == "__main__":
    main()
