"""Coordination between processes has one owner (``_cluster._coordination``), and blocks one type."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from nnx_shard._base import Block, block_of_shard, intersect, relative
from nnx_shard._cluster import all_to_all, gather_json

PACKAGE = Path(__file__).resolve().parents[2] / "nnx_shard"
KEY_VALUE = {"key_value_set", "key_value_dir_get", "blocking_key_value_get", "wait_at_barrier"}


def test_one_process_gathers_its_own_value_and_sends_to_itself():
    assert gather_json({"step": 3}) == [{"step": 3}]
    assert [bytes(b) for b in all_to_all([b"mine"])] == [b"mine"]


def test_every_process_hears_the_others_through_the_store_and_the_collectives(multiprocess):
    results, _ = multiprocess("tests.apps.coordination_workers:exchange", 3, devices=1)
    for me, r in enumerate(results):
        assert r.returncode == 0, r.message + r.log[-2000:]
        v = r.value
        assert v["gathered"] == [{"process": p, "square": p * p} for p in range(3)]
        assert v["received"] == [f"{p}->{me}" for p in range(3)]  # each process's chunk for this one
        assert v["other"] == f"section of {(me + 1) % 3}"
        assert v["directory"] == [f"section of {p}" for p in range(3)]


def test_only_the_coordination_module_talks_to_the_coordination_service():
    """Barriers, the watchdog, the standby relay: every key-value call is ``_cluster/_coordination.py``'s."""
    allowed = {"_cluster/_coordination.py", "_base/_jax_private.py", "_base/__init__.py"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in KEY_VALUE:
                found.append(f"{name}: {node.attr}")
            if isinstance(node, ast.ImportFrom) and any(a.name == "distributed_client" for a in node.names):
                found.append(f"{name} imports distributed_client")
    assert not found, found


def test_one_block_type_for_reshard_snapshots_and_weights():
    """No module spells its own ``tuple[tuple[int, int], ...]``: blocks are ``_base``'s."""
    spelled = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "tuple[tuple[int, int], ...]" in p.read_text() and p.name != "_blocks.py"
    ]
    assert spelled == []
    from nnx_shard._reshard import _executor
    from nnx_shard._snapshots import _reader as _snapshot_read
    from nnx_shard._weights import _load

    assert _snapshot_read.Block is _executor.Block is _load.Block is Block
    x = np.arange(24).reshape(4, 6)
    block = block_of_shard((slice(2, None), slice(0, 3)), x.shape)
    assert block == ((2, 4), (0, 3))
    common = intersect(block, ((1, 3), (1, 6)))
    assert common == ((2, 3), (1, 3))
    np.testing.assert_array_equal(x[2:4, 0:3][relative(common, block)], x[2:3, 1:3])
