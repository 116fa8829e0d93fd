"""Property tests: whatever the shapes, meshes and tactics, every spec is valid."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nnx_shard as ns
from nnx_shard._base._specs import spec_axes
from tests.helpers import MESHES, mesh_of

SIZES = st.sampled_from([1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32])
SHAPES = st.lists(SIZES, min_size=0, max_size=4).map(tuple)
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int8, jnp.bool_])


@st.composite
def tactics(draw, names):
    def one():
        kind = draw(st.sampled_from(["fsdp", "fsdp2", "shard_dim", "replicate", "auto"]))
        a = draw(st.sampled_from(names))
        if kind == "fsdp":
            return f"fsdp(axis={a!r}, min_size_to_shard_mb=0)"
        if kind == "fsdp2" and len(names) > 1:
            pair = tuple(draw(st.permutations(names))[:2])
            return f"fsdp(axis={pair!r}, min_size_to_shard_mb=0)"
        if kind == "shard_dim":
            return f"shard_dim(axis={a!r}, dim={draw(st.integers(-3, 3))})"
        return "replicate()" if kind == "replicate" else f"fsdp(axis={a!r})"

    return "|".join(one() for _ in range(draw(st.integers(1, 3))))


@pytest.mark.filterwarnings("ignore::nnx_shard.UnusedRuleWarning")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_leaf_gets_a_valid_spec(data):
    key = data.draw(st.sampled_from(sorted(MESHES)))
    mesh = mesh_of(key)
    names = list(mesh.axis_names)
    shapes = data.draw(st.lists(st.tuples(SHAPES, DTYPES), min_size=1, max_size=6))
    state = {f"p{i}": jax.ShapeDtypeStruct(s, d) for i, (s, d) in enumerate(shapes)}
    strategy = [(f"p{i}", data.draw(tactics(names))) for i in range(0, len(state), 2)] + [(".*", "replicate")]
    try:
        plan = ns.plan_sharding(state, strategy, mesh)
    except (ns.IndivisibleShardingError, ns.ShardingConflictError, ns.TacticArgumentError) as e:
        assert str(e).startswith("rule ")  # a refusal always names its rule
        return
    for p in plan.leaves:
        spec = tuple(p.spec)
        assert len(spec) == len(p.shape)
        axes = spec_axes(spec)
        assert len(axes) == len(set(axes)), spec
        for d, entry in zip(p.shape, spec, strict=True):
            if entry is not None:
                group = (entry,) if isinstance(entry, str) else entry
                assert d % math.prod(mesh.shape[a] for a in group) == 0
        sharding = plan.shardings[p.path]
        shard = sharding.shard_shape(p.shape)
        itemsize = jnp.dtype(p.dtype).itemsize
        assert p.bytes_per_device == math.prod(shard) * itemsize


@pytest.mark.parametrize("key", sorted(MESHES))
@settings(max_examples=30, deadline=None)
@given(shape=SHAPES.filter(lambda s: len(s) > 0))
def test_fsdp_never_raises_and_shards_the_largest_divisible_dim(key, shape):
    mesh = mesh_of(key)
    axis = "fsdp"
    k = mesh.shape[axis]
    s = ns.infer_sharding(
        {"w": jax.ShapeDtypeStruct(shape, jnp.float32)},
        [(".*", f"fsdp(axis={axis!r}, min_size_to_shard_mb=0)")],
        mesh,
    )
    spec = tuple(s["w"].spec)
    divisible = [i for i, d in enumerate(shape) if d % k == 0]
    if not divisible:
        assert all(e is None for e in spec)
    else:
        (i,) = [i for i, e in enumerate(spec) if e is not None]
        assert shape[i] == max(shape[j] for j in divisible)
