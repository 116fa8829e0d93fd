"""The Trainer the way users hit it: save on 8 devices, resume on 4, 2, 1 and on 2 processes, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import nnx_shard as ns
from tests.apps.trainer_app import RegressionTrainer, batch_for, config, digest, run_with_checkpoint_at_6

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run on 8 devices: 12 steps, a synchronous checkpoint at step 6."""
    workdir = tmp_path_factory.mktemp("ref")
    return run_with_checkpoint_at_6(RegressionTrainer(config(str(workdir))), str(workdir))


def resume_in_subprocess(workdir, devices, model="mlp"):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [sys.executable, "tests/apps/trainer_app.py", workdir, str(devices), "6", model],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_reference_learns(reference):
    losses = reference["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    meta = reference["trainer"].checkpointer.metadata(6)
    assert meta["devices"] == 8 and meta["mesh"] == "fsdp=8" and meta["mesh_axis_names"] == ["fsdp"]
    assert meta["strategy"][1] == [".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)"]
    assert meta["nnx_shard_version"] == ns.__version__ and meta["processes"] == 1


@pytest.mark.parametrize("devices", [4, 2, 1])
def test_resume_on_fewer_devices(reference, devices):
    out = resume_in_subprocess(reference["workdir"], devices)
    onto = f"{devices} devices (fsdp={devices})" if devices > 1 else "1 device"
    assert out["report"] == f"restored step 6, saved on 8 devices (fsdp=8), onto {onto}"
    assert out["digest"] == reference["digest"]  # bitwise: model, optimizer, EMA
    assert out["kernel_mesh"] == {"fsdp": devices}  # never the old device subset
    np.testing.assert_allclose(out["losses"], reference["losses"], rtol=2e-5, atol=1e-6)


@pytest.mark.multihost
def test_resume_on_two_processes(reference, multiprocess):
    results, _ = multiprocess(
        "tests.apps.trainer_app:resume", 2, devices=2, args={"workdir": reference["workdir"], "step": 6}
    )
    first = results[0].ok()["pid"]
    for r in results:
        v = r.ok()
        saved = "saved on 8 devices (fsdp=8) in 1 process"
        assert v["report"] == f"restored step 6, {saved}, onto 4 devices (fsdp=4) in 2 processes"
        assert v["lock_holders"] == [first]  # process 0 holds the workdir lock for both
        assert v["digest"] == reference["digest"]
        np.testing.assert_allclose(v["losses"], reference["losses"], rtol=2e-5, atol=1e-6)
    assert not results[0].ok()["lock_left"]  # and gives it back when train() returns


def test_mismatched_model_raises_and_leaves_live_state(reference, tmp_path):
    trainer = RegressionTrainer({**config(reference["workdir"]), "width": 32})
    trainer.init()
    before = digest(trainer)
    with pytest.raises(ns.CheckpointMismatchError) as e:
        trainer.restore_and_reshard(6)
    text = str(e.value)
    assert "shapes differ in " in text and "ema/params/l1/kernel: saved (8, 64), expected (8, 32)" in text
    assert digest(trainer) == before and trainer.step == 0


def test_no_checkpoint_and_missing_step(tmp_path, reference):
    with pytest.raises(ns.NoCheckpointError, match="no checkpoint in"):
        RegressionTrainer(config(str(tmp_path / "empty"))).restore_and_reshard()
    with pytest.raises(
        ns.NoCheckpointError, match=r"no checkpoint for step 7 .* the steps there are \[6, 12\]"
    ):
        RegressionTrainer(config(reference["workdir"])).restore_and_reshard(7)


def test_corrupted_checkpoint_leaves_live_state_and_other_steps(reference, tmp_path):
    import shutil

    workdir = tmp_path / "copy"
    shutil.copytree(reference["workdir"], workdir)
    for f in (workdir / "checkpoints" / "12" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name and "manifest" not in f.name:
            f.write_bytes(b"\0" * 8)  # truncate the array data
    trainer = RegressionTrainer(config(str(workdir)))
    trainer.init()
    before = digest(trainer)
    with pytest.raises(
        ns.CheckpointCorruptError, match=r"step 12 .* could not be read .* Other steps: \[6\]"
    ):
        trainer.restore_and_reshard(12)
    assert digest(trainer) == before
    assert "restored step 6" in str(trainer.restore_and_reshard(6))


def test_restored_state_is_donatable_and_trains(reference, tmp_path):
    trainer = RegressionTrainer({**config(reference["workdir"]), "save_at_end": False})
    trainer.restore_and_reshard(6)
    kernel = trainer.states["model"]["l1"]["kernel"].get_value()
    trainer.train(batch_for, steps=1)
    assert kernel.is_deleted()  # the jitted step took the restored buffer without a copy


def test_keep_last_n(tmp_path):
    trainer = RegressionTrainer(
        {**config(str(tmp_path / "last")), "max_to_keep": 2, "save_every": 2, "async_save": False}
    )
    trainer.train(batch_for, steps=8)
    assert trainer.checkpointer.all_steps() == [6, 8]


def test_on_restore_from_numpy_and_from_another_mesh(reference):
    trainer = RegressionTrainer(config(reference["workdir"]))
    trainer.init()
    source = reference["trainer"]
    hooks = trainer.hooks
    host = {k: jax.tree.map(np.asarray, nnx_pure(v)) for k, v in source.training_state.items()}
    hooks.on_restore(host)
    leaves = dict(ns.sharding.flatten_state(hooks.training_state["model"]))
    assert dict(leaves["l1/kernel"].get_value().sharding.mesh.shape) == {"fsdp": 8}
    np.testing.assert_array_equal(np.asarray(leaves["l1/kernel"].get_value()), host["model"]["l1"]["kernel"])
    mesh4 = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    other = ns.ShardingHooks(reference["trainer"].hooks.strategy, mesh4)
    other.on_init(objects=RegressionTrainer(config(reference["workdir"], mesh="fsdp:8")).training_state)
    other.on_restore({k: v for k, v in source.states.items()})
    got = other.training_state["model"].l2.kernel.get_value()
    assert dict(got.sharding.mesh.shape) == {"fsdp": 4}
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(source.states["model"]["l2"]["kernel"].get_value())
    )


def nnx_pure(obj):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(obj))


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "import jax\n"
        "jax.config.update('jax_num_cpu_devices', 4)\n"
        "from tests.apps.trainer_app import RegressionTrainer, batch_for, config\n"
        f"t = RegressionTrainer(config({str(tmp_path / 'w')!r}, total_steps=100000))\n"
        "t.train(batch_for)\n"
        "print('stop reason', t.stop_reason, flush=True)\n"
        "print('exited at', t.step, flush=True)\n"
    )
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)
    p = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "w" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and p.poll() is None, (
            p.stderr.read() if p.poll() is not None else "no progress"
        )
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    step = int(out.split("exited at")[1])
    assert "stop reason preempted" in out
    ckpt = ns.Checkpointer(tmp_path / "w" / "checkpoints")
    assert ckpt.latest_step() == step and 3 <= step < 100000


