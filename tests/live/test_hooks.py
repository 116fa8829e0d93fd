"""ShardingHooks: the one owner of the live state, through init, functional updates and restores."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns

STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def create():
    model = nnx.Linear(8, 32, rngs=nnx.Rngs(0))
    return {
        "model": model,
        "optimizer": nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
        "ema": nnx.EMA(model, decay=0.5),
    }


def mesh(n=8):
    return ns.create_mesh((n,), ("fsdp",), devices=jax.devices()[:n])


def test_lifecycle_mistakes_have_their_own_error():
    hooks = ns.ShardingHooks(STRATEGY, mesh())
    for call in (lambda: hooks.plan, hooks.states, lambda: hooks.on_restore({}), lambda: hooks.update({})):
        with pytest.raises(ns.LifecycleError, match=r"call on_init\(create\) or adopt\(objects\) first"):
            call()
    with pytest.raises(ns.LifecycleError, match=r"exactly one of create= .* or objects="):
        hooks.on_init()
    assert issubclass(ns.LifecycleError, RuntimeError) and not issubclass(
        ns.LifecycleError, ns.CheckpointError
    )


def test_on_init_moves_existing_objects_into_place():
    objects = create()
    kernel = np.asarray(objects["model"].kernel.get_value())
    hooks = ns.ShardingHooks(STRATEGY, mesh())
    live = hooks.on_init(objects=objects)
    assert live["model"] is objects["model"]  # the objects the user holds are the live ones
    placed = objects["model"].kernel.get_value()
    assert placed.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    np.testing.assert_array_equal(np.asarray(placed), kernel)
    assert hooks.plan.leaf("model/kernel").bytes_per_device == 8 * 32 * 4 // 8


def test_a_functional_step_updates_the_objects_through_the_hooks():
    hooks = ns.ShardingHooks(STRATEGY, mesh())
    objects = hooks.on_init(create)
    graphdef = nnx.graphdef(objects["model"])

    @jax.jit
    def double(state):
        model = nnx.merge(graphdef, state)
        model.kernel.set_value(model.kernel.get_value() * 2)
        return nnx.state(model)

    before = np.asarray(objects["model"].kernel.get_value())
    hooks.update({"model": double(hooks.states()["model"])})
    pending = hooks.states()["model"]["kernel"].get_value()
    np.testing.assert_array_equal(np.asarray(pending), 2 * before)  # the loop sees the new state at once
    model = hooks.training_state["model"]  # and the objects when asked for
    np.testing.assert_array_equal(np.asarray(model.kernel.get_value()), 2 * before)
    with pytest.raises(
        ns.CheckpointError, match=r"states for \['teacher'\], which are not among the objects"
    ):
        hooks.update({"teacher": hooks.states()["model"]})


def test_on_restore_places_host_data_and_states_from_another_mesh():
    source = ns.ShardingHooks(STRATEGY, mesh(8))
    source.on_init(create)
    saved = source.states()
    host = {k: jax.tree.map(np.asarray, nnx.to_pure_dict(v)) for k, v in saved.items()}
    for restored in (host, saved):
        hooks = ns.ShardingHooks(STRATEGY, mesh(4))
        fresh = create()
        fresh["model"].kernel.set_value(fresh["model"].kernel.get_value() + 1)
        hooks.on_init(objects=fresh)
        hooks.on_restore(restored)
        kernel = hooks.training_state["model"].kernel.get_value()
        assert dict(kernel.sharding.mesh.shape) == {"fsdp": 4}
        np.testing.assert_array_equal(np.asarray(kernel), host["model"]["kernel"])
    with pytest.raises(ns.CheckpointError, match=r"restored keys \['extra'\] are not among the objects"):
        hooks.on_restore({"extra": host["model"]})


def test_options_given_with_another_restore_argument_raise_instead_of_dropping_it(tmp_path):
    hooks = ns.ShardingHooks(STRATEGY, mesh())
    hooks.on_init(create)
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        hooks.save(ckpt, 1)
        options = ns.RestoreOptions(only=["model"])
        with pytest.raises(
            ns.ConflictingArgumentsError, match=r"options= was given together with free_live=True"
        ):
            hooks.restore_and_reshard(ckpt, options=options, free_live=True)
        assert issubclass(ns.ConflictingArgumentsError, TypeError)
        report = hooks.restore_and_reshard(ckpt, options=options)  # options alone: read as given
        assert report.only == ("model",)


def test_restore_and_reshard_builds_no_owner_and_restore_onto_is_a_function_over_states(
    tmp_path, monkeypatch
):
    source = ns.ShardingHooks(STRATEGY, mesh(8))
    source.on_init(create)
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        source.save(ckpt, 3)
    saved = np.asarray(source.training_state["model"].kernel.get_value())

    def no_owner(*args, **kwargs):
        raise AssertionError("restore_and_reshard built a ShardingHooks")

    monkeypatch.setattr(ns.ShardingHooks, "__init__", no_owner)
    fresh = create()
    report = ns.restore_and_reshard(str(tmp_path), fresh, STRATEGY, mesh(4))
    assert report.step == 3 and dict(fresh["model"].kernel.get_value().sharding.mesh.shape) == {"fsdp": 4}
    np.testing.assert_array_equal(np.asarray(fresh["model"].kernel.get_value()), saved)

    from nnx_shard._checkpoint import restore_onto

    other = create()
    states = {k: nnx.state(v) for k, v in other.items()}
    shardings = ns.infer_sharding(other, STRATEGY, mesh(2))
    before = np.asarray(other["model"].kernel.get_value())
    restored, report = restore_onto(
        str(tmp_path), states, shardings, mesh(2), options=ns.RestoreOptions(only=["model"])
    )
    assert sorted(restored) == ["model"] and report.only == ("model",)
    assert dict(restored["model"]["kernel"].get_value().sharding.mesh.shape) == {"fsdp": 2}
    np.testing.assert_array_equal(np.asarray(restored["model"]["kernel"].get_value()), saved)
    np.testing.assert_array_equal(np.asarray(other["model"].kernel.get_value()), before)  # nothing written


def test_the_mapping_on_init_returns_is_never_stale_after_update():
    mesh8 = ns.create_mesh((8,), ("fsdp",))
    hooks = ns.ShardingHooks([(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh8)
    objects = hooks.on_init(lambda: {"model": nnx.Linear(8, 16, rngs=nnx.Rngs(0))})
    model = objects["model"]
    before = model.kernel.get_value().copy()
    hooks.update(jax.jit(lambda states: jax.tree.map(lambda x: x + 1, states))(hooks.states()))
    assert (model.kernel.get_value() == before).all()  # not written yet: a loop pays nothing per step
    assert (objects["model"].kernel.get_value() == before + 1).all()  # reading the mapping synced them
    assert (model.kernel.get_value() == before + 1).all()
    assert objects["model"] is model and list(objects) == ["model"] and len(objects) == 1
    assert dict(objects) == hooks.training_state
