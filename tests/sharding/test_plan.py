"""ShardingPlan: totals, the table, JSON, lookups, and the byte formatter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import nnx_shard as ns
from tests.helpers import mesh_of

F = "fsdp(axis='fsdp', min_size_to_shard_mb=0)"


def test_plan_totals_and_table():
    mesh = mesh_of("8")
    state = {
        "big": jax.ShapeDtypeStruct((64, 128), jnp.float32),
        "small": jax.ShapeDtypeStruct((7,), jnp.bfloat16),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    plan = ns.plan_sharding(state, [("big", F), (".*", "replicate")], mesh)
    assert plan.sharded_bytes_per_device == 64 * 128 * 4 // 8
    assert plan.replicated_bytes_per_device == 7 * 2 + 4
    assert plan.bytes_per_device == 4096 + 18
    assert plan.total_bytes == 64 * 128 * 4 + 18
    text = str(plan)
    assert "big" in text and "(None, fsdp)" in text and "4.0 KiB" in text
    assert "rule 0: ('big'," in text
    d = plan.to_dict()
    assert d["leaves"][0]["spec"] == [None, "fsdp"]


def test_leaf_lookup_names_the_path_shape():
    plan = ns.plan_sharding(
        {"enc": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}}, [(".*", F)], mesh_of("8")
    )
    assert plan.leaf("enc/w").sharded
    with pytest.raises(KeyError, match="no leaf 'w' in the plan; paths look like 'enc/w'"):
        plan.leaf("w")


def test_summary_counts_rules_and_skipped_leaves():
    mesh = mesh_of("8")
    state = {
        "w": jax.ShapeDtypeStruct((64, 8), jnp.float32),
        "masked": None,
        "b": jax.ShapeDtypeStruct((3,), jnp.float32),
    }
    plan = ns.plan_sharding(state, [("w", F), (".*", "replicate")], mesh)
    summary = plan.summary()
    assert "2 leaves: 1 sharded, 1 replicated, 0 without a shape" in summary
    assert "rule 0: ('w', " in summary and "placed 1 leaves" in summary
    rows = plan.table(max_rows=1).splitlines()
    assert rows[0].split()[:4] == ["path", "shape", "dtype", "spec"] and rows[-1].startswith("...")


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"), (5 * 2**30, "5.00 GiB")],
)
def test_format_bytes(n, text):
    assert ns.format_bytes(n) == text
