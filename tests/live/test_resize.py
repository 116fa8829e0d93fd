"""Resizing a live job in-process: the hooks' on_mesh_change and Trainer.resize, in one and in several
processes."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from tests.apps.trainer_app import DropoutBN, RegressionTrainer, batch_for, config, digest
from tests.helpers import no_host_transfers

STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def host_copy(states):
    def one(x):
        return np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )

    return [one(x) for x in jax.tree.leaves(states)]


def test_on_mesh_change_moves_the_live_objects_bitwise_without_the_host():
    mesh8 = ns.create_mesh((8,), ("fsdp",))
    hooks = ns.ShardingHooks(STRATEGY, mesh8)

    def create():
        model = DropoutBN(nnx.Rngs(0), width=256)
        return {
            "model": model,
            "optimizer": nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
            "ema": nnx.EMA(model, decay=0.9, only=nnx.Param),
        }

    objects = hooks.on_init(create)
    before = host_copy(hooks.states())
    old_kernel = objects["model"].l1.kernel.get_value()
    mesh4 = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[4:])
    with no_host_transfers():
        report = hooks.on_mesh_change(mesh4)
    assert str(report).startswith("moved from 8 devices (fsdp=8) to 4 devices (fsdp=4): ")
    assert report.bytes_moved == report.ideal_bytes > 0 and not report.through_host
    assert old_kernel.is_deleted()  # donated: the old layout's buffers are freed
    kernel = objects["model"].l1.kernel.get_value()  # the objects the user holds are the live ones
    assert kernel.sharding.spec == P(None, "fsdp") and {d.id for d in kernel.devices()} == {4, 5, 6, 7}
    assert hooks.mesh is mesh4 and hooks.plan.mesh is mesh4
    key = objects["model"].drop.rngs.key.get_value()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.sharding.mesh is mesh4
    for a, b in zip(before, host_copy(hooks.states()), strict=True):
        np.testing.assert_array_equal(a, b)  # keys, counts, statistics, optimizer, EMA
    for x, s in zip(jax.tree.leaves(hooks.states()), jax.tree.leaves(hooks.shardings), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)


@pytest.fixture(scope="module")
def uninterrupted():
    trainer = RegressionTrainer(config("", total_steps=9))
    return [h["loss"] for h in trainer.train(batch_for)]


def test_trainer_resized_8_to_4_to_8_keeps_the_loss_curve(uninterrupted, tmp_path):
    expected = uninterrupted
    trainer = RegressionTrainer(config(str(tmp_path), total_steps=9, async_save=False))
    losses = [h["loss"] for h in trainer.train(batch_for, steps=3)]
    shrink = trainer.resize("fsdp:-1", devices=jax.devices()[4:])
    assert str(shrink).startswith("moved from 8 devices (fsdp=8) to 4 devices (fsdp=4)")
    losses += [h["loss"] for h in trainer.train(batch_for, steps=3)]
    grow = trainer.resize(ns.create_mesh((2, 4), ("dp", "fsdp")))  # another shape: dp:2 x fsdp:4
    assert str(grow).startswith("moved from 4 devices (fsdp=4) to 8 devices (dp=2, fsdp=4)")
    losses += [h["loss"] for h in trainer.train(batch_for)]
    np.testing.assert_allclose(losses, expected, rtol=2e-5, atol=1e-6)
    events = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events if "event" in e]
    assert kinds.count("resize") == 2 and kinds.count("compile") == 3  # one recompile after each resize
    # A checkpoint saved after a resize restores anywhere, bitwise.
    again = RegressionTrainer(
        config(str(tmp_path), mesh=ns.create_mesh((2,), ("fsdp",), devices=jax.devices()[:2]))
    )
    assert str(again.restore_and_reshard()) == (
        "restored step 9, saved on 8 devices (dp=2, fsdp=4), onto 2 devices (fsdp=2)"
    )
    assert digest(again) == digest(trainer)


@pytest.mark.multihost
def test_resize_across_two_processes(multiprocess):
    results, _ = multiprocess("tests.apps.trainer_app:resize_worker", 2, devices=4, deadline_s=240)
    for r in results:
        v = r.ok()
        np.testing.assert_allclose(v["got"], v["expected"], rtol=2e-5, atol=1e-6)
        assert v["there"].startswith("moved from 8 devices (fsdp=8) to 4 devices (fsdp=4)")
        assert v["back"].startswith("moved from 4 devices (fsdp=4) to 8 devices (fsdp=8)")
        assert v["half_mesh"] == {"fsdp": 4} and v["bitwise"] == [True, True]


def two_processes(multiprocess, worker: str, **args) -> list[dict]:
    """What ``tests.apps.standby_app:<worker>`` returned in each of 2 processes x 2 devices."""
    results, _ = multiprocess(f"tests.apps.standby_app:{worker}", 2, devices=2, args=args, deadline_s=300)
    return [r.ok() for r in results]


@pytest.mark.multihost
def test_a_trainer_resized_off_a_host_and_back_sees_every_example_once(multiprocess, tmp_path):
    # 2 processes x 2 devices, grain's ElasticIterator, 8 examples a step: 3 steps on both processes, 3 on
    # process 0's devices alone (process 1 on standby joins the save of step 5), 3 on both again. Each step
    # feeds the examples of a run left alone, and the losses match; step 5's checkpoint resumes exactly.
    # Snapshots every 2 steps pause in between.
    first, second = two_processes(multiprocess, "elastic_off_a_host_and_back", workdir=str(tmp_path / "ckpt"))
    alone = {s: sorted(first["alone_seen"][s] + second["alone_seen"][s]) for s in first["alone_seen"]}
    assert alone == {str(s): list(range(8 * (s - 1), 8 * s)) for s in range(1, 10)}
    for step in map(str, range(1, 10)):
        fed = sorted(first["seen"].get(step, []) + second["seen"].get(step, []))
        assert fed == alone[step], step
    assert all(str(s) not in second["seen"] for s in range(4, 7))  # process 1 read nothing on standby
    assert [len(first["seen"][str(s)]) for s in (3, 4, 7)] == [4, 8, 4]
    np.testing.assert_allclose(first["got"], first["expected"], rtol=2e-5, atol=1e-6)
    assert first["shards"] == [[0, 2], [0, 1], [0, 2]] and second["shards"] == [[1, 2], None, [1, 2]]
    assert second["after_standby"] == [6, "finished", 0] and first["after_standby"] == [6, "finished", 3]
    assert first["there"].startswith("moved from 4 devices (fsdp=4) to 2 devices (fsdp=2)")
    assert first["steps"] == [5] and first["restored"].startswith("restored step 5")
    assert first["snapshots"] == [2, 8]  # paused while process 1 held no device (4, 6), back after
    for r in (first, second):  # resumed from step 5 with the data position process 1 saved too
        np.testing.assert_allclose(r["resumed"], first["expected"][5:], rtol=2e-5, atol=1e-6)
    for step in map(str, range(6, 10)):
        assert sorted(first["resumed_seen"][step] + second["resumed_seen"][step]) == alone[step]


@pytest.mark.multihost
def test_a_preemption_while_a_process_is_on_standby_saves_and_stops_both(multiprocess, tmp_path):
    first, second = two_processes(multiprocess, "preempted_on_standby", workdir=str(tmp_path / "ckpt"))
    assert first["reason"] == second["reason"] == "preempted"
    assert first["step"] == second["step"] > 2
    assert first["steps"] == [2, first["step"]]  # the save at the end of the first call, and the preemption's


@pytest.mark.multihost
def test_a_trainer_resized_off_process_0_logs_from_the_process_that_trains(multiprocess, tmp_path):
    # process 0, which hosts JAX's coordination service, on standby for steps 3-4 (a save at step 3): the
    # losses are a run left alone's, and metrics.jsonl has every step's record and every event once, the
    # off steps' written by process 1 (before, they were missing: only process 0 wrote)
    first, second = two_processes(multiprocess, "off_process_0_and_back", workdir=str(tmp_path / "ckpt"))
    np.testing.assert_allclose(second["got"], second["expected"], rtol=2e-5, atol=1e-6)
    assert first["got"][2:4] == [None, None]  # process 0 trained nothing on standby
    assert first["steps"] == second["steps"] == [3, 6]
    assert first["records"] == [1, 2, 3, 4, 5, 6]
    events = [tuple(e) for e in first["events"]]
    assert [s for e, s in events if e == "save"] == [3, 6]  # once each, though both processes wrote them
    assert [s for e, s in events if e == "resize"] == [2, 4]
    assert [s for e, s in events if e == "train"] == [2, 4, 6]  # the call on process 1's devices included


@pytest.mark.multihost
def test_step_callables_follow_the_data_shard_across_a_resize_off_a_host(multiprocess):
    first, second = two_processes(multiprocess, "callables_off_a_host")
    np.testing.assert_allclose(first["got"], first["expected"], rtol=2e-5, atol=1e-6)
    assert (
        "8 rows after the resize and had 16 before" in first["refused"]
        and "trainer.data_shard" in first["refused"]
    )
    assert "BatchStructureError" in second["standby"] and "on standby" in second["standby"]
    assert first["standby"] is None and second["refused"] is None
    assert "process 1" in second["on_standby"] and "holds no device" in second["on_standby"]
    assert first["step"] == second["step"] == 4 and second["stop_reason"] == "finished"
    assert first["shard"] == [0, 1] and second["shard"] is None


def test_hooks_move_the_state_onto_one_process_and_back(multiprocess, tmp_path):
    # 2 processes x 2 devices: fsdp=4 -> process 0's 2 devices -> fsdp=4 again. The engine sends each
    # piece once, nothing through the host; process 1 holds nothing in between. Orbax cannot read onto
    # such a mesh: the restore is refused first, by name, with nothing changed.
    results, _ = multiprocess(
        "tests.apps.mh_workers:hooks_across_hosts",
        2,
        devices=2,
        args={"workdir": str(tmp_path / "ckpt")},
        deadline_s=240,
    )
    for r in results:
        v = r.ok()
        assert "leaves process 1 of 2 without a device" in v["restore_refused"]
        assert "on_mesh_change" in v["restore_refused"] and v["untouched"]
        assert v["there"].startswith("moved from 4 devices (fsdp=4) to 2 devices (fsdp=2)")
        assert v["back"].startswith("moved from 2 devices (fsdp=2) to 4 devices (fsdp=4)")
        assert v["kernel_spec"] == "P(None, 'fsdp')"
        assert v["bitwise_back"] and v["mesh_after"] == {"fsdp": 4}
    first, second = (r.ok() for r in results)
    assert first["equal_there"] is True and first["shards_here"] > 0
    assert second["equal_there"] is None and second["shards_here"] == 0
    rows = np.arange(24, dtype=np.float32).reshape(6, 4).tolist()
    assert first["placed_here"] == [rows[:3], rows[3:]] and second["placed_here"] == []
