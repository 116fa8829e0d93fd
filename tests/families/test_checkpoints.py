"""Checkpoints as people download them, written by the oldest supported transformers and the newest: each
loads into the model its config.json describes with torch's logits, or is refused by name before a weight is
read."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nnx_shard as ns
from examples.finetune_hf.finetune import forward

# skipped without google-tunix, which the tests import themselves: importing it turns Flax's eager sharding
# off, and at collection it would do so for every test of the worker
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tunix") is None, reason="google-tunix is not installed"
)

DATA = Path(__file__).parents[1] / "data" / "hf"
WRITERS = ["transformers-4.51.3", "transformers-5.24.0"]
NAMES = [
    "llama31",
    "llama32",
    "mistral",
    "qwen25",
    "qwen25_bf16",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_bf16",
]
STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


# one compiled program per model (op by op, a sharded forward runs hundreds of small collective programs)
jitted_forward = nnx.jit(forward)


def load(folder, mesh):
    cls, config = ns.key_maps.tunix_model(folder)
    model, _ = ns.create_sharded(lambda: cls(config, rngs=nnx.Rngs(0)), STRATEGY, mesh)
    return model, ns.load_safetensors(model, folder)


def plain(cls, config):
    """An unsharded model on the host (tunix's sharding annotations left unapplied)."""
    with nnx.use_eager_sharding(False):
        return cls(config, rngs=nnx.Rngs(0))


def reference(folder):
    from safetensors.numpy import load_file

    return load_file(str(folder / "reference.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("writer", WRITERS)
def test_every_checkpoint_of_both_writers_gives_torchs_logits(writer):
    mesh = ns.create_mesh((8,), ("fsdp",))
    worst = {}
    for name in NAMES:
        folder = DATA / writer / name
        assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 1
        model, report = load(folder, mesh)
        assert report.bytes_read == report.bytes_needed
        ref = reference(folder)
        got = np.asarray(jitted_forward(model, jnp.asarray(ref["tokens"])))
        worst[name] = float(np.abs(got - ref["logits"]).max())
        assert worst[name] < (2e-3 if name.endswith("bf16") else 1e-4), (name, worst[name])
    assert max(worst.values()) < 1e-4, worst  # measured: at most 3.1e-5 (Gemma 3), bf16 copies included


@pytest.mark.parametrize("writer", WRITERS)
def test_the_config_fields_that_change_logits_are_carried(writer):
    cls, config = ns.key_maps.tunix_model(DATA / writer / "llama31")
    assert cls.__module__ == "nnx_shard._families._models" and config.rope_theta == 500_000
    _, config = ns.key_maps.tunix_model(DATA / writer / "llama32")
    assert (
        config.rope_kind == "llama3" and dict(config.rope_parameters)["factor"] == 8.0 and config.weight_tying
    )
    _, config = ns.key_maps.tunix_model(DATA / writer / "qwen3")
    assert config.rope_theta == 5_000_000  # tunix's own Qwen3 would run it at 1e6
    _, config = ns.key_maps.tunix_model(DATA / writer / "qwen25")
    assert config.rope_theta == 1_000_000 and config.use_tied_embedding
    _, config = ns.key_maps.tunix_model(DATA / writer / "gemma3")
    assert (config.local_base_frequency, config.global_base_frequency) == (10_000, 1_000_000)
    assert (config.local_scale_factor, config.global_scale_factor) == (1.0, 8.0)
    _, config = ns.key_maps.tunix_model(DATA / writer / "gemma2")
    assert (config.attn_logits_soft_cap, config.final_logit_softcap, config.sliding_window_size) == (
        50.0,
        30.0,
        8,
    )


def edited(tmp_path, source, change):
    folder = tmp_path / source.replace("/", "_")
    shutil.copytree(DATA / source, folder)
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


V4, V5 = WRITERS
REFUSALS = {
    "yarn (5.x)": (
        f"{V5}/llama31",
        lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0),
        "rope_parameters.rope_type",
    ),
    "dynamic (4.x)": (
        f"{V4}/llama31",
        lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "rope_scaling.rope_type",
    ),
    "llama3 without its factors": (
        f"{V4}/llama32",
        lambda c: c["rope_scaling"].pop("low_freq_factor"),
        "rope_scaling",
    ),
    "gelu llama": (f"{V5}/llama31", lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    "llama attention bias": (f"{V5}/llama31", lambda c: c.update(attention_bias=True), "attention_bias"),
    "mistral window": (f"{V5}/mistral", lambda c: c.update(sliding_window=4096), "sliding_window"),
    "qwen2 window": (f"{V4}/qwen25", lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
    "qwen2 yarn": (
        f"{V4}/qwen25",
        lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4.0}),
        "rope_scaling.rope_type",
    ),
    "qwen2 linear": (
        f"{V5}/qwen25",
        lambda c: c["rope_parameters"].update(rope_type="linear", factor=2.0),
        "rope_parameters.rope_type",
    ),
    "gemma theta": (f"{V5}/gemma", lambda c: c["rope_parameters"].update(rope_theta=1e6), "rope_theta"),
    "gemma eps": (f"{V4}/gemma", lambda c: c.update(rms_norm_eps=1e-5), "rms_norm_eps"),
    "gemma2 query scalar": (
        f"{V5}/gemma2",
        lambda c: c.update(query_pre_attn_scalar=144),
        "query_pre_attn_scalar",
    ),
    "gemma3 softcap": (
        f"{V5}/gemma3",
        lambda c: c.update(final_logit_softcapping=30.0),
        "final_logit_softcapping",
    ),
    "gemma3 layer types": (
        f"{V5}/gemma3",
        lambda c: c.update(layer_types=["full_attention"] * 6),
        "layer_types",
    ),
    "gemma3 pattern (4.x)": (f"{V4}/gemma3", lambda c: c.update(sliding_window_pattern=2), "layer_types"),
    "gemma3 query scalar": (
        f"{V4}/gemma3",
        lambda c: c.update(query_pre_attn_scalar=7),
        "query_pre_attn_scalar",
    ),
    "gemma3 global yarn": (
        f"{V5}/gemma3",
        lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
        "rope_parameters.rope_type",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_field_the_model_cannot_compute_is_refused_by_name_before_anything_is_read(case, tmp_path):
    source, change, field = REFUSALS[case]
    folder = edited(tmp_path, source, change)
    with pytest.raises(ns.UnsupportedConfigError) as e:
        ns.key_maps.tunix_model(folder)
    assert (
        e.value.field == field and field.split(".")[-1] in str(e.value) and "Nothing was read" in str(e.value)
    )
    assert isinstance(e.value, ns.WeightsMismatchError)


def test_a_model_built_unlike_its_checkpoint_is_refused_before_a_weight_is_read(tmp_path):
    from tunix.models.llama3 import model as llama
    from tunix.models.qwen3 import model as qwen

    mesh = ns.create_mesh((8,), ("fsdp",))
    for module, cls, name in ((llama, llama.Llama3, "llama31"), (qwen, qwen.Qwen3, "qwen3")):
        folder = DATA / V5 / name
        _, ours = ns.key_maps.tunix_model(folder)
        fields = {f.name: getattr(ours, f.name) for f in dataclasses.fields(module.ModelConfig)}
        tunix_config = module.ModelConfig(**fields)
        model, _ = ns.create_sharded(lambda c=cls, t=tunix_config: c(t, rngs=nnx.Rngs(0)), STRATEGY, mesh)
        before = np.asarray(model.embedder.input_embedding.get_value()).copy()
        with pytest.raises(ns.WeightsMismatchError, match=r"rope_theta: the model's 1000000, config\.json's"):
            ns.load_safetensors(model, folder)  # tunix's own class: theta 1e6 whatever its config says
        np.testing.assert_array_equal(np.asarray(model.embedder.input_embedding.get_value()), before)
    # a preset built by hand with another norm epsilon
    _, ours = ns.key_maps.tunix_model(DATA / V4 / "qwen25")
    cls, _ = ns.key_maps.tunix_model(DATA / V4 / "qwen25")
    model = plain(cls, dataclasses.replace(ours, norm_eps=1e-5))
    with pytest.raises(ns.WeightsMismatchError, match=r"norm_eps: the model's 1e-05, config\.json's 1e-06"):
        ns.load_safetensors(model, DATA / V4 / "qwen25")


def test_mistral_is_llamas_layout_and_the_missing_or_unknown_are_named(tmp_path):
    cls, config = ns.key_maps.tunix_model(DATA / V5 / "mistral")
    assert cls.__name__ == "Llama3" and config.rope_theta == 1_000_000
    with pytest.raises(ns.WeightsMismatchError, match="nowhere does not exist"):
        ns.key_maps.tunix_model(tmp_path / "nowhere")
    folder = edited(
        tmp_path, f"{V5}/gemma3", lambda c: c.update(architectures=["Gemma3ForConditionalGeneration"])
    )
    with pytest.raises(ns.WeightsMismatchError, match="text tower"):
        ns.key_maps.tunix_model(folder)


def test_an_index_naming_files_outside_its_folder_is_refused_before_anything_is_opened(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(DATA / V5 / "qwen3", folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for bad in ("/etc/passwd", "../outside.safetensors", "sub/model.safetensors"):
        first = next(iter(index["weight_map"]))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({**index, "weight_map": {**index["weight_map"], first: bad}})
        )
        with pytest.raises(ns.WeightsMismatchError, match="names files outside its folder"):
            ns.load_safetensors(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), folder, [(".*", "kernel")])


def test_a_missing_transpose_is_refused_naming_the_rule_not_reshaped(tmp_path):
    from safetensors.numpy import save_file

    save_file({"up.weight": np.ones((128, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    model = nnx.Linear(128, 64, use_bias=False, rngs=nnx.Rngs(0))  # kernel (128, 64): the file is (out, in)
    save_file({"up.weight": np.ones((64, 128), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ns.WeightsMismatchError) as e:
        ns.load_safetensors(model, tmp_path, [(r"up\.weight", "kernel")])
    text = str(e.value)
    assert "rule r'up\\.weight'" in text and 'add "T" to the rule' in text and "scramble" in text
    assert "is (64, 128)" not in text
    ns.load_safetensors(model, tmp_path, [(r"up\.weight", "kernel", "T")])  # with the transpose: loads


def test_ignore_and_skip_patterns_that_match_nothing_are_named_with_how_they_match(tmp_path):
    folder = DATA / V5 / "llama31"
    cls, config = ns.key_maps.tunix_model(folder)
    model = plain(cls, config)
    rules = [r for r in ns.key_maps.LLAMA3 if not r[0].startswith("lm_head")]
    with pytest.raises(ns.WeightsMismatchError) as e:
        ns.load_safetensors(model, folder, rules, ignore=[r"^lm_head\."], skip=["lm_head/w"])
    text = str(e.value)
    assert "ignore='^lm_head\\\\.'" in text and "re.fullmatch" in text and "lm_head.weight (128, 32)" in text
    report = ns.load_safetensors(
        model, folder, rules, ignore=[r"lm_head\..*"], skip=["lm_head/w", "nothing/.*"]
    )
    assert "1 file tensors ignored" in report.notes
    assert any("skip='nothing/.*' matched nothing" in n for n in report.notes)


def test_a_wrong_hidden_size_is_one_short_error(tmp_path):
    folder = DATA / V5 / "qwen3"
    cls, config = ns.key_maps.tunix_model(folder)
    model = plain(cls, dataclasses.replace(config, embed_dim=64))
    with pytest.raises(ns.WeightsMismatchError, match=r"embed_dim: the model's 64, config\.json's 32"):
        ns.load_safetensors(model, folder)  # the folder: its config.json says what differs, in one line
    files = sorted(str(f) for f in folder.glob("model-*.safetensors"))
    with pytest.raises(ns.WeightsMismatchError) as e:
        ns.load_safetensors(model, files, ns.key_maps.QWEN3)  # bare files: every tensor, condensed
    lines = str(e.value).splitlines()
    assert len(lines) < 25 and any("... and" in line for line in lines), str(e.value)
    assert not any("tensor is (" in line for line in lines)


def test_the_rope_model_holds_tunixs_parameters_and_paths():
    """nnx_shard's Llama3 keeps tunix's parameters and paths: the same state as tunix's own class."""
    from tunix.models.llama3 import model as llama

    cls, config = ns.key_maps.tunix_model(DATA / V5 / "llama31")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(llama.ModelConfig)}
    ours = nnx.state(plain(cls, config))
    theirs = nnx.state(plain(llama.Llama3, llama.ModelConfig(**fields)))
    a, b = ns.sharding.flatten_state(ours), ns.sharding.flatten_state(theirs)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (_, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
