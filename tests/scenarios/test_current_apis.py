"""Current library APIs: no deprecation warnings from nnx_shard's own calls; explicit mesh axes and
jax.set_mesh work."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns
from tests.apps.trainer_app import RegressionTrainer, batch_for, config
from tests.helpers import no_host_transfers

PACKAGE = str(Path(ns.__file__).parent)
STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def create():
    model = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
    return {
        "model": model,
        "optimizer": nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
        "ema": nnx.EMA(model, decay=0.9),
    }


def ours(caught):
    return [
        f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, DeprecationWarning | FutureWarning | PendingDeprecationWarning)
        and w.filename.startswith(PACKAGE)
    ]


def test_no_deprecation_warnings_from_the_package(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh8 = ns.create_mesh((8,), ("fsdp",))
        mesh4 = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4], use_jax=True)
        hooks = ns.ShardingHooks(STRATEGY, mesh8)
        hooks.on_init(create)
        with ns.Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
            hooks.save(ckpt, 1)
            fresh = create()
            report = ns.restore_and_reshard(ckpt, fresh, STRATEGY, mesh4)
        moved = ns.reshard(hooks.states(), ns.infer_sharding(hooks.states(), STRATEGY, mesh4), donate=True)
        trainer = RegressionTrainer({**config(str(tmp_path / "run")), "async_save": False})
        trainer.train(batch_for, steps=2)
    assert str(report).startswith("restored step 1, saved on 8 devices")
    assert jax.tree.leaves(moved)[0].sharding.mesh.devices.size == 4
    assert not ours(caught), "\n".join(ours(caught))


def test_explicit_axes_and_set_mesh_everywhere(tmp_path):
    explicit8 = ns.create_mesh((8,), ("fsdp",), axis_types="explicit")
    explicit4 = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[4:], axis_types="explicit")
    assert explicit8.axis_types == (jax.sharding.AxisType.Explicit,)
    with jax.set_mesh(explicit8):
        objects, _ = ns.create_sharded(create, STRATEGY, explicit8)
        kernel = objects["model"].layers[0].kernel.get_value()
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
        before = np.asarray(kernel)
        states = {k: nnx.state(v) for k, v in objects.items()}
        with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
            ckpt.save(3, states, mesh=explicit8)
        target = ns.infer_sharding(states, STRATEGY, explicit4)
        with no_host_transfers():
            moved = ns.reshard(states, target)
        placed = ns.place_like_target(
            {"w": np.ones((16, 8), np.float32)}, {"w": target["model"]["layers"][0]["kernel"]}
        )
    moved_kernel = moved["model"]["layers"][0]["kernel"].get_value()
    assert moved_kernel.sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    np.testing.assert_array_equal(np.asarray(moved_kernel), before)
    assert placed["w"].sharding.mesh.devices.size == 4
    with jax.set_mesh(explicit4):
        fresh = create()
        report = ns.restore_and_reshard(ns.Checkpointer(tmp_path), fresh, STRATEGY, explicit4)
        restored = fresh["model"].layers[0].kernel.get_value()
    np.testing.assert_array_equal(np.asarray(restored), before)
    assert restored.sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    assert "onto 4 devices (fsdp=4)" in str(report)
