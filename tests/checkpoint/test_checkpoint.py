"""Checkpointer: metadata, retention, structure checks, and a directory that is only read is never written."""

from __future__ import annotations

import jax
import optax
import pytest
from flax import nnx

import nnx_shard as ns

STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def objects(width=16):
    model = nnx.Linear(8, width, rngs=nnx.Rngs(0))
    return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)}


def test_metadata_records_where_and_how_it_was_saved(tmp_path):
    mesh = ns.create_mesh((2, 4), ("dp", "fsdp"))
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        assert ckpt.save(5, objects(), mesh=mesh, strategy=STRATEGY, extra={"note": "x"})
        meta = ckpt.metadata(5)
    assert meta["devices"] == 8 and meta["processes"] == 1 and meta["mesh"] == "dp=2, fsdp=4"
    assert meta["mesh_axis_names"] == ["dp", "fsdp"] and meta["mesh_shape"] == [2, 4]
    assert meta["strategy"] == [list(r) for r in STRATEGY] and meta["note"] == "x"
    assert meta["nnx_shard_version"] == ns.__version__ and meta["step"] == 5


def test_best_n_keeps_the_best_and_the_latest(tmp_path):
    best = ns.Checkpointer(
        tmp_path / "best", max_to_keep=2, best_metric="loss", best_mode="min", async_save=False
    )
    state = objects()
    for step, loss in [(1, 0.5), (2, 0.1), (3, 0.9), (4, 0.2), (5, 0.7)]:
        best.save(step, state, metrics={"loss": loss})
    assert best.all_steps() == [2, 4, 5] and best.best_step() == 2  # the 2 best, and the latest to resume
    most = ns.Checkpointer(
        tmp_path / "max", max_to_keep=1, best_metric="acc", best_mode="max", async_save=False
    )
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.7)]:
        most.save(step, state, metrics={"acc": acc})
    assert most.all_steps() == [2, 3] and most.best_step() == 2
    with pytest.raises(ns.CheckpointError, match="best_mode must be 'min' or 'max'; got 'low'"):
        ns.Checkpointer(tmp_path / "bad", best_mode="low")


def test_opening_or_restoring_a_missing_directory_writes_nothing(tmp_path):
    missing = tmp_path / "no" / "such" / "run"
    ckpt = ns.Checkpointer(missing)
    assert ckpt.all_steps() == [] and ckpt.latest_step() is None
    with pytest.raises(
        ns.NoCheckpointError, match=r"no checkpoint in .*run \(the directory does not exist\)"
    ):
        ckpt.metadata(1)
    mesh = ns.create_mesh((8,), ("fsdp",))
    with pytest.raises(ns.NoCheckpointError, match="the directory does not exist"):
        ns.restore_and_reshard(str(missing), objects(), STRATEGY, mesh)
    assert not (tmp_path / "no").exists()


def test_context_manager_waits_for_the_background_save_and_closes(tmp_path):
    with ns.Checkpointer(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, objects())
    assert (tmp_path / "1").is_dir() and ns.Checkpointer(tmp_path).all_steps() == [1]
    with pytest.raises(ns.CheckpointError, match="is closed; open a new one"):
        ckpt.save(2, objects())


def test_a_structure_mismatch_names_paths_and_shapes(tmp_path):
    mesh = ns.create_mesh((8,), ("fsdp",))
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, objects(16), mesh=mesh)
        hooks = ns.ShardingHooks(STRATEGY, mesh)
        hooks.adopt(objects(32))
        with pytest.raises(ns.CheckpointMismatchError) as e:
            hooks.restore_and_reshard(ckpt)
    text = str(e.value)
    assert "model/kernel: saved (8, 16), expected (8, 32)" in text
    assert "Build the model, optimizer and EMA with the config they were saved with" in text
    assert jax.tree.leaves(hooks.states())[0].shape == (32,)  # untouched


class WithKeys(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)  # a typed PRNG key, stored as its key data


