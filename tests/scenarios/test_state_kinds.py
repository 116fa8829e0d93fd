"""Models with RNG streams and running statistics, and checkpoints whose content is verified, as users hit
them."""

from __future__ import annotations

import pathlib
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from tests.apps.trainer_app import (
    DropoutBN,
    DropoutTrainer,
    batch_for,
    config,
    digest,
    run_with_checkpoint_at_6,
)
from tests.helpers import no_host_transfers
from tests.trainer.test_trainer import resume_in_subprocess


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory):
    """A dropout + batch-norm model trained on 8 devices: 12 steps, a checkpoint at 6."""
    workdir = tmp_path_factory.mktemp("dropout")
    trainer = DropoutTrainer({**config(str(workdir)), "async_save": False})
    return run_with_checkpoint_at_6(trainer, str(workdir))


def test_the_ema_tracks_parameters_only(dropout_run):
    states = dropout_run["trainer"].states
    kinds = {
        type(v).__name__
        for v in jax.tree.leaves(states["ema"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    }
    assert kinds == {"Param"}
    model_kinds = {
        type(v).__name__
        for v in jax.tree.leaves(states["model"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    }
    assert {"RngKey", "RngCount", "BatchStat", "Param"} <= model_kinds


def test_dropout_batchnorm_model_resumes_on_4_devices_bitwise(dropout_run):
    out = resume_in_subprocess(dropout_run["workdir"], 4, model="dropout")
    assert out["report"] == "restored step 6, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)"
    assert out["digest"] == dropout_run["digest"]  # keys, counts, statistics, optimizer and EMA
    np.testing.assert_allclose(out["losses"], dropout_run["losses"], rtol=2e-5, atol=1e-6)


def test_typed_keys_are_saved_and_restored_as_keys(dropout_run):
    trainer = DropoutTrainer(config(dropout_run["workdir"]))
    trainer.restore_and_reshard(6)
    key = trainer.states["model"]["drop"]["rngs"]["key"].get_value()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    assert trainer.checkpointer.metadata(6)["prng_keys"] == {"model/drop/rngs/key": "threefry2x32"}


def test_a_batch_of_typed_keys_reshards_from_8_to_4_devices():
    keys = jax.random.split(jax.random.key(0), 64)
    devs = jax.devices()
    src = jax.device_put(keys, NamedSharding(Mesh(np.array(devs), ("x",)), P("x")))
    dst = NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x"))
    plan = ns.resharding.plan_reshard(src, dst)
    # Device j needs keys [16j, 16j+16) and holds [8j, 8j+8): 8 + 16 + 16 + 16 keys of 8 bytes lack.
    assert plan.bytes_moved == plan.ideal_bytes == 56 * 8
    with no_host_transfers():
        out = ns.reshard(src, dst)
    assert out.sharding == dst and out.dtype == keys.dtype
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(out)), np.asarray(jax.random.key_data(keys)))


def flip_bytes(path):
    """Flips 16 bytes in the middle of a file."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["largest", "each"])
def test_flipped_bytes_are_found_and_nothing_live_changes(dropout_run, tmp_path, which):
    state = pathlib.Path(dropout_run["workdir"]) / "checkpoints" / "12" / "state"
    data = sorted(f.relative_to(state) for f in state.rglob("*") if f.is_file() and f.parent.name == "d")
    targets = [max(data, key=lambda f: (state / f).stat().st_size)] if which == "largest" else data
    for i, name in enumerate(targets):
        workdir = tmp_path / f"copy{i}"
        shutil.copytree(dropout_run["workdir"], workdir)
        flip_bytes(workdir / "checkpoints" / "12" / "state" / name)
        trainer = DropoutTrainer(config(str(workdir)))
        trainer.init()
        before = digest(trainer)
        with pytest.raises(
            ns.CheckpointCorruptError,
            match=r"step 12 .* could not be read \(.* differs? from .* Other steps: \[6\]",
        ) as e:
            trainer.restore_and_reshard(12)
        assert str(name) in str(e.value) or "arrays differs" in str(e.value)
        assert digest(trainer) == before and trainer.step == 0
        assert "restored step 6" in str(trainer.restore_and_reshard(6))  # the other step still restores


def test_content_fingerprints_name_the_arrays_that_differ(tmp_path):
    """Bytes flipped inside a data file too big for the file manifest. Orbax stores it zstd-compressed, in a
    layout that varies from save to save: a flip may break the stream (Orbax's read fails) or decode to other
    values (the fingerprints differ). Every flip is a named CheckpointCorruptError, or lands in bytes no read
    uses and the values restored are exactly the saved ones; among a few positions at
    least one reaches the content check, which names the array whose content differs."""
    mesh = ns.create_mesh((8,), ("fsdp",))
    strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]

    def create():
        model = nnx.Linear(
            512, 1024, rngs=nnx.Rngs(0)
        )  # 2 MiB: its data file is too big for the file manifest
        return {"model": model, "ema": nnx.EMA(model, decay=0.9, only=nnx.Param)}

    hooks = ns.ShardingHooks(strategy, mesh)
    hooks.on_init(create)
    with ns.Checkpointer(tmp_path, async_save=False) as ckpt:
        hooks.save(ckpt, 1)
        hooks.save(ckpt, 2)
    saved = {k: jax.tree.map(np.asarray, v) for k, v in hooks.states().items()}
    state = tmp_path / "2" / "state"
    biggest = max((f for f in state.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    assert biggest.stat().st_size > 2**20
    original = biggest.read_bytes()
    content_found = []
    for fraction in (0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6):
        data = bytearray(original)
        at = int(len(data) * fraction)
        data[at : at + 16] = bytes(b ^ 0xFF for b in data[at : at + 16])
        biggest.write_bytes(bytes(data))
        fresh = create()
        before = np.asarray(fresh["model"].kernel.get_value())
        try:
            ns.restore_and_reshard(str(tmp_path), fresh, strategy, mesh, step=2)
        except ns.CheckpointCorruptError as error:
            assert re.search(r"\['(model/kernel|ema/params/kernel)'\]", str(error)), error
            e = error
        # the flip hit bytes no read uses (the layout varies): then the values are exactly the saved ones
        else:
            for key in saved:
                for got, want in zip(
                    jax.tree.leaves(nnx.state(fresh[key])), jax.tree.leaves(saved[key]), strict=True
                ):
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            continue
        np.testing.assert_array_equal(np.asarray(fresh["model"].kernel.get_value()), before)  # nothing live
        if re.search(
            r"the content of 1 arrays differs from what was saved: \['(model|ema/params)/kernel'\]",
            str(e),
        ):
            content_found.append(fraction)
            break
    assert content_found, "no flip reached the content check"
    assert "restored step 1" in str(ns.restore_and_reshard(str(tmp_path), fresh, strategy, mesh, step=1))


@pytest.mark.parametrize("manifest", [True, False], ids=["with-file-manifest", "without"])
def test_a_deleted_metadata_file_is_corruption_not_a_mismatch(dropout_run, tmp_path, manifest):
    workdir = tmp_path / "copy"
    shutil.copytree(dropout_run["workdir"], workdir)
    step = workdir / "checkpoints" / "12"
    (step / "state" / "_METADATA").unlink()
    if not manifest:  # as after a save whose process died before recording its files
        (step / "nnx_shard_files.json").unlink()
    trainer = DropoutTrainer(config(str(workdir)))
    with pytest.raises(ns.CheckpointCorruptError, match=r"step 12 .* could not be read.*_METADATA") as e:
        trainer.restore_and_reshard(12)
    assert "Build the model" not in str(e.value)  # not the advice for a mismatch
    assert "restored step 6" in str(trainer.restore_and_reshard(6))


def test_a_model_only_restore_from_a_trainer_checkpoint(dropout_run):
    mesh = ns.create_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
    strategy = [(".*", "replicate")]
    saved = dropout_run["trainer"]
    ckpt = ns.Checkpointer(dropout_run["workdir"] + "/checkpoints")
    model = DropoutBN(nnx.Rngs(42))
    report = ns.restore_and_reshard(ckpt, {"model": model}, strategy, mesh, step=12)
    assert (
        str(report) == "restored step 12 (model only), saved on 8 devices (fsdp=8), onto 2 devices (fsdp=2)"
    )
    np.testing.assert_array_equal(
        np.asarray(model.l1.kernel.get_value()), np.asarray(saved.states["model"]["l1"]["kernel"].get_value())
    )
    ema_model = DropoutBN(nnx.Rngs(43))
    ns.restore_and_reshard(ckpt, {"model": ema_model}, strategy, mesh, step=12, ema_as_model=True)
    np.testing.assert_array_equal(
        np.asarray(ema_model.l1.kernel.get_value()),
        np.asarray(saved.states["ema"]["params"]["l1"]["kernel"].get_value()),
    )
    np.testing.assert_array_equal(  # statistics come from the model
        np.asarray(ema_model.bn.mean.get_value()), np.asarray(saved.states["model"]["bn"]["mean"].get_value())
    )
    wider = DropoutBN(nnx.Rngs(0), width=32)  # within an item the structure must still match exactly
    with pytest.raises(
        ns.CheckpointMismatchError, match=r"model/l1/kernel: saved \(8, 64\), expected \(8, 32\)"
    ):
        ns.restore_and_reshard(ckpt, {"model": wider}, strategy, mesh, step=12)


def test_trainer_restores_named_items_and_keeps_the_others(dropout_run):
    trainer = DropoutTrainer({**config(dropout_run["workdir"]), "save_at_end": False})
    trainer.init()
    optimizer_before = digest_of(trainer.states["optimizer"])
    report = trainer.restore_and_reshard(12, only=("model", "ema"))
    assert str(report).startswith("restored step 12 (ema, model only)")
    assert digest_of(trainer.states["optimizer"]) == optimizer_before  # a new optimizer for fine-tuning
    np.testing.assert_array_equal(
        np.asarray(trainer.states["model"]["l1"]["kernel"].get_value()),
        np.asarray(dropout_run["trainer"].states["model"]["l1"]["kernel"].get_value()),
    )
    trainer.train(batch_for, steps=1)  # and it trains on


def digest_of(state):
    return [
        np.asarray(x).tobytes()
        for x in jax.tree.leaves(state)
        if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
