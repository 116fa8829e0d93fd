"""Restoring from snapshots: the newest step every old process is covered for, onto whatever mesh is left."""

from __future__ import annotations

import hashlib

import jax
import numpy as np

import nnx_shard as ns
from nnx_shard._snapshots import SnapshotWriter
from nnx_shard._snapshots._reader import choose
from tests.apps.snapshot_workers import _states


def test_the_newest_step_covering_every_old_process_is_chosen_own_copies_first():
    assert choose([[[5, 0, 1], [5, 1, 0]], [[4, 1, 1]]], previous=2, after=3) == (5, {0: 0, 1: 0})
    assert choose([[[5, 0, 0], [5, 1, 0]], [[5, 1, 1], [5, 0, 1]]], previous=2, after=3) == (5, {0: 1, 1: 1})
    assert choose([[[5, 0, 1]], [[4, 1, 1]]], previous=2, after=3) == (None, {})
    assert choose([[[5, 0, 1], [5, 1, 0]]], previous=2, after=5) == (
        None,
        {},
    )  # not newer than the checkpoint


def test_a_snapshot_restores_onto_more_processes_than_it_had(tmp_path, multiprocess):

    states = _states(ns.create_mesh((8,), ("fsdp",)))  # one process of 8 devices writes it
    writer = SnapshotWriter(tmp_path / "snap", keep=2)
    writer.write(7, states)
    writer.wait()
    expected = {
        p: hashlib.sha256(np.asarray(x).tobytes()).hexdigest() for p, x in ns.sharding.flatten_state(states)
    }
    results, _ = multiprocess(
        "tests.apps.snapshot_workers:restore_onto_more", 2, devices=2, args={"folder": str(tmp_path / "snap")}
    )
    for r in results:
        assert r.returncode == 0, r.message + r.log[-2000:]
        assert r.value["step"] == 7 and r.value["digests"] == expected  # bitwise, whoever held it
        assert r.value["devices"]["model/layers/0/kernel"] == 4  # on the new run's 2 x 2 devices
    assert jax.process_count() == 1
