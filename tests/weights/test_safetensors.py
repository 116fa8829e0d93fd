"""Pretrained safetensors weights streamed into shards, written back bitwise, and LoRA trained through the
Trainer."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import save_file

import nnx_shard as ns

HEADS, HEAD_DIM, EMBED, LAYERS = 8, 4, 32, 2  # 8 heads: fsdp:8 splits them, never a head


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q = nnx.LinearGeneral(EMBED, (HEADS, HEAD_DIM), rngs=rngs)  # kernel (embed, heads, head_dim)
        self.up = nnx.Linear(EMBED, 64, rngs=rngs)


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(100, EMBED, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.stacked = nnx.Param(nnx.initializers.zeros(rngs.params(), (LAYERS, 64, EMBED)))


RULES = [
    (r"model\.embed_tokens\.weight", "embed/embedding"),
    (
        r"model\.layers\.(\d+)\.q_proj\.weight",
        r"layers/\1/q/kernel",
        "T",
    ),  # (heads*hd, embed) -> implied reshape
    (r"model\.layers\.(\d+)\.q_proj\.bias", r"layers/\1/q/bias"),
    (r"model\.layers\.(\d+)\.up_proj\.weight", r"layers/\1/up/kernel", "T"),
    (r"model\.layers\.(\d+)\.up_proj\.bias", r"layers/\1/up/bias"),
    (r"model\.layers\.(\d+)\.down_proj\.weight", r"stacked[\1]"),
]
STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def hf_files(folder, dtype=np.float32):
    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": rng.normal(size=(100, EMBED))}
    for i in range(LAYERS):
        t[f"model.layers.{i}.q_proj.weight"] = rng.normal(size=(HEADS * HEAD_DIM, EMBED))
        t[f"model.layers.{i}.q_proj.bias"] = rng.normal(size=(HEADS * HEAD_DIM,))
        t[f"model.layers.{i}.up_proj.weight"] = rng.normal(size=(64, EMBED))
        t[f"model.layers.{i}.up_proj.bias"] = rng.normal(size=(64,))
        t[f"model.layers.{i}.down_proj.weight"] = rng.normal(size=(64, EMBED))
    t = {k: v.astype(dtype) for k, v in t.items()}
    names = sorted(t)
    save_file({k: t[k] for k in names[: len(names) // 2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in names[len(names) // 2 :]}, str(folder / "model-00002-of-00002.safetensors"))
    import json

    weight_map = {k: f"model-0000{1 + (k in names[len(names) // 2 :])}-of-00002.safetensors" for k in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return t


def sharded_model(n=8):
    import jax

    mesh = ns.create_mesh((n,), ("fsdp",), devices=jax.devices()[:n])
    return ns.create_sharded(lambda: Tiny(nnx.Rngs(0)), STRATEGY, mesh)[0]


def test_a_hugging_face_folder_loads_into_shards_reading_each_byte_once(tmp_path):
    tensors = hf_files(tmp_path)
    model = sharded_model()
    shardings = {p: v.get_value().sharding for p, v in ns.sharding.flatten_state(nnx.state(model))}
    report = ns.load_safetensors(model, tmp_path, RULES)
    assert report.tensors == len(tensors) and report.bytes_read == report.bytes_needed
    assert report.bytes_needed == sum(t.nbytes for t in tensors.values())  # every byte once, none twice
    q = np.asarray(model.layers[1].q.kernel.get_value())
    np.testing.assert_array_equal(
        q, tensors["model.layers.1.q_proj.weight"].T.reshape(EMBED, HEADS, HEAD_DIM)
    )
    np.testing.assert_array_equal(
        np.asarray(model.stacked.get_value())[1], tensors["model.layers.1.down_proj.weight"]
    )
    assert {p: v.get_value().sharding for p, v in ns.sharding.flatten_state(nnx.state(model))} == shardings
    assert "loaded 11 tensors" in str(report) and report.gb_per_s > 0


def aligned_data(folder):
    """Each file saved again with metadata that puts its data, and so every tensor here, on 64 bytes: the
    alignment at which a CPU device would take a view of the file as its own buffer, not a copy."""
    from safetensors.numpy import load_file

    for f in folder.glob("*.safetensors"):
        tensors = load_file(str(f))
        for pad in range(64):
            save_file(tensors, str(f), metadata={"pad": "x" * pad})
            if (8 + int.from_bytes(f.read_bytes()[:8], "little")) % 64 == 0:
                break
        assert all(t.nbytes % 64 == 0 for t in tensors.values())


@pytest.mark.parametrize("devices", [1, 8])
def test_the_loaded_model_owns_its_bytes_when_the_files_change_or_go(tmp_path, devices):
    # shards are cut from views of the files' memory maps: each must be copied, transposed or not
    tensors = hf_files(tmp_path)
    aligned_data(tmp_path)
    model = sharded_model(devices)
    ns.load_safetensors(model, tmp_path, RULES)
    before = {p: np.asarray(v.get_value()).copy() for p, v in ns.sharding.flatten_state(nnx.state(model))}
    for f in tmp_path.glob("*.safetensors"):  # the same names and sizes, other values, in place
        data = bytearray(f.read_bytes())
        length = int.from_bytes(data[:8], "little")
        data[8 + length :] = bytes(len(data) - 8 - length)
        with open(f, "r+b") as h:
            h.write(data)
    reloaded = sharded_model(devices)
    ns.load_safetensors(reloaded, tmp_path, RULES)
    assert not np.asarray(reloaded.embed.embedding.get_value()).any()  # the files did change
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    after = {p: np.asarray(v.get_value()) for p, v in ns.sharding.flatten_state(nnx.state(model))}
    for p in before:
        np.testing.assert_array_equal(after[p], before[p], err_msg=p)
    np.testing.assert_array_equal(before["embed/embedding"], tensors["model.embed_tokens.weight"])


def test_a_float64_model_loads_in_float64_under_the_callers_enable_x64(tmp_path):
    # the leaves are made on worker threads: the caller's thread-local x64 setting must come along
    import jax

    w = np.random.default_rng(2).normal(size=(6, 4))  # float64, (out, in)
    save_file({"fc.weight": w}, str(tmp_path / "w.safetensors"))
    with jax.enable_x64(True):
        model = nnx.Linear(4, 6, use_bias=False, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        ns.load_safetensors(model, tmp_path, [(r"fc\.weight", "kernel", "T")])
        kernel = model.kernel.get_value()
        assert kernel.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(kernel), w.T)


@pytest.mark.parametrize("ahead", [0, 2**30])
def test_leaves_are_made_a_few_at_once_within_the_bytes_allowed_ahead(tmp_path, monkeypatch, ahead):
    import threading
    import time

    from nnx_shard._weights import _load

    tensors = hf_files(tmp_path)
    model = sharded_model()
    made, lock, live, most = _load._make_leaf, threading.Lock(), [0], [0]

    def counted(*args):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.01)  # long enough for the next leaf to start when it may
        try:
            return made(*args)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(_load, "_make_leaf", counted)
    monkeypatch.setattr(_load, "_AHEAD", ahead)
    monkeypatch.setattr(_load, "_THREADS", 2)
    report = ns.load_safetensors(model, tmp_path, RULES)
    assert most[0] == (1 if ahead == 0 else 2)  # no leaf fits in 0 bytes beside another; all in 1 GiB
    assert report.bytes_read == report.bytes_needed == sum(t.nbytes for t in tensors.values())
    np.testing.assert_array_equal(
        np.asarray(model.layers[0].up.kernel.get_value()), tensors["model.layers.0.up_proj.weight"].T
    )


def test_a_damaged_header_is_named_and_nothing_is_written(tmp_path):
    hf_files(tmp_path)
    model = sharded_model()
    before = np.asarray(model.embed.embedding.get_value()).copy()
    f = tmp_path / "model-00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4096  # past the end of the file
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    with pytest.raises(ns.WeightsMismatchError, match=r"safetensors|do not fit"):
        ns.load_safetensors(model, tmp_path, RULES)
    f.write_bytes(b"\xff" * 8 + data[8:])  # a header longer than the file
    with pytest.raises(ns.WeightsMismatchError, match="is not a readable safetensors file"):
        ns.load_safetensors(model, tmp_path, RULES)
    np.testing.assert_array_equal(np.asarray(model.embed.embedding.get_value()), before)


def test_tiled_copies_equal_numpy_for_every_layout_and_cast():
    from nnx_shard._weights._transforms import aligned_empty, copy_tiled

    rng = np.random.default_rng(3)
    w = rng.normal(size=(300, 70, 9)).astype(np.float32)
    for view in (w.transpose(2, 1, 0), w.transpose(1, 0, 2), w[::2, 3:, ::-1], w[:, :, 4], w, w[5]):
        for dtype in (np.float32, np.float64):
            out = aligned_empty(view.shape, dtype)
            copy_tiled(out, view)
            assert out.ctypes.data % 64 == 0 and out.flags.c_contiguous
            np.testing.assert_array_equal(out, view.astype(dtype))


def test_mismatches_are_all_listed_before_anything_is_written(tmp_path):
    hf_files(tmp_path)
    model = sharded_model()
    before = np.asarray(model.embed.embedding.get_value()).copy()
    with pytest.raises(ns.WeightsMismatchError) as e:
        ns.load_safetensors(
            model, tmp_path, RULES[:3] + [(r"model\.layers\.(\d+)\.up_proj\.weight", r"layers/\1/q/bias")]
        )
    text = str(e.value)
    assert "nothing was written" in text and "model.layers.0.up_proj.bias (64,)" in text  # no rule maps it
    assert "layers/0/up/bias (64,)" in text and "stacked (2, 64, 32)" in text  # nothing fills them
    assert "(64, 32) tensor holds 2048 elements, the (8, 4) leaf 32" in text
    assert "up_proj\\.weight'" in text  # the rule is named
    np.testing.assert_array_equal(np.asarray(model.embed.embedding.get_value()), before)
    with pytest.raises(ns.WeightsMismatchError, match="is not one of T"):
        ns.load_safetensors(model, tmp_path, [(".*", "x", "exec('1')")])
    report = ns.load_safetensors(
        model, tmp_path, RULES[:1], ignore=[r"model\.layers\..*"], skip=["layers/.*", "stacked"]
    )
    assert report.tensors == 1 and "10 file tensors ignored" in report.notes


def test_transform_chains_split_a_fused_tensor_and_cast(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(1)
    qkv = rng.normal(size=(3 * EMBED, EMBED)).astype(ml_dtypes.bfloat16)
    rope = rng.normal(size=(EMBED, EMBED)).astype(np.float32)
    experts = {
        f"moe.{i}.{j}": rng.normal(size=(16, 8)).astype(np.float32) for i in range(2) for j in range(4)
    }
    save_file({"qkv": qkv, "rope": rope, **experts}, str(tmp_path / "w.safetensors"))

    class M(nnx.Module):
        def __init__(self, rngs):
            self.q, self.k, self.v = (nnx.Linear(EMBED, EMBED, rngs=rngs) for _ in range(3))
            self.r = nnx.Linear(EMBED, EMBED, use_bias=False, rngs=rngs)
            self.moe = nnx.Param(nnx.initializers.zeros(rngs.params(), (2, 4, 8, 16)))  # layers, experts

    import jax

    mesh = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    model = ns.create_sharded(lambda: M(nnx.Rngs(0)), STRATEGY, mesh)[0]
    permute = "reshape(4, 4, 2, 32) | transpose(0, 2, 1, 3) | reshape(32, 32) | T"  # a RoPE permutation
    rules = [
        ("qkv", [(f"{n}/kernel", f"split(0, 3, {i}) | T") for i, n in enumerate("qkv")]),
        ("rope", "r/kernel", permute),
        (r"moe\.(\d+)\.(\d+)", r"moe[\1, \2]", "T"),  # a leaf stacked over layers and experts
    ]
    report = ns.load_safetensors(model, tmp_path / "w.safetensors", rules, skip=[".*bias"])
    for i, n in enumerate("qkv"):
        got = np.asarray(getattr(model, n).kernel.get_value())
        np.testing.assert_array_equal(got, qkv[i * EMBED : (i + 1) * EMBED].T.astype(np.float32))
    expected = rope.reshape(4, 4, 2, 32).transpose(0, 2, 1, 3).reshape(32, 32).T
    np.testing.assert_array_equal(np.asarray(model.r.kernel.get_value()), expected)
    np.testing.assert_array_equal(np.asarray(model.moe.get_value())[1, 2], experts["moe.1.2"].T)
    assert any("bfloat16 -> float32" in n for n in report.notes)
    ns.save_safetensors(
        model, tmp_path / "out", rules, like=tmp_path / "w.safetensors", skip=[".*bias"]
    )  # joined, unstacked, bf16
    from safetensors.numpy import load_file

    back = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))
    assert back["qkv"].dtype == qkv.dtype and np.array_equal(back["qkv"], qkv)
    assert np.array_equal(back["rope"], rope) and np.array_equal(back["moe.1.2"], experts["moe.1.2"])


def test_an_export_loads_back_bitwise_and_merges_lora(tmp_path):
    (tmp_path / "src").mkdir()
    tensors = hf_files(tmp_path / "src")
    model = sharded_model()
    ns.load_safetensors(model, tmp_path / "src", RULES)
    ns.save_safetensors(model, tmp_path / "out", RULES, like=tmp_path / "src")
    from safetensors.numpy import load_file

    written = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(str(f)))
    assert set(written) == set(tensors)
    for k, v in tensors.items():
        assert written[k].shape == v.shape and np.array_equal(written[k], v), k
    again = sharded_model(4)
    ns.load_safetensors(again, tmp_path / "out", RULES)
    for (p, a), (_, b) in zip(
        ns.sharding.flatten_state(nnx.state(again)), ns.sharding.flatten_state(nnx.state(model)), strict=True
    ):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), p
    lora = nnx.LoRALinear(4, 3, lora_rank=2, rngs=nnx.Rngs(0))
    lora.lora.lora_b.set_value(np.ones((2, 3), np.float32))
    rules = [(r"w", "kernel", "T"), (r"b", "bias")]
    ns.save_safetensors(lora, tmp_path / "merged", rules)
    merged = load_file(str(next((tmp_path / "merged").glob("*.safetensors"))))
    expected = np.asarray(lora.kernel.get_value()) + np.asarray(lora.lora.lora_a.get_value()) @ np.ones(
        (2, 3)
    )
    np.testing.assert_allclose(merged["w"], expected.T, rtol=1e-6)
    ns.save_safetensors(lora, tmp_path / "base", rules, merge_lora=False)  # the base weights, unmerged
    base = load_file(str(next((tmp_path / "base").glob("*.safetensors"))))
    assert sorted(base) == ["b", "w"]
    np.testing.assert_array_equal(base["w"], np.asarray(lora.kernel.get_value()).T)


class LoraTrainer(ns.Trainer):
    def create_model(self, rngs):
        return nnx.Sequential(
            nnx.LoRALinear(8, 32, lora_rank=4, rngs=rngs), nnx.LoRALinear(32, 1, lora_rank=4, rngs=rngs)
        )

    def create_optimizer(self):
        return optax.adam(1e-2)

    def loss_fn(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def load_pretrained(self, model):
        self.loaded = True
        return None


def test_the_trainer_trains_only_the_lora_adapters_by_default():
    trainer = LoraTrainer(
        {"total_steps": 4, "progress": "off", "log_every": 1, "sharding_strategy": STRATEGY}
    )
    trainer.init()
    assert trainer.loaded
    base = np.asarray(trainer.training_state["model"].layers[0].kernel.get_value()).copy()
    opt_paths = [p for p, _ in ns.sharding.flatten_state(trainer.states["optimizer"])]
    assert opt_paths and all("lora" in p for p in opt_paths if "mu" in p or "nu" in p)
    assert all("lora" in p for p, _ in ns.sharding.flatten_state(trainer.states["ema"]))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    history = trainer.train(lambda s: {"x": x, "y": x[:, :1]})
    assert history[-1]["loss"] < history[0]["loss"]
    np.testing.assert_array_equal(
        np.asarray(trainer.training_state["model"].layers[0].kernel.get_value()), base
    )


def test_checkpoints_without_the_frozen_base_restore_on_top_of_the_same_base_only(tmp_path):
    import jax

    cfg = {
        "total_steps": 4,
        "progress": "off",
        "sharding_strategy": STRATEGY,
        "workdir": str(tmp_path / "run"),
        "save_frozen": False,
    }
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    shapes = {
        "layers/0/kernel": (8, 32),
        "layers/0/bias": (32,),
        "layers/1/kernel": (32, 1),
        "layers/1/bias": (1,),
    }
    save_file(
        {k: rng.normal(size=v).astype(np.float32) for k, v in shapes.items()},
        str(tmp_path / "base.safetensors"),
    )

    class Pretrained(LoraTrainer):
        def load_pretrained(self, model):  # the same base weights, bitwise, whatever the mesh
            return ns.load_safetensors(model, tmp_path / "base.safetensors", [("(.*)", r"\1")])

    trainer = Pretrained(cfg)
    trainer.train(lambda s: {"x": x, "y": x[:, :1]})
    labels = trainer.plan.bytes_by_label()
    assert labels["trainable"] > 0 and labels["frozen"] > 0
    assert trainer.plan.leaf("model/layers/0/kernel").label == "frozen"
    assert "per device by label: frozen" in trainer.plan.summary()
    saved = trainer.checkpointer.metadata(4)
    assert sorted(saved["frozen_fingerprints"]) == [
        "layers/0/bias",
        "layers/0/kernel",
        "layers/1/bias",
        "layers/1/kernel",
    ]
    # on 4 devices, the same base: the adapters, optimizer and EMA come back, the base stays
    mesh4 = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    again = Pretrained({**cfg, "mesh": mesh4})
    again.restore_and_reshard()
    for (p, a), (_, b) in zip(
        ns.sharding.flatten_state(again.states["model"]),
        ns.sharding.flatten_state(trainer.states["model"]),
        strict=True,
    ):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), p
    assert len(again.states["model"]["layers"][0]["kernel"].get_value().sharding.device_set) == 4

    class OtherBase(Pretrained):
        def load_pretrained(self, model):  # other base weights
            report = super().load_pretrained(model)
            model.layers[0].kernel.set_value(model.layers[0].kernel.get_value() + 1)
            return report

    other = OtherBase(cfg)
    with pytest.raises(ns.CheckpointMismatchError, match=r"frozen parameters differ .*layers/0/kernel"):
        other.restore_and_reshard()


def test_qwix_lora_trains_its_adapters_only_and_merges_with_its_scale(tmp_path):
    qwix = pytest.importorskip("qwix")
    import jax
    import jax.numpy as jnp

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 32, rngs=rngs)
            self.b = nnx.Linear(32, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.tanh(self.a(x)))

    provider = qwix.LoraProvider(module_path=".*", rank=4, alpha=2.0)

    class QwixTrainer(LoraTrainer):
        def create_model(self, rngs):
            return qwix.apply_lora_to_model(MLP(rngs), provider, jnp.ones((2, 8)), rngs=rngs)

    trainer = QwixTrainer(
        {"total_steps": 6, "progress": "off", "log_every": 1, "sharding_strategy": STRATEGY}
    )
    trainer.init()
    base = np.asarray(trainer.states["model"]["a"]["kernel"].get_value()).copy()
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    history = trainer.train(lambda s: {"x": x, "y": x[:, :1]})
    assert history[-1]["loss"] < history[0]["loss"]
    model = trainer.training_state["model"]
    np.testing.assert_array_equal(np.asarray(model.a.kernel.get_value()), base)
    assert trainer.plan.leaf("model/a/kernel_lora_a").label == "trainable"
    rules = [(r"(a|b)\.weight", r"\1/kernel", "T"), (r"(a|b)\.bias", r"\1/bias")]
    ns.save_safetensors(model, tmp_path / "merged", rules, lora_scale=2.0 / 4)
    plain = MLP(nnx.Rngs(5))
    ns.load_safetensors(plain, tmp_path / "merged", rules)
    np.testing.assert_allclose(np.asarray(plain(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.multihost
def test_two_processes_load_their_own_bytes_and_export_the_same_files(tmp_path, multiprocess):
    from safetensors.numpy import load_file

    (tmp_path / "src").mkdir()
    tensors = hf_files(tmp_path / "src")
    results, _ = multiprocess(
        "tests.apps.mh_workers:load_and_export",
        2,
        args={"folder": str(tmp_path / "src"), "out": str(tmp_path / "out")},
    )
    for r in results:
        assert r.returncode == 0, r.message + r.log[-2000:]
        assert r.value["read"] == r.value["needed"] < sum(t.nbytes for t in tensors.values())  # its half only
    assert sum(r.value["read"] for r in results) == sum(t.nbytes for t in tensors.values())
    written = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(str(f)))
    assert set(written) == set(tensors) and all(np.array_equal(written[k], v) for k, v in tensors.items())
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_what_trains_is_said_at_the_start_and_a_fallen_back_fine_tune_warns(capsys, caplog):
    import logging

    trainer = LoraTrainer({"total_steps": 1, "progress": "lines", "sharding_strategy": STRATEGY})
    with caplog.at_level(logging.INFO, logger="nnx_shard"):
        trainer.init()
    out = capsys.readouterr().out  # adapters 4*(8+32) + 4*(32+1) = 292 of 292 + 8*32+32 + 32+1 = 613
    assert "training 47.6% of 613 parameters (292, nnx.LoRAParam: the LoRA adapters, by default)" in out, out
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "training" in r.getMessage()]
    assert "parameters by label: frozen 321 (52.4%), trainable 292 (47.6%)" in trainer.plan.summary()

    class Pretrained(LoraTrainer):  # a provider that matched nothing: no LoRA, weights loaded
        def create_model(self, rngs):
            return nnx.Sequential(nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 1, rngs=rngs))

        def load_pretrained(self, model):
            return "loaded"

    with caplog.at_level(logging.INFO, logger="nnx_shard"):
        Pretrained({"total_steps": 1, "progress": "off", "sharding_strategy": STRATEGY}).init()
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "training" in r.getMessage()
    ]
    assert warned == [
        "training 100% of 321 parameters (every nnx.Param: the model holds no LoRA parameters); a LoRA "
        "provider that matched no module makes this a full fine-tune"
    ]
    assert "training 100%" not in capsys.readouterr().out  # progress off: logged, not printed


def test_the_report_says_when_more_bytes_were_read_than_the_shards_hold_and_why(tmp_path):
    from safetensors.numpy import save_file

    class Flat(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(48))

    save_file({"w": np.arange(48, dtype=np.float32).reshape(4, 12)}, str(tmp_path / "model.safetensors"))
    from tests.helpers import mesh_of

    model, _ = ns.create_sharded(Flat, STRATEGY, mesh_of("8"))
    report = ns.load_safetensors(model, tmp_path, [("w", "w")])  # (4, 12) merged into 48: 6 per device
    np.testing.assert_array_equal(np.asarray(model.w.get_value()), np.arange(48))
    assert report.bytes_read > report.bytes_needed == 48 * 4
    assert any("bytes more than the shards hold, for 1 leaves (first w)" in n for n in report.notes), report
