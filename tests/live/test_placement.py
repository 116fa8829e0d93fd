"""place_like_target and sharded init, checked bitwise and with XLA's memory analysis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard import PlacementError, create_sharded, place_like_target
from nnx_shard.placement import sharded_init_fn
from tests.helpers import MLP, mesh_of

F = "fsdp(axis='fsdp', min_size_to_shard_mb=0)"


def test_place_numpy_scalars_and_jax_arrays():
    mesh = mesh_of("2x4")
    tree = {
        "a": np.arange(32, dtype=np.float32).reshape(8, 4),
        "b": jnp.ones((4, 8), jnp.bfloat16),
        "c": 3,
        "d": "x",
    }
    target = {
        "a": NamedSharding(mesh, P(("dp", "fsdp"))),
        "b": jax.ShapeDtypeStruct((4, 8), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp"))),
        "c": NamedSharding(mesh, P()),
        "d": None,
    }
    out = place_like_target(tree, target)
    assert out["a"].sharding == target["a"]
    assert out["b"].sharding == target["b"].sharding
    assert out["c"].sharding == target["c"] and int(out["c"]) == 3
    assert out["d"] == "x"
    np.testing.assert_array_equal(np.asarray(out["a"]), tree["a"])
    assert [s.data.shape for s in out["a"].addressable_shards] == [(1, 4)] * 8


def test_place_jax_array_from_another_mesh():
    a = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    b = ns.create_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[4:])
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(a, P("fsdp")))
    out = place_like_target({"x": x}, {"x": NamedSharding(b, P("tp", "dp"))})
    assert out["x"].sharding == NamedSharding(b, P("tp", "dp"))
    assert {d.id for d in out["x"].devices()} == {d.id for d in jax.devices()[4:]}
    np.testing.assert_array_equal(np.asarray(out["x"]), np.arange(64.0).reshape(8, 8))


def test_place_state_and_module_from_host_copy():
    mesh = mesh_of("8")
    model = MLP(nnx.Rngs(0))
    shardings = ns.infer_sharding(model, [(".*", F)], mesh)
    host = jax.tree.map(np.asarray, nnx.state(model))
    placed = place_like_target(host, shardings)
    assert isinstance(placed, nnx.State)
    assert placed["up"]["kernel"].get_value().sharding == shardings["up"]["kernel"]
    fresh = MLP(nnx.Rngs(1))
    same = place_like_target(fresh, shardings)
    assert same is fresh and fresh.up.kernel.get_value().sharding.spec == P(None, "fsdp")


@pytest.mark.parametrize(
    "tree, fragment",
    [
        ({"a": np.ones((8, 4)), "extra": np.ones(2)}, "not in the target ['extra']"),
        ({"b": np.ones((8, 4))}, "missing ['a']"),
        ({"a": np.ones((4, 8))}, "'a' has shape (4, 8) but its target has (8, 4)"),
        ({"a": np.ones((8, 4), np.int32)}, "'a' has dtype int32 but its target has float32"),
    ],
)
def test_mismatch_raises_and_places_nothing(tree, fragment):
    mesh = mesh_of("8")
    target = {"a": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))}
    before = len(jax.live_arrays())
    with pytest.raises(PlacementError) as e:
        place_like_target(tree, target)
    assert fragment in str(e.value)
    assert len(jax.live_arrays()) == before


def _factory():
    model = MLP(nnx.Rngs(0), din=64, dh=256)
    return {
        "model": model,
        "optimizer": nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
        "ema": nnx.EMA(model, decay=0.9),
    }


def test_sharded_init_is_bitwise_equal_to_unsharded_init():
    mesh = mesh_of("2x4")
    objects, plan = create_sharded(_factory, [(".*embedding", "replicate"), (".*", F)], mesh)
    reference = _factory()
    for key in ("model", "optimizer", "ema"):
        got, want = nnx.state(objects[key]), nnx.state(reference[key])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            if jnp.issubdtype(g.dtype, jax.dtypes.prng_key):
                g, w = jax.random.key_data(g), jax.random.key_data(w)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    kernel = nnx.state(objects["optimizer"])["opt_state"][0]["mu"]["layers"][0]["kernel"].get_value()
    assert kernel.sharding.spec == P(None, "fsdp")
    assert plan.leaf("model/up/kernel").spec == P(None, "fsdp")


def test_sharded_init_never_holds_a_full_sharded_array():
    mesh = mesh_of("8")
    init, _, plan = sharded_init_fn(_factory, [(".*", F)], mesh)
    memory = init.lower().compile().memory_analysis()
    # Outputs per device are exactly the plan's bytes on the fullest device,
    # XLA adds one 8-byte pointer per output for the result tuple.
    arrays = sum(1 for p in plan.leaves if p.spec is not None)
    assert memory.output_size_in_bytes == plan.bytes_per_device + 8 * arrays
    # The largest sharded array whole would be 64 KiB; no buffer that big is live.
    largest = max(p.total_bytes for p in plan.leaves if p.sharded)
    assert memory.temp_size_in_bytes < largest


def test_shardings_alone_are_checked_for_divisibility_before_any_transfer():
    from jax.sharding import NamedSharding

    mesh = ns.create_mesh((8,), ("fsdp",))
    before = len(jax.live_arrays())
    tree = {"ok": np.ones((16, 4), np.float32), "bad": np.ones((12, 4), np.float32)}
    target = {"ok": NamedSharding(mesh, P("fsdp")), "bad": NamedSharding(mesh, P("fsdp"))}
    with pytest.raises(PlacementError) as e:
        place_like_target(tree, target)
    text = str(e.value)
    assert "'bad' of shape (12, 4) cannot be placed on P('fsdp')" in text
    assert "dim 0 of size 12 is not divisible by the 8 shards of 'fsdp'" in text and "Pad the array" in text
    assert len(jax.live_arrays()) == before  # nothing was placed


def test_device_arrays_move_through_the_reshard_engine_never_gathered_on_one_device(monkeypatch):
    """place_like_target on jax arrays goes through ns.reshard (each piece sent once), not jax.device_put."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from nnx_shard._live import _placement
    from tests.helpers import no_host_transfers

    devices = jax.devices()
    src = NamedSharding(Mesh(np.array(devices), ("fsdp",)), PartitionSpec("fsdp"))
    dst = NamedSharding(Mesh(np.array(devices[4:]), ("tp",)), PartitionSpec(None, "tp"))
    x = jax.device_put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), src)
    calls = []
    monkeypatch.setattr(_placement, "reshard", lambda *a, **k: calls.append(a) or ns.reshard(*a, **k))
    with no_host_transfers():
        out = ns.place_like_target({"w": x, "host": np.ones((8, 4), np.float32)}, {"w": dst, "host": None})
    assert len(calls) == 1 and out["w"].sharding == dst
    assert (np.asarray(out["w"]) == np.asarray(x)).all() and not x.is_deleted()
    assert isinstance(out["host"], np.ndarray)  # no target sharding: passed through
