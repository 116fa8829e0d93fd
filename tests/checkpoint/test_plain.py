"""Checkpoints written by plain Orbax (``_checkpoint/_plain``, the ``OrbaxSource``): every layout read
into the target shardings, items by name, damaged data named."""

from __future__ import annotations

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from tests.apps.trainer_app import MLP

FSDP = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
EXPLICIT = (AxisType.Explicit,)


def create():
    model = MLP(nnx.Rngs(0), width=32)
    return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)}


def explicit(n: int = 8, devices=None):
    return jax.make_mesh((n,), ("fsdp",), axis_types=EXPLICIT, devices=devices or jax.devices()[:n])


def reference():
    with nnx.use_eager_sharding(False):
        return create()


def values(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def write(kind: str, root, objects):
    model, opt = nnx.state(objects["model"]), nnx.state(objects["optimizer"])
    path = str(root / kind)
    if kind in ("standard", "pytree", "composite"):
        with ocp.CheckpointManager(path) as manager:
            if kind == "standard":
                args = ocp.args.StandardSave(model)
            elif kind == "pytree":
                args = ocp.args.PyTreeSave(nnx.to_pure_dict(model))
            else:
                args = ocp.args.Composite(
                    model=ocp.args.StandardSave(model), optimizer=ocp.args.StandardSave(opt)
                )
            manager.save(7, args=args)
            manager.wait_until_finished()
    elif kind == "v1":
        ocp.v1.save(path, {"model": model, "optimizer": opt})
    else:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, model)
        checkpointer.wait_until_finished()
    return path


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kind", ["standard", "pytree", "composite", "v1", "checkpointer"])
def test_restore_and_reshard_reads_plain_orbax_checkpoints_into_the_target_shardings(tmp_path, kind):
    saved = reference()
    path = write(kind, tmp_path, saved)
    mesh = explicit(4)
    fresh = MLP(nnx.Rngs(1), width=32)
    report = ns.restore_and_reshard(path, {"model": fresh}, FSDP, mesh)
    for got, want in zip(values(nnx.state(fresh)), values(nnx.state(saved["model"])), strict=True):
        np.testing.assert_array_equal(got, want)
    assert fresh.l2.kernel.get_value().sharding == NamedSharding(mesh, P(None, "fsdp"))
    assert "plain Orbax" in str(report) and "no fingerprints" in str(report)
    assert report.step == (7 if kind in ("standard", "pytree", "composite") else None)
    if kind in ("composite", "v1"):  # model and optimizer together, on a mesh of another size
        objects = {"model": MLP(nnx.Rngs(2), width=32)}
        objects["optimizer"] = nnx.Optimizer(objects["model"], optax.adam(1e-2), wrt=nnx.Param)
        ns.restore_and_reshard(path, objects, FSDP, explicit(2))
        got = {k: values(nnx.state(v)) for k, v in objects.items()}
        want = {k: values(nnx.state(v)) for k, v in saved.items()}
        assert all(np.array_equal(a, b) for k in got for a, b in zip(got[k], want[k], strict=True))


def test_plain_orbax_item_by_name_and_what_fits_nothing(tmp_path):
    saved = reference()
    path = write("composite", tmp_path, saved)
    mesh = ns.create_mesh((8,), ("fsdp",))
    model = MLP(nnx.Rngs(1), width=32)
    ns.restore_and_reshard(path, {"model": model}, FSDP, mesh, orbax_item="model")
    np.testing.assert_array_equal(
        np.asarray(model.l1.kernel.get_value()), np.asarray(saved["model"].l1.kernel.get_value())
    )
    live = np.asarray(model.l1.kernel.get_value())
    with pytest.raises(ns.CheckpointMismatchError, match=r"item 'optimizer'.*not in the checkpoint"):
        ns.restore_and_reshard(path, {"model": model}, FSDP, mesh, orbax_item="optimizer")
    with pytest.raises(ns.CheckpointFormatError, match=r"no item 'params'.*\['model', 'optimizer'\].*item="):
        ns.restore_and_reshard(path, {"model": model}, FSDP, mesh, orbax_item="params")
    with pytest.raises(ns.CheckpointFormatError, match=r"no item of .* fits 'model'.*want"):
        ns.restore_and_reshard(path, {"model": MLP(nnx.Rngs(1), width=16)}, FSDP, mesh)
    one = write("standard", tmp_path, saved)
    objects = {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)}
    with pytest.raises(
        ns.CheckpointMismatchError, match=r"holds \['model'\]: restore \{'model': \.\.\.\} only"
    ):
        ns.restore_and_reshard(one, objects, FSDP, mesh)
    np.testing.assert_array_equal(np.asarray(model.l1.kernel.get_value()), live)  # nothing live changed
    with pytest.raises(ns.NoCheckpointError, match=r"step 3.*steps there are \[7\]"):
        ns.restore_and_reshard(one, {"model": model}, FSDP, mesh, step=3)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ns.NoCheckpointError, match=r"no checkpoint in .*junk"):
        ns.restore_and_reshard(str(junk), {"model": model}, FSDP, mesh)
    (junk / "7" / "default").mkdir(parents=True)  # steps whose folders hold no Orbax item
    (tmp_path / "standard" / "7").rename(junk / "8")
    (junk / "8" / "default" / "_METADATA").rename(junk / "8" / "default" / "metadata.bak")
    with pytest.raises(ns.CheckpointFormatError, match=r"found \['default'\].*Orbax PyTree item"):
        ns.restore_and_reshard(str(junk), {"model": model}, FSDP, mesh, step=7)
    with pytest.raises(ns.NoCheckpointError, match="does not exist"):
        ns.restore_and_reshard(str(tmp_path / "none"), {"model": model}, FSDP, mesh, orbax_item="model")
    with ns.Checkpointer(tmp_path / "ours", async_save=False) as ours:
        ours.save(1, {"model": nnx.state(model)}, mesh=mesh)
    with pytest.raises(ns.CheckpointFormatError, match="orbax_item='model' names an item of a plain Orbax"):
        ns.restore_and_reshard(str(tmp_path / "ours"), {"model": model}, FSDP, mesh, orbax_item="model")


def test_plain_orbax_checkpoint_with_damaged_data_is_named_corrupt(tmp_path):
    path = write("standard", tmp_path, reference())
    for f in (tmp_path / "standard" / "7" / "default" / "d").iterdir():
        f.write_bytes(b"\0" * 16)
    with pytest.raises(ns.CheckpointCorruptError, match="default could not be read"):
        ns.restore_and_reshard(
            path, {"model": MLP(nnx.Rngs(1), width=32)}, FSDP, ns.create_mesh((8,), ("fsdp",))
        )
