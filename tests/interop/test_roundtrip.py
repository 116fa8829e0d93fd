"""The whole round trip against the real thing (make test-interop): a Hugging Face folder written by
transformers -> google-tunix's Llama3 on fsdp:8 -> a qwix LoRA fine-tune with the Trainer -> resumed on 4
devices -> merged export -> transformers' logits; and the PEFT export -> PeftModel's logits. Needs torch
(CPU), transformers and peft; skipped without them (make test)."""

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
@pytest.mark.parametrize(
    "source", [SOURCE, SOURCE.parent / "transformers-5.24.0" / "qwen25"], ids=["llama", "qwen25-v5"]
)
def test_hf_folder_to_tunix_qwix_finetune_resume_and_back_to_transformers_and_peft(source, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(source, folder)
    trainer = trainer_for(folder, 8, str(tmp_path / "work"), steps=3)
    first = trainer.train(batches)
    assert trainer.plan.leaf("model/layers/0/attn/q_proj/w_lora_b").label == "trainable"
    resumed = trainer_for(folder, 4, str(tmp_path / "work"), steps=6)  # fewer devices
    history = resumed.train(batches)
    assert resumed.restored_step == 3
    assert history[-1]["loss"] < first[0]["loss"]
    model = resumed.training_state["model"]
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
    ns.weights.save_peft_adapters(model, adapters, like=folder)
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


WRITTEN = [
    f"{w}/{n}"
    for w in ("transformers-4.51.3", "transformers-5.24.0")
    for n in ("llama32", "qwen3", "gemma3", "mistral")
]


@pytest.mark.slow
@pytest.mark.parametrize("name", WRITTEN)
def test_checkpoints_of_both_writers_export_to_the_installed_transformers_with_the_same_logits(
    name, tmp_path
):
    from safetensors.numpy import load_file

    folder = SOURCE.parent / name
    cls, config = ns.key_maps.tunix_model(folder)
    model, _ = ns.create_sharded(
        lambda: cls(config, rngs=nnx.Rngs(0)), STRATEGY, ns.create_mesh((8,), ("fsdp",))
    )
    ns.load_safetensors(model, folder)
    ref = load_file(str(folder / "reference.safetensors"))
    want = np.asarray(forward(model, ref["tokens"]))
    np.testing.assert_allclose(want, ref["logits"], atol=1e-4, rtol=0)  # the writer's torch
    ns.save_safetensors(model, tmp_path / "out", like=folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        got = hf(torch.tensor(ref["tokens"]).long()).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)  # the installed transformers


def _peft_model(folder, **config):
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, **config
    )
    return peft.get_peft_model(base, lora).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "config", [{"alpha_pattern": {"v_proj": 32}}, {"use_rslora": True}], ids=["alpha_pattern", "rslora"]
)
def test_peft_written_adapters_load_exactly(config, tmp_path):
    from examples.finetune_hf.finetune import lora_model

    with_adapters = _peft_model(SOURCE, **config)
    with_adapters.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        want = with_adapters(torch.tensor(TOKENS).long()).logits.numpy()
    with nnx.use_eager_sharding(False):  # on the host, unsharded (tunix's annotations name 'tp')
        model = lora_model(SOURCE)
    ns.load_safetensors(model, SOURCE)
    ns.load_safetensors(model, tmp_path / "peft")
    np.testing.assert_allclose(np.asarray(forward(model, TOKENS)), want, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, field",
    [({"use_dora": True}, "use_dora"), ({"rank_pattern": {"v_proj": 8}}, None)],
    ids=["dora", "rank"],
)
def test_peft_adapters_that_cannot_load_exactly_are_refused_with_nothing_written(config, field, tmp_path):
    from examples.finetune_hf.finetune import lora_model

    _peft_model(SOURCE, **config).save_pretrained(tmp_path / "peft")
    with nnx.use_eager_sharding(False):  # on the host, unsharded (tunix's annotations name 'tp')
        model = lora_model(SOURCE)
    before = {
        p: np.asarray(v.get_value()).copy() for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    }
    with pytest.raises(ns.WeightsMismatchError) as e:
        ns.load_safetensors(model, tmp_path / "peft")
    if field:
        assert isinstance(e.value, ns.UnsupportedConfigError) and e.value.field == field
    after = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    assert all(np.array_equal(after[p], before[p]) for p in before)
