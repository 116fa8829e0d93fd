"""ViTTrainer: the nnx_shard Trainer for the example's ViT, its settings declared in default_config()."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnx_shard as ns
from examples.vit.config import get_config
from examples.vit.model import ViT


class ViTTrainer(ns.Trainer):
    """Cross-entropy on a ViT; adamw with warmup and cosine decay; the rate reported with each log line."""

    @classmethod
    def default_config(cls):
        c = super().default_config()
        for key, value in get_config("tiny").items():  # the ViT's own keys: model, data, learning_rate, ...
            if key not in c:
                c[key] = value
        c.schedule_steps = (
            0  # the learning-rate schedule's length (0: total_steps), apart from where a run stops
        )
        c.record_examples = False  # True: each process writes the example numbers of each step it feeds
        return c

    def global_batch(self, batch):
        """With ``record_examples``, notes the numbered examples (``batch["index"]``) this process feeds to
        the coming step in ``workdir/examples-<process>.jsonl``; a resumed run's lines for a step come after
        the lines an earlier run wrote for it."""
        if self.config.record_examples and self.config.workdir and "index" in batch:
            line = {"step": self.step + 1, "index": np.asarray(batch["index"]).tolist()}
            with Path(self.config.workdir, f"examples-{jax.process_index()}.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        return super().global_batch(batch)

    def create_model(self, rngs):
        return ViT(**self.config.model, rngs=rngs)

    def create_optimizer(self):
        c = self.config
        length = c.schedule_steps or c.total_steps
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, c.learning_rate, c.warmup_steps, max(length, c.warmup_steps + 1)
        )
        # inject_hyperparams keeps the current rate in the optimizer state, so the Trainer logs it.
        adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=c.weight_decay)
        tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
        # Gradient accumulation: optax.MultiSteps(tx, every_k_schedule=k) (its accumulators are sharded
        # like the parameters they mirror).
        return optax.MultiSteps(tx, every_k_schedule=c.accumulate) if c.accumulate > 1 else tx

    def loss_fn(self, model, batch):
        logits = model(batch["images"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["labels"])}
