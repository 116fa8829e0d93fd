"""The training state as a type: a typed record the layers pass, its kinds, and the old mapping views."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns

STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def create() -> ns.TrainingState:
    model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
    return ns.TrainingState(
        model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), nnx.EMA(model, decay=0.9)
    )


def test_a_training_state_is_a_typed_record_that_reads_as_the_old_mapping():
    state = create()
    assert list(state) == ["model", "optimizer", "ema"] and len(state) == 3
    assert state["model"] is state.model and state.get("missing") is None
    assert state == {"model": state.model, "optimizer": state.optimizer, "ema": state.ema}
    without = ns.TrainingState(state.model, counter=jnp.zeros(()))
    assert list(without) == ["model", "counter"] and without.optimizer is None and without.ema is None
    assert [without.kind(k) for k in without] == [ns.sharding.Kind.MODEL, ns.sharding.Kind.STATE]
    assert (
        ns.TrainingState.of({"model": state.model, "opt": state.optimizer}).kind("opt")
        is ns.sharding.Kind.OPTIMIZER
    )
    assert ns.TrainingState.of(state) is state
    replaced = state.replace(ema=None, step=3)
    assert list(replaced) == ["model", "optimizer", "step"] and list(state) == ["model", "optimizer", "ema"]
    with pytest.raises(TypeError, match="a training state is a TrainingState or a mapping of its parts"):
        ns.TrainingState.of([state.model])


def test_a_training_state_is_a_pytree_that_a_jitted_step_takes_and_returns():
    states = ns.TrainingState(nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0))), step=jnp.zeros((), jnp.int32))
    out = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))(states)
    assert isinstance(out, ns.TrainingState) and list(out) == ["model", "step"]
    assert int(out["step"]) == 1
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(states)[0]]
    assert paths[-1] == "['step']" and paths[0].startswith("['model']")  # the keys a dict's paths have


def test_the_plan_takes_each_leafs_kind_from_the_training_state():
    """An optimizer under a name of the user's: the typed record says it is one, so the plan ranks and
    draws it as the optimizer and the suggestions shard it as one."""
    model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
    state = ns.TrainingState(
        model, moving=nnx.EMA(model, decay=0.9), opt=nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    )
    plan = ns.plan_sharding(state, STRATEGY, ns.create_mesh((8,), ("fsdp",)))
    kinds = {p.path.split("/")[0]: p.kind for p in plan.leaves}
    assert kinds == {
        "model": ns.sharding.Kind.MODEL,
        "moving": ns.sharding.Kind.EMA,
        "opt": ns.sharding.Kind.OPTIMIZER,
    }
    order = [p.path.split("/")[0] for p in plan.leaves]
    assert order.index("opt") < order.index("moving")  # model, optimizer, EMA: the kinds' order
    legacy = ns.plan_sharding({"model": model, "opt_state": nnx.state(state.opt)}, STRATEGY, plan.mesh)
    assert {p.kind for p in legacy.leaves if p.path.startswith("opt_state/")} == {ns.sharding.Kind.OPTIMIZER}


def test_hooks_and_trainer_hand_out_the_training_state_and_the_old_views_warn():
    hooks = ns.ShardingHooks(STRATEGY, ns.create_mesh((8,), ("fsdp",)))
    live = hooks.on_init(create)
    assert isinstance(hooks.training_state, ns.TrainingState)
    assert live.model is hooks.training_state.model and live["ema"] is hooks.training_state.ema
    assert live.ema.params["kernel"].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    with pytest.warns(DeprecationWarning, match="ShardingHooks.objects is now ShardingHooks.training_state"):
        old = hooks.objects
    assert old == dict(hooks.training_state) and old["model"] is live.model
    new = jax.tree.map(lambda x: x * 0, hooks.states())
    hooks.update(new)
    np.testing.assert_array_equal(np.asarray(live.model.kernel.get_value()), 0)  # synced on read

    class Tiny(ns.Trainer):
        def create_model(self, rngs):
            return nnx.Linear(4, 2, rngs=rngs)

        def create_optimizer(self):
            return optax.sgd(0.1)

        def loss_fn(self, model, batch):
            return (model(batch) ** 2).mean()

    trainer = Tiny({"progress": "off", "sharding_strategy": STRATEGY})
    assert isinstance(trainer.training_state, ns.TrainingState)
    assert trainer.training_state.model is trainer.model and trainer.training_state.ema is trainer.ema
    with pytest.warns(DeprecationWarning, match=r"Trainer.objects\(\) is now Trainer.training_state"):
        assert trainer.objects()["model"] is trainer.model
