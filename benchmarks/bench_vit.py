"""ViT training throughput (images/s): the Trainer against a hand-written jit loop with the same shardings.

Both loops train the example's ViT (examples/vit) with the same strategy, mesh, optimizer,
EMA and pre-placed global batch, in alternating rounds in one process.

    python benchmarks/bench_vit.py                          # tiny ViT on 8x8 digits-sized images, 8 CPU
    devices python benchmarks/bench_vit.py --config s16 --batch 32  # ViT-S/16 on 224x224 synthetic images
    python benchmarks/bench_vit.py --real-devices --config b16 --batch 256   # on a GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import CompilePhases, hand_written_step, interleaved_timing, machine, simulate_devices, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--real-devices", action="store_true")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of each loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.real_devices:
        simulate_devices(8)
    import jax
    import numpy as np
    import optax

    import nnx_shard as ns
    from examples.vit.config import get_config
    from examples.vit.trainer import ViTTrainer

    cfg = get_config(args.config)
    batch_size, steps, rounds = (16, 3, 2) if args.smoke else (args.batch, args.steps, args.rounds)

    def loss(model, batch):
        logits = model(batch["images"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    class Bench(ViTTrainer):  # the example's Trainer, with the hand-written step's optimizer and loss
        def create_optimizer(self):
            return optax.adamw(1e-3)

        def loss_fn(self, model, batch):
            return loss(model, batch)

    # Logging on every step, as a user watching a run would: a line on stdout, metrics.jsonl, TensorBoard.
    workdir = tempfile.mkdtemp()
    trainer = Bench(
        {
            **cfg.to_dict(),
            "progress": "lines",
            "log_every": 1,
            "total_steps": 10**9,
            "workdir": workdir,
            "save_at_end": False,
        }
    )
    with CompilePhases() as init_compile:  # the sharded init (model, optimizer, EMA)
        trainer.init()
    rng = np.random.default_rng(0)
    size, channels = cfg.data.image_size, cfg.data.channels
    host = {
        "images": rng.normal(size=(batch_size, size, size, channels)).astype(np.float32),
        "labels": rng.integers(0, cfg.data.num_classes, batch_size).astype(np.int32),
    }
    batch = ns.cluster.host_local_to_global(host, trainer.mesh)
    jitted, states = hand_written_step(trainer, batch, loss)
    with CompilePhases() as trainer_compile:  # the Trainer's first call: its step's compile
        trainer.train(lambda step: batch, steps=1)
    with CompilePhases() as hand_compile:  # the hand-written step's first call (both then take equal steps)
        states, metrics = jitted(states, batch)
        jax.block_until_ready(metrics)
    ours, theirs, diff = interleaved_timing(trainer, batch, jitted, states, steps, rounds)
    result = {
        "benchmark": "bench_vit",
        "machine": machine(),
        "config": args.config,
        "mesh": ns.meshes.describe_mesh(trainer.mesh),
        "params": sum(x.size for x in jax.tree.leaves(trainer.states["model"])),
        "batch": batch_size,
        "trainer_images_per_s": round(batch_size / ours, 1),
        "hand_jit_images_per_s": round(batch_size / theirs, 1),
        "ratio_trainer_time_over_hand": round(ours / theirs, 3),
        "max_param_diff_vs_hand": diff,  # the same steps from the same state: adamw amplifies float noise
        "trainer_logging": "every step: stdout line, metrics.jsonl, TensorBoard",
        "compile_phases_s": {  # what each compile's time went to: tracing, lowering, XLA's compile
            "trainer_init": init_compile.seconds,
            "trainer_first_call": trainer_compile.seconds,
            "hand_jit_first_step": hand_compile.seconds,
        },
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
