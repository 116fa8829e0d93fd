"""ns.suggest and Trainer.suggest: rules written for a memory budget, checked by the compiler; the plan
drawn."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def linear_state(width: int = 1024):
    def build():
        model = nnx.Linear(width, width, rngs=nnx.Rngs(0))
        return {
            "model": model,
            "optimizer": nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
            "ema": nnx.EMA(model, decay=0.99),
        }

    return nnx.eval_shape(build)


def mesh8():
    return ns.create_mesh((8,), ("fsdp",))


@pytest.mark.parametrize(
    "budget, layout, first_rule",
    [
        (
            "64MiB",
            "everything replicated",
            (".*", "replicate()"),
        ),  # 16 MiB fits whole: nothing sent but gradients
        ("13MiB", "EMA sharded", ("^ema/", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")),
        (8 * MIB, "fsdp above 2 MiB", (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=2)")),
    ],
)
def test_the_suggestion_fits_the_budget_and_is_exactly_what_infer_sharding_gives(budget, layout, first_rule):
    state, mesh = linear_state(), mesh8()
    s = ns.suggest(state, mesh, budget=budget)
    assert s.layout == layout and s.rules[0] == first_rule
    assert s.state_bytes == s.plan.bytes_per_device <= s.budget
    assert s.budget == (budget if isinstance(budget, int) else int(budget[:-3]) * MIB)
    shardings = ns.infer_sharding(state, s.rules, mesh)
    assert jax.tree.leaves(shardings) == jax.tree.leaves(s.plan.shardings)  # leaf for leaf
    assert len(s.rules) <= 12 and len(s.why) == len(s.rules)


def test_the_printout_is_python_to_paste_with_a_reason_per_rule():
    s = ns.suggest(linear_state(), mesh8(), budget="13MiB")
    text = str(s)
    code = text[text.index("rules = [") :].split("\n]")[0] + "\n]"
    pasted = ast.literal_eval(code.split("=", 1)[1].strip())  # comments are dropped by the parser
    assert pasted == s.rules
    assert "no communication per step; saves 3.5 MiB per device" in text
    assert "# considered: ZeRO-1: 5.5 MiB per device" in text and "(over the budget)" in text
    assert "sent per device per step (modelled): gradient all-reduce 7.0 MiB" in text


def test_traffic_is_counted_by_kind():
    state, mesh = linear_state(), mesh8()
    from nnx_shard._suggest import layouts

    by_name = {c.name: c for c in layouts(state, mesh)}
    kernel, bias = 1024 * 1024 * 4, 1024 * 4
    ring = 7 / 8
    assert by_name["everything replicated"].traffic["gradient all-reduce"] == int(2 * ring * kernel) + int(
        2 * ring * bias
    )
    zero1 = by_name["ZeRO-1"].traffic
    assert zero1["parameter all-gathers"] == int(ring * kernel) + int(ring * bias)  # the updated parameters
    fsdp = by_name["full fsdp"].traffic
    assert (
        fsdp["gradient all-reduce"] == 0 and fsdp["parameter all-gathers"] == fsdp["gradient reduce-scatters"]
    )


def test_a_budget_no_layout_meets_names_the_smallest_reached_and_the_largest_leaves():
    with pytest.raises(
        ns.NoLayoutFitsError,
        match=r"no layout fits 1.0 KiB per device: the smallest any reaches is "
        r"2.0 MiB \(full fsdp\); the largest leaves per device are model/kernel 512.0 KiB",
    ):
        ns.suggest(linear_state(), mesh8(), budget="1KiB")
    assert issubclass(ns.NoLayoutFitsError, ValueError)
    for bad in ("16 parsecs", -3, "GiB"):
        with pytest.raises(
            ns.ConfigError, match="a memory budget is a number of bytes or a size such as '16GiB'"
        ):
            ns.suggest(linear_state(), mesh8(), budget=bad)


def test_tensor_axes_are_considered_given_the_tokens_per_step():
    mesh = ns.create_mesh((4, 2), ("fsdp", "tp"))
    from nnx_shard._suggest import layouts

    names = [c.name for c in layouts(linear_state(), mesh, tokens_per_step=4096)]
    assert "fsdp with tensor axes" in names and "fsdp over every axis" in names
    tensor = next(
        c for c in layouts(linear_state(), mesh, tokens_per_step=4096) if c.name == "fsdp with tensor axes"
    )
    assert tensor.traffic["activations"] > 0 and "tp" in tensor.rules[0][1]
    assert "fsdp with tensor axes" not in [c.name for c in layouts(linear_state(), mesh)]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_without_a_budget_a_tpu_mesh_takes_the_chips_memory_less_the_activation_reserve():
    from nnx_shard._suggest import ACTIVATION_RESERVE

    mesh = ns.create_mesh((4,), ("fsdp",), devices=ns.cluster.tpu_devices("v5e:2x2"))
    s = ns.suggest(linear_state(), mesh)
    assert s.budget == int(16 * 2**30 * (1 - ACTIVATION_RESERVE)) and s.layout == "everything replicated"
    assert ns.suggest(linear_state(), mesh8()).budget is None  # a CPU says nothing of its memory: no limit


class FourLayers(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(512, 512, rngs=rngs) for _ in range(4)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


class FourLayerTrainer(ns.Trainer):
    def create_model(self, rngs):
        return FourLayers(rngs)

    def create_optimizer(self):
        return optax.adamw(1e-3)

    def loss_fn(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_trainer_suggest_keeps_the_layout_whose_compiled_step_sends_least():
    """The model ranks ZeRO-1 above full fsdp never, replicated level with it; the compiler decides: at batch
    64 replicated sends 4.0 MiB, ZeRO-1 8.0 MiB and full fsdp 1.8 MiB per device."""
    trainer = FourLayerTrainer({"mesh": "fsdp:-1", "progress": "off", "ema_decay": 0.99})
    batch = {k: jax.ShapeDtypeStruct((64, 512), np.float32) for k in ("x", "y")}
    s = trainer.suggest(batch, budget="64MiB")
    sent = {a.split(":")[0]: a for a in s.attempts}
    assert "sends 4.0 MiB" in sent["everything replicated"] and "sends 8.0 MiB" in sent["ZeRO-1"]
    assert "sends 1.8 MiB" in sent["full fsdp"]
    assert (
        s.compiled and s.layout.startswith(("full fsdp", "fsdp above")) and sum(s.traffic.values()) < 2 * MIB
    )
    assert s.plan.bytes_per_device == ns.plan_sharding(trainer.states, s.rules, trainer.mesh).bytes_per_device
    assert "# compiled: ZeRO-1: sends 8.0 MiB per step" in str(s)
    uncompiled = trainer.suggest(budget="64MiB")  # no batch: the model's ranking, said so
    assert not uncompiled.compiled and uncompiled.attempts == ["not compiled: no batch given"]


def test_the_plan_is_drawn_as_a_png_of_the_expected_size(tmp_path):
    from matplotlib.image import imread

    s = ns.suggest(linear_state(), mesh8(), budget="13MiB")
    image = imread(s.plot(str(tmp_path / "plan.png")))
    assert image.shape[:2] == (500, 1200) and image.std() > 0.05  # drawn, not blank
    path = s.plan.plot(str(tmp_path / "again.png"), budget=None, top=2)
    assert imread(path).shape[:2] == (500, 1200)


def test_nnx_shard_suggest_and_plan_png_from_the_command_line(tmp_path):
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "nnx_shard", *a], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    common = [
        "examples.toy_models:llama",
        "--model-kwargs",
        '{"size": "tiny"}',
        "--mesh",
        "fsdp:8",
        "--devices",
        "8",
    ]
    out = run("suggest", *common, "--budget", "1MiB", "--png", str(tmp_path / "s.png"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rules = [" in out.stdout and "per device (budget 1.0 MiB)" in out.stdout
    assert "mesh (fsdp=8), 8 devices" in out.stdout and (tmp_path / "s.png").stat().st_size > 10_000
    out = run("plan", *common, "--strategy", '[[".*", "replicate"]]', "--png", str(tmp_path / "p.png"))
    assert out.returncode == 0 and (tmp_path / "p.png").stat().st_size > 10_000, out.stderr[-2000:]
    out = run("suggest", *common, "--budget", "1KiB")
    assert out.returncode == 2 and "NoLayoutFitsError: no layout fits 1.0 KiB per device" in out.stderr


@pytest.mark.parametrize("which", ["vit", "llama-70b-shapes", "tunix-llama3", "tunix-qwen3"])
def test_the_bundled_models_get_a_few_readable_rules(which):
    """ViT, the Llama-shaped toy (70B's shapes), google-tunix's Llama 3 and Qwen 3: at most 12 rules, each a
    path pattern a person would write (no list of layer numbers)."""
    from examples.toy_models import llama

    data = ROOT / "tests" / "data" / "hf"
    if which == "vit":
        from examples.vit.config import get_config
        from examples.vit.trainer import ViTTrainer

        cfg = get_config("tiny")
        cfg.progress = "off"
        create = ViTTrainer(cfg)._create
    elif which == "llama-70b-shapes":
        create = lambda: {"model": llama(rngs=nnx.Rngs(0), size="70b", layers=2)}
    else:
        pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'nnx-shard[hf]')")
        cls, config = ns.key_maps.tunix_model(data / ("llama" if which == "tunix-llama3" else "qwen3"))
        create = lambda: {"model": cls(config, rngs=nnx.Rngs(0))}
    # tunix's annotations name a 'tp' axis and need a mesh unless eager sharding is off, as importing
    # tunix leaves it (conftest restores Flax's flags after each test, so that is said here)
    off = which.startswith("tunix")
    with nnx.use_eager_sharding(False) if off else contextlib.nullcontext():
        state = nnx.eval_shape(create)
    mesh = mesh8()
    replicated = ns.plan_sharding(state, [(".*", "replicate")], mesh).bytes_per_device
    s = ns.suggest(state, mesh, budget=replicated // 2)
    assert s.state_bytes <= replicated // 2 and 1 <= len(s.rules) <= 12
    assert all(not any(ch.isdigit() for ch in pattern) for pattern, _ in s.rules), s.rules
    assert ns.plan_sharding(state, s.rules, mesh).bytes_per_device == s.state_bytes


def test_a_compiled_peak_over_the_chip_tightens_the_budget_and_each_attempt_is_reported(monkeypatch):
    """A chip of 16 MiB (as XLA would report it): layouts whose compiled peak is over it are dropped; below
    every peak, the budget is tightened by the excess until no layout is left, and the error lists them
    all."""
    from nnx_shard._trainer import _aot

    trainer = FourLayerTrainer({"mesh": "fsdp:-1", "progress": "off", "ema_decay": 0.99})
    batch = {k: jax.ShapeDtypeStruct((64, 512), np.float32) for k in ("x", "y")}
    monkeypatch.setattr(_aot, "hbm_bytes", lambda device: 16 * MIB)
    monkeypatch.setattr(_aot, "default_budget", lambda mesh: 64 * MIB)
    s = trainer.suggest(batch)
    over = [a for a in s.attempts if "(over the chip memory)" in a]
    assert {a.split(":")[0] for a in over} >= {"everything replicated", "EMA sharded"}
    assert s.layout in ("full fsdp", "fsdp above 0.5 MiB") and s.compiled
    monkeypatch.setattr(_aot, "hbm_bytes", lambda device: MIB)  # below every compiled peak
    with pytest.raises(ns.NoLayoutFitsError, match="budget tightened to") as caught:
        trainer.suggest(batch)
    assert "everything replicated: sends 4.0 MiB" in str(caught.value)


def test_suggest_says_nothing_about_candidate_rules_the_user_never_wrote(caplog, recwarn):
    """Dimensions no axis divides (70 over 8) make fsdp leave leaves replicated; the candidates' notes stay in
    their plans instead of reaching the log as if they were about the user's rules."""

    def build():
        m = nnx.Sequential(nnx.Linear(30, 70, rngs=nnx.Rngs(0)), nnx.Linear(70, 1, rngs=nnx.Rngs(1)))
        return {
            "model": m,
            "optimizer": nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param),
            "ema": nnx.EMA(m, 0.9),
        }

    state = nnx.eval_shape(build)
    with caplog.at_level("INFO", logger="nnx_shard"):
        s = ns.suggest(state, mesh8())
    assert not [r for r in caplog.records if r.name.startswith("nnx_shard")], caplog.text
    assert not [w for w in recwarn if issubclass(w.category, ns.errors.NnxShardWarning)]
    assert s.layout == "everything replicated"
    from nnx_shard._suggest._layouts import layouts

    full = next(
        c for c in layouts(state, mesh8()) if c.name == "full fsdp"
    )  # the notes are still in its plan
    assert any("no free dimension of (70,)" in n for p in full.plan.leaves for n in p.notes)
    with caplog.at_level("WARNING", logger="nnx_shard"):  # the user's own rules still log as before
        ns.plan_sharding(state, [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh8())
    assert "leaves left replicated" in caplog.text
