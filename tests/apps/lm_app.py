"""A tiny decoder-style language model Trainer the job tests run here and in fresh processes."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns

VOCAB, WIDTH, CONTEXT = 64, 32, 8


class TinyLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = WIDTH):
        self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
        self.mix = nnx.Linear(width, width, rngs=rngs)
        self.head = nnx.Linear(width, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.head(jax.nn.gelu(self.mix(self.embed(tokens).mean(axis=1))))


class LMTrainer(ns.Trainer):
    @classmethod
    def default_config(cls):
        c = super().default_config()
        c.width = WIDTH
        c.peak_lr = 3e-3
        return c

    def create_model(self, rngs):
        return TinyLM(rngs, self.config.width)

    def create_optimizer(self):
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, self.config.peak_lr, 4, max(self.config.total_steps, 5)
        )
        return optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)

    def loss_fn(self, model, batch):
        logits = model(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["target"]).mean()


def records(n: int = 64, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A small corpus: each record a context of tokens and the next token."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, CONTEXT)).astype(np.int32)
    return [{"tokens": t, "target": np.int32(t.sum() % VOCAB)} for t in tokens]


def stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class ResumableBatches:
    """A plain iterator with the get_state/set_state protocol (no grain needed)."""

    def __init__(self, rows: list[dict[str, np.ndarray]], batch: int = 8, seed: int = 0):
        self.rows, self.batch, self.seed, self.position = rows, batch, seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        order = np.random.default_rng(self.seed + self.position // len(self.rows)).permutation(len(self.rows))
        start = self.position % len(self.rows)
        picked = [self.rows[i] for i in order[start : start + self.batch]]
        if len(picked) < self.batch:
            raise StopIteration
        self.position += self.batch
        return stack(picked)

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = int(state["position"])


def config(workdir: str = "", **extra) -> dict:
    return {
        "mesh": "fsdp:-1",
        "sharding_strategy": [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")],
        "workdir": workdir,
        "log_every": 1,
        "progress": "off",
        "total_steps": 8,
        "async_save": False,
        **extra,
    }


def headless(workdir: str, resume: bool = False) -> None:
    """Runs in a child process whose stdout is a pipe: the log lines must reach it."""
    trainer = LMTrainer(
        {**config(workdir), "progress": "auto", "log_every": 2, "total_steps": 6, "save_every": 3}
    )
    if resume:
        trainer.restore_and_reshard()
    trainer.train(ResumableBatches(records()), steps=3 if not resume else None)


if __name__ == "__main__":  # python tests/apps/lm_app.py WORKDIR [resume]
    import os
    import sys

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("XLA_FLAGS", None)
    jax.config.update("jax_num_cpu_devices", 8)
    headless(sys.argv[1], resume=len(sys.argv) > 2)
