"""A Trainer step against a hand-written jax.jit step with the same shardings, in one run.

Question: does the Trainer add anything to the cost of a step? Both loops get the same
pre-placed global batch, the same model, adamw and EMA on the same shardings with the state
donated; metrics are fetched only at the end. Target: ratio <= 1.03.

    python benchmarks/bench_step.py [--smoke]
"""

from __future__ import annotations

import tempfile

from common import hand_written_step, interleaved_timing, machine, simulate_devices, step_args, write_json

simulate_devices(8)

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
    return trainer, ns.host_local_to_global(host, trainer.mesh)


def main() -> None:
    args, (width, depth, rows, steps, rounds) = step_args()
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
    batch = ns.host_local_to_global(host, mesh)
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
    write_json(result, args.out)


if __name__ == "__main__":
    main()
