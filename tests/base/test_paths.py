"""Paths: the one flattener, Leaf records, grouping of objects, and which parameter a leaf mirrors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnx_shard._base._mirror import mirror_candidates
from nnx_shard._base._paths import as_state, flatten_leaves, flatten_with_paths, path_str
from tests.helpers import MLP, make_train_state


def test_paths_are_slash_joined_from_every_key_kind():
    tree = {"a": [1, {"b": 2}], "opt": optax.ScaleByAdamState(count=3, mu={"w": 4}, nu={"w": 5})}
    paths = [p for p, _ in flatten_with_paths(tree)[0]]
    assert paths == ["a/0", "a/1/b", "opt/count", "opt/mu/w", "opt/nu/w"]
    keypath = jax.tree_util.tree_flatten_with_path({"x": (7,)})[0][0][0]
    assert path_str(keypath) == "x/0"


def test_variables_are_leaves_and_carry_their_metadata():
    model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    leaves, treedef = flatten_leaves(model)
    by_path = {leaf.path: leaf for leaf in leaves}
    assert set(by_path) == {
        "emb/embedding",
        "layers/0/bias",
        "layers/0/kernel",
        "layers/1/bias",
        "layers/1/kernel",
        "up/bias",
        "up/kernel",
    }
    assert by_path["up/kernel"].shape == (16, 32) and by_path["up/kernel"].nbytes == 16 * 32 * 4
    assert isinstance(by_path["up/kernel"].variable, nnx.Param)
    assert treedef.num_leaves == len(leaves)


def test_typed_keys_have_an_itemsize():
    leaves, _ = flatten_leaves({"key": jax.random.split(jax.random.key(0), 4)})
    assert leaves[0].shape == (4,) and leaves[0].itemsize == 8 and leaves[0].nbytes == 32


def test_groups_of_objects_become_groups_of_states():
    model, opt, ema = make_train_state()
    states, depth = as_state({"model": model, "optimizer": opt, "ema": ema})
    assert depth == 1 and set(states) == {"model", "optimizer", "ema"}
    assert all(isinstance(s, nnx.State) for s in states.values())
    assert as_state(model)[1] == 0 and isinstance(as_state(model)[0], nnx.State)
    plain = {"w": jnp.ones(2)}
    assert as_state(plain) == (plain, 0)  # plain pytrees pass through, ungrouped


def test_mirror_candidates_end_with_the_parameter_path():
    assert mirror_candidates(("opt_state", "1", "0", "mu", "up", "kernel"))[-1] == "up/kernel"
    assert mirror_candidates(("params", "up", "kernel")) == ("up/kernel",)
    assert mirror_candidates(("encoder", "layers", "0", "kernel")) == ()
    grouped = mirror_candidates(("optimizer", "opt_state", "0", "mu", "head", "kernel"), group_depth=1)
    assert grouped[0] == "opt_state/0/mu/head/kernel" and grouped[-1] == "head/kernel"
