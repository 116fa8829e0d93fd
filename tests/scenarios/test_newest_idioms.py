"""The newest JAX and Flax idioms as their docs write them: Explicit meshes, jax.set_mesh, eager sharding,
plain Orbax."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from tests.apps.trainer_app import MLP, RegressionTrainer, batch_for, config

FSDP = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
EXPLICIT = (AxisType.Explicit,)


def explicit(n: int = 8, devices=None):
    return jax.make_mesh((n,), ("fsdp",), axis_types=EXPLICIT, devices=devices or jax.devices()[:n])


def context(mesh, inside: bool):
    return jax.set_mesh(mesh) if inside else contextlib.nullcontext()


def meshes_of(tree):
    return {x.sharding.mesh for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)}


def create():
    model = MLP(nnx.Rngs(0), width=32)
    return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)}


# -- 1. any mesh, kept as given ------------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True], ids=["outside-set_mesh", "inside-set_mesh"])
def test_every_entry_point_keeps_the_explicit_mesh_it_is_given(tmp_path, inside):
    mesh8, mesh4 = explicit(8), explicit(4, jax.devices()[4:])
    with context(mesh8, inside):
        shardings = ns.infer_sharding(nnx.eval_shape(create), FSDP, mesh8)
        objects, _ = ns.create_sharded(create, FSDP, mesh8)
        placed = ns.place_like_target(
            {"w": np.ones((32, 8), np.float32)}, {"w": NamedSharding(mesh8, P("fsdp"))}
        )
        hooks = ns.ShardingHooks(FSDP, mesh8)
        hooks.on_init(create)
        with ns.Checkpointer(tmp_path / "c", async_save=False) as ckpt:
            hooks.save(ckpt, 1)
    assert {s.mesh for s in jax.tree.leaves(shardings)} == {mesh8}
    states = {k: nnx.state(v) for k, v in objects.items()}
    assert meshes_of(states) == {mesh8} and meshes_of(placed) == {mesh8}
    with context(mesh4, inside):
        moved = ns.reshard(states, ns.infer_sharding(states, FSDP, mesh4))
        hooks.on_mesh_change(mesh4)
        fresh = create()
        ns.restore_and_reshard(str(tmp_path / "c"), fresh, FSDP, mesh4)
    assert meshes_of(moved) == {mesh4} and meshes_of(hooks.states()) == {mesh4}
    assert meshes_of({k: nnx.state(v) for k, v in fresh.items()}) == {mesh4}
    for m in (mesh4, mesh8):
        assert m.axis_types == EXPLICIT


# -- 2. the Trainer on Explicit meshes -----------------------------------------------------------


def train(mesh, inside: bool, workdir: str, **extra):
    trainer = RegressionTrainer(
        {**config(workdir, total_steps=4), "mesh": mesh, "ema_decay": 0.9, "eval_every": 4, **extra}
    )
    with context(mesh, inside):
        history = trainer.train(batch_for, eval_data=lambda: [batch_for(100)])
    return trainer, history


@pytest.mark.parametrize("inside", [False, True], ids=["outside-set_mesh", "inside-set_mesh"])
def test_trainer_on_an_explicit_mesh_trains_as_on_an_auto_one(tmp_path, inside):
    auto = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    reference, ref_history = train(auto, False, str(tmp_path / "auto"))
    trainer, history = train(explicit(), inside, str(tmp_path / "explicit"))
    np.testing.assert_allclose([h["loss"] for h in history], [h["loss"] for h in ref_history], rtol=1e-5)
    np.testing.assert_allclose(trainer.last_eval["eval_loss"], reference.last_eval["eval_loss"], rtol=1e-5)
    assert meshes_of(trainer.states) == {trainer.mesh} and trainer.mesh.axis_types == EXPLICIT
    kernel = trainer.states["model"]["l2"]["kernel"].get_value()
    assert kernel.sharding.spec == P(None, "fsdp")
    # The model is usable afterwards under jax.set_mesh, through a step of the user's own.
    model = trainer.hooks.training_state["model"]

    @nnx.jit
    @ns.sharding.auto_axes
    def predict(model, x):
        return model(x)

    with jax.set_mesh(trainer.mesh):
        out = predict(model, jnp.asarray(batch_for(0)["x"]))
    assert out.shape == (16, 1) and np.isfinite(np.asarray(out)).all()


def test_trainer_checkpoint_from_an_explicit_mesh_restores_onto_another_device_count(tmp_path):
    workdir = str(tmp_path / "run")
    saved, _ = train(explicit(), True, workdir)
    saved.checkpointer.wait_until_finished()
    half = explicit(4)
    again = RegressionTrainer({**config(workdir, total_steps=6), "mesh": half, "ema_decay": 0.9})
    with jax.set_mesh(half):
        report = again.restore_and_reshard()
        history = again.train(batch_for)
    assert "onto 4 devices (fsdp=4)" in str(report)
    for path in ("model", "optimizer", "ema"):
        for _, b in zip(
            jax.tree.leaves(saved.states[path]), jax.tree.leaves(again.states[path]), strict=True
        ):
            assert b.sharding.mesh == again.mesh
    assert len(history) == 2 and meshes_of(again.states) == {half}
    # Trainer.resize keeps the Explicit mesh it is given too.
    again.resize(explicit(8))
    assert meshes_of(again.states) == {again.mesh} and again.mesh.axis_types == EXPLICIT


# -- 3. your own step on an Explicit mesh --------------------------------------------------------


def test_own_step_fails_raw_and_runs_under_auto_axes_with_the_state_kept_in_place():
    mesh = explicit()
    objects, plan = ns.create_sharded(create, FSDP, mesh)
    model, optimizer = objects["model"], objects["optimizer"]
    batch = {k: jnp.asarray(v) for k, v in batch_for(0).items()}

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    with jax.set_mesh(mesh), pytest.raises(Exception, match="Contracting dimensions are sharded") as raw:
        nnx.jit(step)(model, optimizer, batch)  # what the plan's note is about
    assert type(raw.value).__name__ == "ShardingTypeError"  # JAX's own (not exported by name)
    assert any("nnx_shard.auto_axes" in n for n in plan.notes) and "auto_axes" in plan.summary()
    before = np.asarray(model.l2.kernel.get_value())
    with jax.set_mesh(mesh):
        losses = [float(nnx.jit(ns.sharding.auto_axes(step))(model, optimizer, batch)) for _ in range(3)]
    assert losses[2] < losses[0]
    assert not np.array_equal(np.asarray(model.l2.kernel.get_value()), before)  # updated in place
    assert model.l2.kernel.get_value().sharding.spec == P(None, "fsdp")
    assert optimizer.opt_state[0].mu["l2"]["kernel"].get_value().sharding.spec == P(None, "fsdp")
    assert int(optimizer.step.get_value()) == 3


def test_own_step_with_jax_auto_axes_and_the_inferred_shardings():
    mesh = explicit()
    objects, _ = ns.create_sharded(create, FSDP, mesh)
    graphdef, state = nnx.split(objects["model"])
    specs = jax.tree.map(lambda s: s.spec, ns.infer_sharding(state, FSDP, mesh))
    x = jnp.asarray(batch_for(0)["x"])

    @jax.jit
    def sgd(state, x):
        def body(state, x):
            grads = jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))(state)
            return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

        return jax.sharding.auto_axes(body, out_sharding=specs)(state, x)

    with jax.set_mesh(mesh):
        new = sgd(state, x)
    assert new["l2"]["kernel"].get_value().sharding.spec == P(None, "fsdp")
    assert meshes_of(new) == {mesh}


def test_auto_axes_is_a_no_op_without_explicit_axes():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    f = nnx.jit(ns.sharding.auto_axes(lambda m, x: m(x).sum()))
    np.testing.assert_allclose(
        float(f(model, jnp.ones((2, 4)))), float(model(jnp.ones((2, 4))).sum()), rtol=1e-6
    )


# -- 4. eager sharding, Flax's default -----------------------------------------------------------


class Annotated(nnx.Module):
    def __init__(self, rngs, names=(None, "fsdp"), out=("fsdp", None), features=16):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(features, 32, kernel_init=nnx.with_partitioning(init, names), rngs=rngs)
        self.down = nnx.Linear(32, features, kernel_init=nnx.with_partitioning(init, out), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def logical(rngs):
    # 16 features: every shard is at least 8 wide. (XLA's CPU code for a shard 4 wide rounds the
    # initializer's arithmetic differently in the last bit: plain jax.jit with those out_shardings does too.)
    return Annotated(rngs, names=("embed", "mlp"), out=("mlp", "embed"), features=16)


def unsharded(factory):
    with nnx.use_eager_sharding(False):
        return {p: np.asarray(v) for p, v in ns.sharding.flatten_state(nnx.state(factory(nnx.Rngs(0))))}


@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("inside", [False, True], ids=["outside-set_mesh", "inside-set_mesh"])
def test_eager_sharding_creates_annotated_models_bitwise(axis_types, inside):
    assert nnx.using_eager_sharding()  # Flax's default, left on
    mesh = jax.make_mesh((2, 4), ("dp", "fsdp"), axis_types=(axis_types,) * 2)
    rules = "annotated(rules=[('embed', 'dp'), ('mlp', 'fsdp')])"
    with context(mesh, inside):
        named, _ = ns.create_sharded(lambda: Annotated(nnx.Rngs(0)), [(".*", "annotated()")], mesh)
        logic, _ = ns.create_sharded(lambda: logical(nnx.Rngs(0)), [(".*", rules)], mesh)
    assert named.up.kernel.get_value().sharding.spec == P(None, "fsdp")
    assert logic.up.kernel.get_value().sharding.spec == P("dp", "fsdp")
    assert logic.down.kernel.get_value().sharding.spec == P("fsdp", "dp")
    assert meshes_of(nnx.state(logic)) == {mesh} and nnx.using_eager_sharding()
    for made, factory in ((named, Annotated), (logic, logical)):
        want = unsharded(factory)
        for p, v in ns.sharding.flatten_state(nnx.state(made)):
            np.testing.assert_array_equal(np.asarray(v), want[p])


def test_eager_sharding_with_a_strategy_that_ignores_the_annotation():
    """Logical names no rule maps: the strategy places every leaf, Flax's eager sharding steps aside."""
    mesh = ns.create_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
    model, _ = ns.create_sharded(lambda: logical(nnx.Rngs(0)), FSDP, mesh)
    assert model.up.kernel.get_value().sharding.spec == P(None, "fsdp")
    want = unsharded(logical)
    for p, v in ns.sharding.flatten_state(nnx.state(model)):
        np.testing.assert_array_equal(np.asarray(v), want[p])


class AnnotatedTrainer(RegressionTrainer):
    def create_model(self, rngs):
        return Annotated(rngs, features=8)

    def loss_fn(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["x"]) ** 2)


@pytest.mark.parametrize("mesh", ["dp:2,fsdp:4", "explicit"])
def test_trainer_and_hooks_create_annotated_models_with_eager_sharding(tmp_path, mesh):
    mesh = explicit() if mesh == "explicit" else mesh
    trainer = AnnotatedTrainer(
        {**config(str(tmp_path), total_steps=2, mesh=mesh), "sharding_strategy": [(".*", "annotated()")]}
    )
    history = trainer.train(batch_for)
    assert len(history) == 2 and np.isfinite(history[-1]["loss"])
    assert trainer.states["model"]["up"]["kernel"].get_value().sharding.spec == P(None, "fsdp")
    hooks = ns.ShardingHooks([(".*", "annotated()")], ns.meshes.mesh_from_string("dp:2,fsdp:4"))
    made = hooks.on_init(lambda: {"model": Annotated(nnx.Rngs(0), features=8)})
    assert made["model"].down.kernel.get_value().sharding.spec == P("fsdp", None)
