"""PEFT folders in, exactly or not at all: patterns matched as PEFT matches them, rsLoRA's scale, refused
fields named, and nothing written after a refusal (the round trip with peft itself is in tests/interop)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._weights._peft import pattern_key, peft_scale

# tunix imported by the tests that need it, not at collection (importing it turns Flax's eager sharding off)
needs_tunix = pytest.mark.skipif(
    importlib.util.find_spec("tunix") is None, reason="google-tunix is not installed"
)
FOLDER = Path(__file__).parents[1] / "data" / "hf" / "llama"


def lora_model(folder, seed=0):
    from examples.finetune_hf.finetune import lora_model as make

    with nnx.use_eager_sharding(False):  # on the host, unsharded (tunix's annotations name 'tp')
        return make(folder, seed)


def adapters(model):
    return {
        p: np.asarray(v.get_value()).copy() for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    }


def peft_folder(tmp_path, model, **config):
    out = tmp_path / "peft"
    ns.weights.save_peft_adapters(model, out, like=FOLDER)
    path = out / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


def test_patterns_match_the_end_of_a_module_name_as_peft_does():
    assert pattern_key(["v_proj"], "model.layers.1.self_attn.v_proj") == "v_proj"
    assert pattern_key(["proj"], "model.layers.1.self_attn.v_proj") is None  # at a dot, not inside a name
    assert pattern_key([r"layers\.1\.self_attn\.v_proj"], "model.layers.1.self_attn.v_proj") is not None
    config = {"r": 4, "lora_alpha": 8, "alpha_pattern": {"v_proj": 32}, "rank_pattern": {"down_proj": 2}}
    assert peft_scale(config, "model.layers.0.self_attn.v_proj") == (4, 8.0)
    assert peft_scale(config, "model.layers.0.self_attn.q_proj") == (4, 2.0)
    assert peft_scale(config, "model.layers.0.mlp.down_proj") == (2, 4.0)
    assert peft_scale({**config, "use_rslora": True}, "model.layers.0.self_attn.v_proj") == (4, 16.0)


@needs_tunix
@pytest.mark.slow
def test_alpha_pattern_and_rslora_scale_the_adapters_they_name(tmp_path):
    model = lora_model(FOLDER)
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        v.set_value(np.random.default_rng(0).normal(0, 0.3, v.get_value().shape).astype(np.float32))
    saved = adapters(model)  # qwix's scale: alpha 8 / rank 4 = 2 everywhere
    for config, v_scale, q_scale in (
        ({"alpha_pattern": {"v_proj": 32}}, 8.0, 2.0),
        ({"use_rslora": True}, 4.0, 4.0),
    ):
        fresh = lora_model(FOLDER, seed=3)
        report = ns.load_safetensors(fresh, peft_folder(tmp_path / str(v_scale), model, **config))
        got = adapters(fresh)
        for path, value in saved.items():
            name = "/".join(map(str, path))
            factor = (v_scale if "v_proj" in name else q_scale) / 2.0
            want = value * factor if name.endswith("lora_b") else value
            np.testing.assert_allclose(got[path], want, rtol=1e-6, err_msg=name)
        assert any("B scaled" in n for n in report.notes)


@needs_tunix
@pytest.mark.slow
def test_a_refused_adapter_folder_changes_no_leaf(tmp_path):
    model = lora_model(FOLDER)
    folder = peft_folder(tmp_path, model)
    target = lora_model(FOLDER, seed=5)
    before = adapters(target)
    for field, value in (
        ("use_dora", True),
        ("peft_type", "LOHA"),
        ("fan_in_fan_out", True),
        ("bias", "all"),
    ):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ns.UnsupportedConfigError, match=f"{field}={value!r}") as e:
            ns.load_safetensors(target, folder)
        assert e.value.field == field
        (folder / "adapter_config.json").write_text(json.dumps(config))
    # a rank_pattern giving the last modules another rank: refused on them, after nothing was written
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    for k in [k for k in tensors if "layers.1.self_attn.v_proj" in k]:
        tensors[k] = np.concatenate([tensors[k]] * 2, axis=0 if "lora_A" in k else 1)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(
        json.dumps({**config, "rank_pattern": {"layers.1.self_attn.v_proj": 8}})
    )
    with pytest.raises(ns.WeightsMismatchError, match="adapter rank 4"):
        ns.load_safetensors(target, folder)
    after = adapters(target)
    assert all(np.array_equal(after[p], before[p]) for p in before), "a leaf was written before the refusal"
