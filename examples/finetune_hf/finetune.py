"""Fine-tune a Hugging Face model with google-tunix and qwix LoRA, sharded, and give it back to Hugging Face.

    python examples/finetune_hf/finetune.py [--folder HF_FOLDER] [--steps 6] [--workdir /tmp/ft]

The path a user takes, each step one call:
  1. tunix's class and config from the folder's config.json (ns.key_maps.tunix_model);
  2. the Trainer creates the model with qwix's LoRA adapters already sharded over fsdp (all devices),
     loads the Hugging Face weights into it (the key map is chosen from config.json) and trains the
     adapters only (the base weights are frozen: Trainer.wrt becomes nnx.LoRAParam by itself);
  3. it resumes from its checkpoint on half the devices;
  4. the merged model is written as a Hugging Face folder (split files, index, config.json copied), and the
     adapters alone as a PEFT folder. With torch, transformers and peft installed (make test-interop),
     both are opened by them and their logits compared with the JAX model's.

The default folder is the tiny random Llama in tests/data/hf/llama; any LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM or Gemma 1, 2 or 3 folder works the same, as transformers 4.x or 5.x wrote
it (tests/data/hf/transformers-*; nothing is downloaded). A config field the model cannot compute (a yarn
RoPE, a softcap tunix's Gemma 3 lacks...) stops it at the first line with UnsupportedConfigError naming the
field.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx

import nnx_shard as ns

DEFAULT = Path(__file__).resolve().parents[2] / "tests" / "data" / "hf" / "llama"
TOKENS = np.array([[1, 5, 9, 17, 33, 65, 127, 3], [2, 4, 8, 16, 32, 64, 100, 7]], np.int32)


def forward(model, tokens):
    b, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    return model(jnp.asarray(tokens), positions, None, mask)[0]


def lora_model(folder: Path, seed: int = 0) -> nnx.Module:
    """tunix's model for ``folder`` with qwix LoRA (rank 4, alpha 8) on q_proj, v_proj and down_proj."""
    cls, config = ns.key_maps.tunix_model(folder)
    provider = qwix.LoraProvider(module_path=".*(q_proj|v_proj|down_proj)", rank=4, alpha=8.0)
    b, n = TOKENS.shape
    args = (jnp.asarray(TOKENS), jnp.broadcast_to(jnp.arange(n), (b, n)), None, jnp.ones((b, n, n), bool))
    return qwix.apply_lora_to_model(cls(config, rngs=nnx.Rngs(seed)), provider, *args, rngs=nnx.Rngs(1))


def batches(step: int) -> dict[str, np.ndarray]:
    return {"tokens": np.tile(TOKENS, (4, 1))}


def trainer_for(folder: Path, devices: int, workdir: str, steps: int) -> ns.Trainer:
    """A Trainer that fine-tunes the adapters of :func:`lora_model` on ``devices`` devices, saving to
    ``workdir``."""

    class FineTune(ns.Trainer):
        def create_model(self, rngs):
            return lora_model(folder)

        def create_optimizer(self):
            return optax.adam(3e-2)

        def load_pretrained(self, model):
            return ns.load_safetensors(model, folder)  # the key map comes from config.json

        def loss_fn(self, model, batch):
            logits = forward(model, batch["tokens"])
            labels = jax.nn.one_hot(batch["tokens"][:, 1:], logits.shape[-1])
            return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits[:, :-1]), -1)), {}

    mesh = ns.create_mesh((devices,), ("fsdp",), devices=jax.devices()[:devices])
    return FineTune(
        {
            "total_steps": steps,
            "log_every": 1,
            "progress": "off",
            "mesh": mesh,
            "ema_decay": None,
            "sharding_strategy": [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")],
            "workdir": workdir,
            "save_every": max(1, steps // 2),
            "resume": "auto",
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=DEFAULT)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    os.environ.setdefault(
        "XLA_FLAGS", "--xla_force_host_platform_device_count=8"
    )  # before JAX's backend starts
    workdir = args.workdir or tempfile.mkdtemp(prefix="finetune_hf_")

    n = jax.device_count()
    first = trainer_for(args.folder, n, workdir, args.steps // 2)
    first.train(batches)
    print(f"trained {args.steps // 2} steps on {n} devices; plan:\n{first.plan.summary()}")
    resumed = trainer_for(args.folder, max(1, n // 2), workdir, args.steps)
    history = resumed.train(batches)
    print(
        f"resumed from step {resumed.restored_step} on {max(1, n // 2)} devices; loss "
        f"{history[-1]['loss']:.4f}"
    )

    model = resumed.training_state["model"]
    merged, adapters = Path(workdir) / "merged", Path(workdir) / "peft"
    ns.save_safetensors(model, merged, like=args.folder)
    ns.weights.save_peft_adapters(model, adapters, like=args.folder)
    print(f"merged model: {merged} ({', '.join(sorted(p.name for p in merged.iterdir()))})")
    print(f"PEFT adapters: {adapters} ({', '.join(sorted(p.name for p in adapters.iterdir()))})")
    try:
        import peft
        import torch
        import transformers
    except ImportError:
        print("torch/transformers/peft not installed: `make test-interop` checks both folders against them")
        return
    want = np.asarray(forward(model, TOKENS))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
        base = transformers.AutoModelForCausalLM.from_pretrained(args.folder, torch_dtype=torch.float32)
        lora = peft.PeftModel.from_pretrained(base, adapters).eval()
        for name, m in (("transformers (merged)", hf), ("peft (adapters)", lora)):
            got = m(torch.tensor(TOKENS).long()).logits.numpy()
            print(f"{name}: max |logits - JAX| = {np.abs(got - want).max():.2e}")


if __name__ == "__main__":
    main()
