"""The mirror heuristic (nnx_shard._base._mirror), one test per rule it applies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnx_shard._base._paths import flatten_leaves


def leaves(tree) -> dict:
    return {leaf.path: leaf for leaf in flatten_leaves(tree)[0]}


def state_of(model, tx=None, ema=True) -> dict:
    out = {"model": model, "optimizer": nnx.Optimizer(model, tx or optax.adam(1e-3), wrt=nnx.Param)}
    if ema:
        out["ema"] = nnx.EMA(model, decay=0.9, only=nnx.Param)
    return out


def test_optimizer_moments_mirror_their_parameter_through_the_chain_and_the_optax_fields():
    model = nnx.eval_shape(lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0)))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    found = leaves(nnx.eval_shape(lambda: state_of(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), tx, ema=False)))
    mu = found["optimizer/opt_state/1/0/mu/kernel"]
    assert mu.mirror == "kernel" and mu.candidates[-1] == "model/kernel"
    assert "1/0/mu/kernel" in mu.candidates and "mu/kernel" in mu.candidates
    assert mu.mirror_variable is not None and mu.mirror_variable.shape == (4, 8)
    assert found["model/kernel"].mirror is None and model is not None


def test_the_emas_copy_mirrors_the_parameter_it_averages():
    found = leaves(nnx.eval_shape(lambda: state_of(nnx.Linear(4, 8, rngs=nnx.Rngs(0)))))
    copy = found["ema/params/kernel"]
    assert copy.mirror == "kernel" and "model/kernel" in copy.candidates
    alone = leaves(nnx.eval_shape(lambda: nnx.EMA(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), decay=0.9)))
    assert alone["params/kernel"].mirror == "kernel"  # an EMA by itself: its group says so


def test_counters_find_no_parameter():
    found = leaves(nnx.eval_shape(lambda: state_of(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), ema=False)))
    count, step = found["optimizer/opt_state/0/count"], found["optimizer/step"]
    assert count.mirror == "count" and count.mirror_variable is None
    assert not any(c.startswith("model/") for c in count.candidates)
    assert step.mirror is None and step.candidates == ("step",)


def test_stacked_layers_moments_mirror_the_stacked_parameter_with_its_layer_axis():
    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(key):
        return nnx.Linear(4, 4, rngs=nnx.Rngs(key))

    def build():
        model = nnx.Dict(layers=stack(jax.random.split(jax.random.key(0), 3)))
        return state_of(model, ema=False)

    found = leaves(nnx.eval_shape(build))
    nu = found["optimizer/opt_state/0/nu/layers/kernel"]
    assert nu.shape == (3, 4, 4) and nu.mirror == "layers/kernel" and nu.mirror_variable.shape == (3, 4, 4)


def test_lora_parameters_and_their_moments_mirror_each_other():
    def build():
        model = nnx.LoRA(8, 2, 8, rngs=nnx.Rngs(0))
        return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.LoRAParam)}

    found = leaves(nnx.eval_shape(build))
    mu = found["optimizer/opt_state/0/mu/lora_a"]
    assert mu.mirror == "lora_a" and mu.shape == (8, 2) and "model/lora_a" in mu.candidates


def test_a_plain_pytree_is_never_taken_for_optimizer_state_even_when_its_shapes_coincide():
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    found = leaves(
        {"model": model, "value": {"w": jnp.zeros((4, 8))}, "other": nnx.State({"params": {"w": 1}})}
    )
    assert found["value/w"].mirror is None and found["value/w"].candidates == ("w",)
    coincide = leaves({"model": model, "stats": nnx.State({"params": {"kernel": jnp.zeros((4, 8))}})})
    assert coincide["stats/params/kernel"].mirror == "kernel"  # rule 1d: params + the same path and shape
    differ = leaves({"model": model, "stats": nnx.State({"params": {"kernel": jnp.zeros((8, 4))}})})
    assert differ["stats/params/kernel"].mirror is None  # same path, another shape: not a copy of it


def test_an_optax_state_under_the_users_own_keys_mirrors_what_follows_its_last_field():
    params = {"enc": {"w": jnp.zeros((4, 4))}}
    found = leaves({"opt": optax.adam(1e-3).init(params)})
    assert found["opt/0/mu/enc/w"].mirror == "enc/w"
