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


from flax import nnx  # noqa: E402

import nnx_shard as ns  # noqa: E402
from examples.finetune_hf.finetune import TOKENS, batches, forward, trainer_for  # noqa: E402

STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
SOURCE = Path(__file__).resolve().parents[1] / "data" / "hf" / "llama"


@pytest.mark.slow
def test_hf_folder_to_tunix_qwix_finetune_resume_and_back_to_transformers_and_peft(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(SOURCE, folder)
    trainer = trainer_for(folder, 8, str(tmp_path / "work"), steps=3)
    first = trainer.train(batches)
    assert trainer.plan.leaf("model/layers/0/attn/q_proj/w_lora_b").label == "trainable"
    resumed = trainer_for(folder, 4, str(tmp_path / "work"), steps=6)  # fewer devices
    history = resumed.train(batches)
    assert resumed.restored_step == 3
    assert history[-1]["loss"] < first[0]["loss"]
    model = resumed.objects()["model"]
    assert len(model.layers[0].attn.q_proj.w.get_value().sharding.device_set) == 4
    want = np.asarray(forward(model, TOKENS))

    merged = tmp_path / "merged"
    ns.save_safetensors(model, merged, like=folder, max_shard_size="40KB")  # qwix's alpha/rank found
    assert json.loads((merged / "model.safetensors.index.json").read_text())["metadata"]["total_size"] > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.tensor(TOKENS).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    adapters = tmp_path / "peft"
    ns.save_peft_adapters(model, adapters, like=folder)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(base, adapters).eval()
    with torch.no_grad():
        got = with_adapters(torch.tensor(TOKENS).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma", "gemma2", "gemma3"])
def test_every_family_exports_a_folder_transformers_opens_with_the_same_logits(family, tmp_path):
    from safetensors.numpy import load_file

    folder = SOURCE.parent / family
    cls, config = ns.key_maps.tunix_model(folder)
    mesh = ns.create_mesh((8,), ("fsdp",))
    model, _ = ns.create_sharded(lambda: cls(config, rngs=nnx.Rngs(0)), STRATEGY, mesh)
    ns.load_safetensors(model, folder)
    tokens = load_file(str(folder / "reference.safetensors"))["tokens"]
    want = np.asarray(forward(model, tokens))
    ns.save_safetensors(model, tmp_path / "out", like=folder)
    # eager attention: the one that applies Gemma 2's attention softcap (as the reference was computed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        got = hf(torch.tensor(tokens).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
