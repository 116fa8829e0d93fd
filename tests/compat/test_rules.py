"""The automatic rules, ShardingAnalyzer, create_monitored_function and MeshPartitionHelper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from tests.helpers import mesh_of

S = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "mesh_key, shape, kwargs, expected",
    [
        ("2x4", (4, 8), {}, P("fsdp", "dp")),
        ("2x4", (6, 8), {}, P(None, "dp")),
        ("2x4", (6, 8), {"axis_names": ["fsdp", "dp"]}, P("dp", "fsdp")),
        ("2x4", (6, 8), {"reverse": True}, P("dp", "fsdp")),
        ("2x4", (4, 8), {"min_shard_size": 64}, P()),
        ("2x2x2", (2, 2, 2), {}, P("dp", "fsdp", "tp")),
        ("8", (3, 5), {}, P(None, None)),
    ],
)
def test_auto_sharding_rule(mesh_key, shape, kwargs, expected):
    rule = ns.compat.AutoShardingRule(mesh_of(mesh_key), **kwargs)
    assert rule.apply({"w": S(*shape)}) == {"w": expected}


def test_auto_rule_uses_mesh_in_context():
    mesh = mesh_of("8")
    with jax.set_mesh(mesh):
        assert ns.compat.AutoShardingRule().apply(S(16, 3)) == P("fsdp", None)
    with pytest.raises(ns.MeshError, match="no mesh given and none in context"):
        ns.compat.AutoShardingRule().apply(S(16, 3))


def test_shape_based_rule_first_pattern_wins():
    rule = ns.compat.ShapeBasedShardingRule({(None, 1024): P("tp", None), (1024, 1024): P(None, "tp")})
    out = rule.apply(
        {
            "a": S(1024, 1024),
            "b": S(7, 1024),
            "c": S(
                1024,
            ),
            "d": S(3, 4),
        }
    )
    assert out == {"a": P("tp", None), "b": P("tp", None), "c": P(), "d": P()}


@pytest.mark.parametrize(
    "limit, shape, dtype, expected",
    [
        (2**22, (1024, 1024), jnp.float32, P()),  # exactly fits
        (2**20, (1024, 1024), jnp.float32, P("fsdp", None)),  # fsdp=4 -> 1 MiB
        (2**19, (1024, 1024), jnp.float32, P("fsdp", "dp")),
        (2**18, (1024, 1024), jnp.float32, P("fsdp", "dp")),  # cannot fit: as much as divides
        (2**19, (4096, 64), jnp.bfloat16, P()),  # 512 KiB: fits exactly
        (2**18, (4096, 64), jnp.bfloat16, P("fsdp", None)),
    ],
)
def test_memory_constrained_rule(limit, shape, dtype, expected):
    rule = ns.compat.MemoryConstrainedShardingRule(max_memory_per_device=limit, mesh=mesh_of("2x4"))
    spec = rule.apply(S(*shape, dtype=dtype))
    assert spec == expected
    usage = ns.compat.ShardingAnalyzer(mesh_of("2x4")).estimate_memory_usage(S(*shape, dtype=dtype), spec)
    if expected != P("fsdp", "dp") or limit >= 2**19:
        assert usage["size_per_device"] <= limit


def test_composite_rule_takes_first_nonempty():
    mesh = mesh_of("8")
    rule = ns.compat.CompositeShardingRule(
        ns.compat.ShapeBasedShardingRule({(None, 1024): P(None, "fsdp")}), ns.compat.AutoShardingRule(mesh)
    )
    out = rule.apply({"a": S(3, 1024), "b": S(16, 3), "c": S(3, 3)})
    assert out == {"a": P(None, "fsdp"), "b": P("fsdp", None), "c": P()}  # no rule shards c


def test_analyzer_validation_lists_every_issue():
    analyzer = ns.compat.ShardingAnalyzer(mesh_of("2x4"))
    tree = {
        "a": S(6, 8),
        "b": S(
            8,
        ),
        "c": S(4, 4),
        "d": S(4),
    }
    specs = {"a": P("fsdp", None), "b": P("model"), "c": P("dp", "dp"), "d": P(None, None)}
    issues = analyzer.validate_partition_specs(tree, specs)
    assert issues == [
        "a: dim 0 of size 6 is not divisible by 'fsdp' (4) in P('fsdp', None)",
        "b: axis 'model' is not in the mesh ('dp', 'fsdp')",
        "c: axis 'dp' is used twice in P('dp', 'dp')",
        "d: P(None, None) has more entries than dims (4,)",
    ]
    assert analyzer.validate_partition_specs({"a": S(8, 8)}, {"a": P(("dp", "fsdp"))}) == []


def test_memory_estimate_is_exact_against_real_arrays():
    mesh = mesh_of("2x4")
    tree = {
        "a": jnp.zeros((8, 12), jnp.float32),
        "b": jnp.zeros((6,), jnp.bfloat16),
        "c": jnp.zeros((4, 4), jnp.int8),
    }
    specs = {"a": P(("dp", "fsdp"), None), "b": P(None), "c": P("fsdp", "dp")}
    placed = jax.device_put(tree, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs))
    per_device = {}
    for x in jax.tree.leaves(placed):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    usage = ns.compat.ShardingAnalyzer(mesh).estimate_memory_usage(tree, specs)
    assert usage == {"total_size": 8 * 12 * 4 + 12 + 16, "size_per_device": max(per_device.values())}


def test_monitored_function_reports_and_warns():
    analyzer = ns.compat.ShardingAnalyzer(mesh_of("8"))
    fn = ns.compat.create_monitored_function(lambda p: p["w"].sum(), {"w": P("fsdp")}, analyzer)
    out, metrics = fn({"w": jnp.ones(16)})
    assert float(out) == 16.0
    assert metrics["validation_issues"] == [] and metrics["execution_time"] > 0
    assert metrics["memory_usage"] == {"total_size": 64, "size_per_device": 8}
    with pytest.warns(UserWarning, match="not divisible"):
        _, metrics = fn({"w": jnp.ones(12)})
    assert len(metrics["validation_issues"]) == 1


def test_partition_helper():
    mesh = ns.create_mesh((1, 4, 1, 2, 1))
    helper = ns.compat.MeshPartitionHelper(mesh)
    methods = helper.analyze_pytree(
        {
            "a": S(1024, 4096),
            "b": S(
                512,
            ),
        }
    )
    assert methods[(512,)] == [("dp",), ("tp",), ("fsdp",)]
    assert helper.create_partition_spec((1024, 4096), methods[(1024, 4096)]) == P("fsdp", "sp")
    assert helper.create_partition_spec((), []) == P()
    assert helper.create_partition_spec((3, 5), [("tp",)]) == P(None, None)
    placed = helper.auto_shard_pytree({"a": np.zeros((1024, 8), np.float32), "n": 3})
    assert placed["n"] == 3
    assert placed["a"].sharding.spec == P("fsdp", "sp")
    np.testing.assert_array_equal(np.asarray(placed["a"]), 0)