def test_kill_during_async_save_keeps_the_previous_step(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "import jax\n"
        "jax.config.update('jax_num_cpu_devices', 4)\n"
        "from tests.apps.trainer_app import RegressionTrainer, batch_for, config\n"
        f"t = RegressionTrainer(config({str(tmp_path / 'w')!r}, width=1024))\n"
        "t.train(batch_for, steps=2)\n"  # ends with a save of step 2, waited for
        "t.step = 3\n"
        "t.save()\n"  # async: returns while the writes go on
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    ckpt = ns.Checkpointer(tmp_path / "w" / "checkpoints")
    assert ckpt.all_steps() == [2]
    trainer = RegressionTrainer(config(str(tmp_path / "w"), width=1024))
    assert str(trainer.restore_and_reshard()).startswith("restored step 2, saved on 4 devices")


def _tensorboard_losses(directory):
    """The (step, loss) scalars of the one TensorBoard event file under ``directory``."""
    from tensorboardX.proto.event_pb2 import Event

    (event_file,) = directory.glob("events.out.tfevents.*")  # one per Trainer, kept open across train() calls
    data, losses = event_file.read_bytes(), []
    while data:  # TFRecord framing: length (8 bytes), crc (4), record, crc (4)
        n = int.from_bytes(data[:8], "little")
        event = Event.FromString(data[12 : 12 + n])
        data = data[16 + n :]
        losses += [(event.step, v.simple_value) for v in event.summary.value if v.tag == "loss"]
    return losses


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX", reason="install the test extras: pip install -e '.[test]'")

    trainer = RegressionTrainer({**config(str(tmp_path)), "async_save": False})
    trainer.train(batch_for, steps=3)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in records if "event" not in r]  # steps; events (compile, save, ...) are interleaved
    assert [x["step"] for x in lines] == [1, 2, 3] and all("loss" in x and "mae" in x for x in lines)
    losses = _tensorboard_losses(tmp_path / "tensorboard")  # on disk when train() returns
    assert [step for step, _ in losses] == [1, 2, 3]
    assert [v for _, v in losses] == pytest.approx([x["loss"] for x in lines], rel=1e-6)
    trainer.train(batch_for, steps=2)  # the next call appends to the same file, flushed when it returns
    assert [step for step, _ in _tensorboard_losses(tmp_path / "tensorboard")] == [1, 2, 3, 4, 5]


def test_free_live_restore_frees_first_and_restores(reference):
    trainer = RegressionTrainer(config(reference["workdir"]))
    trainer.init()
    old = trainer.states["model"]["l1"]["kernel"].get_value()
    report = trainer.restore_and_reshard(6, free_live=True)
    assert old.is_deleted() and str(report).startswith("restored step 6")
    assert digest(trainer) == reference["digest"]


def test_restore_and_reshard_from_a_state_loaded_by_hand(reference):
    import orbax.checkpoint as ocp
    from flax import nnx

    # What a user does with plain Orbax: load without targets onto this process's devices.
    mgr = ocp.CheckpointManager(
        Path(reference["workdir"]) / "checkpoints", item_handlers={"state": ocp.StandardCheckpointHandler()}
    )
    loaded = mgr.restore(6, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    host = jax.tree.map(np.asarray, loaded)  # and maybe brought it to the host
    mesh2 = ns.create_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
    fresh = RegressionTrainer(config(reference["workdir"]))._create()  # unsharded, on the default device
    out = ns.restore_and_reshard(host, fresh, reference["trainer"].hooks.strategy, mesh2)
    assert str(out) == "restored the loaded state onto 2 devices (fsdp=2)"
    kernel = fresh["model"].l2.kernel.get_value()
    assert dict(kernel.sharding.mesh.shape) == {"fsdp": 2}
    np.testing.assert_array_equal(
        np.asarray(kernel), host["model"]["l2"]["kernel"]["value"]
    )  # Orbax keeps {"value": x}
    assert isinstance(fresh["ema"], nnx.EMA)
