"""The whole round trip against the real thing (make test-interop): a Hugging Face folder written by transformers
-> google-tunix's Llama3 on fsdp:8 -> a qwix LoRA fine-tune with the Trainer -> resumed on 4 devices -> merged
export -> transformers' logits; and the PEFT export -> PeftModel's logits. Needs torch (CPU), transformers and
peft; skipped without them (make test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
qwix = pytest.importorskip("qwix")
pytest.importorskip("tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import nnx_shard as ns  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "data" / "hf" / "llama"
STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def forward(model, tokens):
    b, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    return model(jnp.asarray(tokens), positions, None, mask)[0]


def make_trainer(folder, devices, workdir, steps):
    cls, config = ns.key_maps.tunix_model(folder)
    tokens = np.array([[1, 5, 9, 17, 33, 65, 127, 3], [2, 4, 8, 16, 32, 64, 100, 7]], np.int32)
    b, n = tokens.shape
    provider = qwix.LoraProvider(module_path=".*(q_proj|v_proj|down_proj)", rank=4, alpha=8.0)

    class FineTune(ns.Trainer):
        def create_model(self, rngs):
            model = cls(config, rngs=nnx.Rngs(0))
            args = (
                jnp.asarray(tokens),
                jnp.broadcast_to(jnp.arange(n), (b, n)),
                None,
                jnp.ones((b, n, n), bool),
            )
            return qwix.apply_lora_to_model(model, provider, *args, rngs=nnx.Rngs(1))

        def create_optimizer(self):
            return optax.adam(3e-2)

        def load_pretrained(self, model):
            return ns.load_safetensors(model, folder)  # the key map comes from config.json

        def loss_fn(self, model, batch):
            logits = forward(model, batch["tokens"])
            labels = jax.nn.one_hot(batch["tokens"][:, 1:], logits.shape[-1])
            return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits[:, :-1]), -1)), {}

    mesh = ns.create_mesh((devices,), ("fsdp",), devices=jax.devices()[:devices])
    trainer = FineTune(
        {
            "total_steps": steps, "log_every": 1, "progress": "off", "mesh": mesh, "sharding_strategy": STRATEGY,
            "ema_decay": None, "workdir": str(workdir), "save_every": 3, "resume": "auto",
        }
    )  # fmt: skip
    batches = lambda step: {"tokens": np.tile(tokens, (4, 1))}
    return trainer, batches, tokens


@pytest.mark.slow
def test_hf_folder_to_tunix_qwix_finetune_resume_and_back_to_transformers_and_peft(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(SOURCE, folder)
    trainer, batches, tokens = make_trainer(folder, 8, tmp_path / "work", steps=3)
    first = trainer.train(batches)
    assert trainer.plan.leaf("model/layers/0/attn/q_proj/w_lora_b").label == "trainable"
    resumed, batches, tokens = make_trainer(folder, 4, tmp_path / "work", steps=6)  # fewer devices
    history = resumed.train(batches)
    assert resumed.restored_step == 3
    assert history[-1]["loss"] < first[0]["loss"]
    model = resumed.objects()["model"]
    assert len(model.layers[0].attn.q_proj.w.get_value().sharding.device_set) == 4
    want = np.asarray(forward(model, tokens))

    merged = tmp_path / "merged"
    ns.save_safetensors(model, merged, like=folder, max_shard_size="40KB")  # qwix's alpha/rank found
    assert json.loads((merged / "model.safetensors.index.json").read_text())["metadata"]["total_size"] > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.tensor(tokens).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    adapters = tmp_path / "peft"
    ns.save_peft_adapters(model, adapters, like=folder)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(base, adapters).eval()
    with torch.no_grad():
        got = with_adapters(torch.tensor(tokens).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
