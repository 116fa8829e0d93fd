"""RestoreOptions: one options object for every restore, one spelling of no limit."""

from __future__ import annotations

import pytest

import nnx_shard as ns
from tests.apps.trainer_app import RegressionTrainer, batch_for, config


def test_one_restore_options_object_and_one_spelling_of_no_limit(tmp_path, monkeypatch):
    assert ns.RestoreOptions(max_host_bytes=0) == ns.RestoreOptions(max_host_bytes=None)
    with pytest.raises(ns.CheckpointError, match="max_host_bytes is a whole number of bytes >= 0"):
        ns.RestoreOptions(max_host_bytes=-1)
    trainer = RegressionTrainer({**config(str(tmp_path / "run"), total_steps=2), "max_host_bytes": 0})
    trainer.train(batch_for)
    seen = []
    from nnx_shard._live import _hooks

    original = _hooks.restore_onto

    def spy(checkpointer, states, shardings, mesh, *, step, options):
        seen.append(options)
        return original(checkpointer, states, shardings, mesh, step=step, options=options)

    monkeypatch.setattr(_hooks, "restore_onto", spy)
    trainer.restore_and_reshard(only=["model"], max_host_bytes=64 * 2**20)
    trainer.restore_and_reshard()
    assert seen[0].only == ("model",) and seen[0].max_host_bytes == 64 * 2**20
    assert seen[1].only is None and seen[1].max_host_bytes is None  # config 0: no limit, spelled None
