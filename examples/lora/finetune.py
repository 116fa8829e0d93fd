"""Fine-tune a pretrained Llama-style decoder with LoRA: load into shards, check, train, resume smaller,
export.

    python examples/lora/finetune.py [--workdir DIR] [--steps N]

1. Writes base weights in Hugging Face's names and (out, in) layout to ``DIR/base`` (no download).
2. Creates the decoder sharded on 8 simulated devices (fsdp:8), loads the weights with
   ``ns.load_safetensors`` in ``Trainer.load_pretrained``, and checks its logits against a NumPy
   forward pass of the same files (the check that catches "loads fine, nonsense output").
3. Fine-tunes the LoRA adapters only (``Trainer.wrt`` defaults to ``nnx.LoRAParam``) on the
   Zen of Python, byte by byte, saving checkpoints without the frozen base (``save_frozen=False``).
4. Resumes the same run on 4 devices, the base loaded again from the files.
5. Exports the model with the adapters merged, in the base files' layout, and loads it back.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import optax
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import nnx_shard as ns
from examples.lora.model import KEY_MAP, Config, Decoder, hf_weights, numpy_forward

CFG = Config()
SEQ, BATCH = 32, 16


def zen_tokens() -> np.ndarray:
    """The Zen of Python (from the standard library's ``this``), as bytes."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return np.frombuffer(codecs.decode(this.s, "rot13").encode(), np.uint8).astype(np.int32)


def batch_for(step: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    starts = rng.integers(0, len(tokens) - SEQ - 1, BATCH)
    rows = np.stack([tokens[s : s + SEQ + 1] for s in starts])
    return {"x": rows[:, :-1], "y": rows[:, 1:]}


class LoRATrainer(ns.Trainer):
    @classmethod
    def default_config(cls):
        c = super().default_config()
        c.base = ""  # the pretrained weights' folder
        return c

    def create_model(self, rngs):
        return Decoder(CFG, rngs)

    def create_optimizer(self):
        return optax.adam(3e-3)

    def loss_fn(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def load_pretrained(self, model):
        self.load_report = ns.load_safetensors(model, self.config.base, KEY_MAP)
        return self.load_report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp())
    base = work / "base"
    base.mkdir(parents=True, exist_ok=True)
    weights = hf_weights(CFG)
    save_file(weights, str(base / "model.safetensors"))
    tokens = zen_tokens()
    strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
    config = {
        "base": str(base),
        "workdir": str(work / "run"),
        "mesh": "fsdp:8",
        "sharding_strategy": strategy,
        "total_steps": args.steps,
        "save_every": args.steps // 2,
        "save_frozen": False,
        "resume": "auto",
        "progress": "off",
        "log_every": 10,
    }
    trainer = LoRATrainer(config)
    trainer.init()
    probe = batch_for(0, tokens)["x"][:2]
    ours = np.asarray(trainer.training_state["model"](probe))
    reference = numpy_forward(weights, probe, CFG)
    logits_diff = float(np.abs(ours - reference).max())
    assert logits_diff < 1e-3, f"the loaded model's logits differ from NumPy's by {logits_diff}"
    loss_before = trainer.evaluate([batch_for(10**6, tokens)], use_ema=False)["eval_loss"]
    trainer.train(lambda s: batch_for(s, tokens), steps=args.steps // 2)
    # the same run resumed on 4 devices: the base from the files again, the adapters from the checkpoint
    resumed = LoRATrainer({**config, "mesh": ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])})
    resumed.train(lambda s: batch_for(s, tokens))
    export = work / "export"
    ns.save_safetensors(resumed.training_state["model"], export, KEY_MAP, like=base)
    check = Decoder(CFG, __import__("flax").nnx.Rngs(1))
    ns.load_safetensors(check, export, KEY_MAP)
    merged_logits = np.asarray(check(probe))
    tuned_logits = np.asarray(resumed.training_state["model"](probe))
    plan = trainer.plan
    last = work / "run" / "checkpoints" / str(args.steps)  # one checkpoint: adapters, adam, EMA, no base
    figures = {
        "trainable_bytes": plan.bytes_by_label().get("trainable", 0),
        "frozen_bytes": plan.bytes_by_label().get("frozen", 0),
        "load": str(trainer.load_report),
        "load_gb_per_s": round(trainer.load_report.gb_per_s, 3),
        "logits_vs_numpy_max_diff": logits_diff,
        "eval_loss_before": loss_before,
        "eval_loss_after": resumed.evaluate([batch_for(10**6, tokens)], use_ema=False)["eval_loss"],
        "load_bytes_read_over_needed": trainer.load_report.bytes_read / trainer.load_report.bytes_needed,
        "resumed_from_step": resumed.restored_step,
        "export_vs_tuned_logits_max_diff": float(np.abs(merged_logits - tuned_logits).max()),
        "checkpoint_bytes": sum(f.stat().st_size for f in last.rglob("*") if f.is_file()),
        "base_bytes": sum(v.nbytes for v in weights.values()),
    }
    print(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