def test_the_recorded_structure_is_what_orbax_saved(tmp_path):
    import orbax.checkpoint as ocp

    model = WithKeys(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    state = {"model": model, "optimizer": optimizer, "ema": {}, "counts": {"n": 3}}  # an empty item, a scalar
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
        recorded = ckpt.metadata(1)["structure"]
    manager = ocp.CheckpointManager(tmp_path, item_handlers={"state": ocp.PyTreeCheckpointHandler()})
    tree = manager.metadata(1).item_metadata["state"]
    assert recorded["items"] == sorted(tree) == ["counts", "ema", "model", "optimizer"]
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]  # the leaves Orbax lists, and their shapes
    orbax_shapes = {
        "/".join(str(k.key) for k in path).removesuffix("/value"): list(getattr(leaf, "shape", ()))
        for path, leaf in flat
    }
    assert orbax_shapes == recorded["shapes"]
    assert recorded["shapes"]["model/dropout/rngs/key"] == [2] and recorded["shapes"]["counts/n"] == []


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "saved-before-it-was-recorded"])
def test_the_structure_check_reads_the_recorded_structure_not_every_arrays_metadata(
    tmp_path, monkeypatch, recorded
):
    import json

    import orbax.checkpoint as ocp

    mesh = ns.create_mesh((8,), ("fsdp",))
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, objects(16), mesh=mesh)
    if not recorded:  # as a checkpoint from an earlier version: Orbax's tree metadata is read instead
        meta_file = tmp_path / "1" / "meta" / "metadata"
        meta = json.loads(meta_file.read_text())
        del meta["structure"]
        meta_file.write_text(json.dumps(meta))
    opened = []
    real = ocp.CheckpointManager.metadata
    monkeypatch.setattr(ocp.CheckpointManager, "metadata", lambda *a, **k: opened.append(1) or real(*a, **k))
    ckpt = ns.Checkpointer(tmp_path, verify=recorded)  # an edited metadata file fails the file checksums
    hooks = ns.ShardingHooks(STRATEGY, mesh)
    hooks.adopt(objects(32))
    with pytest.raises(
        ns.CheckpointMismatchError, match=r"model/kernel: saved \(8, 16\), expected \(8, 32\)"
    ):
        hooks.restore_and_reshard(ckpt)
    hooks.adopt(objects(16))
    assert "restored step 1" in str(hooks.restore_and_reshard(ckpt))
    assert ckpt.items(1) == ["model", "optimizer"]
    assert bool(opened) is not recorded


def test_a_missing_tree_metadata_file_is_corruption_though_the_structure_was_recorded(tmp_path):
    mesh = ns.create_mesh((8,), ("fsdp",))
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, objects(16), mesh=mesh)
    (tmp_path / "1" / "state" / "_METADATA").unlink()
    hooks = ns.ShardingHooks(STRATEGY, mesh)
    hooks.adopt(objects(16))
    with pytest.raises(ns.CheckpointCorruptError, match=r"state/_METADATA is missing or empty"):
        hooks.restore_and_reshard(ns.Checkpointer(tmp_path, verify=False))


def test_a_trainers_workdir_restores_like_its_checkpoints_folder_and_a_parent_names_it(tmp_path):
    from tests.apps.trainer_app import STRATEGY, RegressionTrainer, batch_for, config

    work = tmp_path / "run"
    trainer = RegressionTrainer(config(str(work), total_steps=3))
    trainer.train(batch_for)
    assert ns.Checkpointer(work).all_steps() == ns.Checkpointer(work / "checkpoints").all_steps() == [3]
    objects = trainer.training_state
    mesh = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    report = ns.restore_and_reshard(str(work), objects, STRATEGY, mesh)  # as the checkpoints guide shows
    assert report.step == 3
    with pytest.raises(ns.NoCheckpointError, match=r"checkpoints are in \[.*run/checkpoints'\]: pass one"):
        ns.restore_and_reshard(str(tmp_path), objects, STRATEGY, mesh)
