"""Checkpoints and workdirs in a bucket (gs://), against fake-gcs-server on 127.0.0.1: what a local disk
does, with no local litter, no second writer, nothing lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._base import storage
from nnx_shard._checkpoint._workdir import WorkdirLock
from nnx_shard.placement import abstract_target
from tests.apps.trainer_app import MLP, RegressionTrainer, batch_for, config, digest
from tests.bucket import flip_byte, take_together

ROOT = Path(__file__).resolve().parents[2]
FSDP = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def objects(uri: str) -> dict[str, int]:
    """Every object under ``uri``: its name below it -> its size."""
    fs, path = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache()
    return {name[len(path) + 1 :]: fs.info(name)["size"] for name in fs.find(path)}


def sync(workdir: str, **extra) -> dict:
    return {**config(workdir), "async_save": False, **extra}


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The test runs in an empty folder of its own, which must stay empty (no local ``gs:`` litter)."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    yield folder
    assert sorted(os.listdir(folder)) == []


def mesh(n: int):
    return ns.create_mesh((n,), ("fsdp",), devices=jax.devices()[:n])


def values(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# -- the Checkpointer and plain Orbax ---------------------------------------------------------------


def test_a_verified_save_restores_onto_4_devices_and_a_flipped_byte_is_named(bucket, elsewhere):
    model = MLP(nnx.Rngs(0), width=32)
    with ns.Checkpointer(f"{bucket}/ck", async_save=False) as ckpt:
        assert ckpt.save(3, {"model": model}, mesh=mesh(8))
    fresh = MLP(nnx.Rngs(1), width=32)
    report = ns.restore_and_reshard(f"{bucket}/ck", {"model": fresh}, FSDP, mesh(4))
    assert report.step == 3 and "fingerprints" in report.saved  # verified as it was read
    for got, want in zip(values(nnx.state(fresh)), values(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(got, want)
    assert fresh.l2.kernel.get_value().sharding.mesh.devices.size == 4
    data = sorted(n for n in objects(f"{bucket}/ck/3") if "/d/" in n)
    flip_byte(f"{bucket}/ck/3/{data[-1]}")
    before = values(nnx.state(fresh))
    with pytest.raises(ns.CheckpointCorruptError, match="step 3"):
        ns.restore_and_reshard(f"{bucket}/ck", {"model": fresh}, FSDP, mesh(4))
    assert all(np.array_equal(a, b) for a, b in zip(values(nnx.state(fresh)), before, strict=True))


def test_a_step_asked_for_by_number_is_read_only_if_its_save_finished(bucket, elsewhere):
    """In a bucket a step is finished when Orbax's ``commit_success.txt`` is in it. A step named by number
    is looked up on its own folder (no listing of every step's metadata); one whose save did not finish is
    refused naming the finished steps, as a step that is not there is, never read as a damaged one."""
    model = MLP(nnx.Rngs(0), width=32)
    with ns.Checkpointer(f"{bucket}/ck", async_save=False) as ckpt:
        for step in (2, 4):
            assert ckpt.save(step, {"model": model}, mesh=mesh(8))
    state = {"model": nnx.state(model)}
    target = abstract_target(state, ns.infer_sharding(state, FSDP, mesh(4)))
    fs, path = fsspec.core.url_to_fs(f"{bucket}/ck/4/commit_success.txt")
    fs.rm(path)
    with ns.Checkpointer(f"{bucket}/ck") as ckpt:
        refused = r"no checkpoint for step 4 .* the steps there are \[2\]"
        with pytest.raises(ns.NoCheckpointError, match=refused):
            ckpt.restore(4, target)
        step, restored, _ = ckpt.restore(2, target)
    assert step == 2
    for got, want in zip(values(restored), values(state), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_plain_orbax_checkpoints_in_a_bucket_restore_onto_4_devices(bucket, elsewhere):
    model = MLP(nnx.Rngs(0), width=32)
    with ocp.CheckpointManager(f"{bucket}/orbax") as manager:
        manager.save(7, args=ocp.args.StandardSave(nnx.state(model)))
        manager.wait_until_finished()
    fresh = MLP(nnx.Rngs(1), width=32)
    report = ns.restore_and_reshard(f"{bucket}/orbax", {"model": fresh}, FSDP, mesh(4))
    assert report.step == 7 and "plain Orbax" in str(report)
    for got, want in zip(values(nnx.state(fresh)), values(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(got, want)


# -- bad input: named before anything is written -----------------------------------------------------


def test_a_bucket_that_does_not_exist_is_named_before_anything_is_written(gcs_emulator, elsewhere):
    with pytest.raises(ns.StorageError, match=r"the bucket gs://no-such-bucket does not exist"):
        ns.Checkpointer("gs://no-such-bucket/ck")
    with pytest.raises(ns.StorageError, match=r"gs://no-such-bucket does not exist"):
        RegressionTrainer(sync("gs://no-such-bucket/run", total_steps=2))  # at once, not at the first save


@pytest.mark.parametrize(
    "uri, names",
    [("ftpx://bkt/run", "not one etils.epath serves"), ("s3://bkt/run", "no client for s3:// is installed")],
)
def test_a_scheme_nothing_installed_serves_is_named(uri, names, elsewhere):
    if uri.startswith("s3") and _installed("s3fs"):
        pytest.skip("s3fs is installed here")
    with pytest.raises(ns.StorageError, match=names):
        ns.Checkpointer(uri)
    with pytest.raises(ns.StorageError, match=names):
        RegressionTrainer(sync(uri, total_steps=2))


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# -- one writer per bucket workdir -------------------------------------------------------------------


def hold_lock(workdir: str, cwd: Path, env: dict) -> subprocess.Popen:
    """Another job holding ``workdir``'s lock, started in another folder (as on another host)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from nnx_shard._checkpoint._workdir import WorkdirLock; "
            f"WorkdirLock({workdir!r}, stale_after=2).acquire(); print('held', flush=True); time.sleep(120)",
        ],
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_job_on_a_bucket_workdir_is_refused_naming_the_holder(
    bucket, gcs_emulator, tmp_path, elsewhere
):
    workdir = f"{bucket}/run"
    other = tmp_path / "other-host"
    other.mkdir()
    holder = hold_lock(workdir, other, gcs_emulator.env)
    try:
        time.sleep(3)  # past stale_after=2: its heartbeat keeps it fresh
        trainer = RegressionTrainer(sync(workdir, total_steps=2, lock_stale_after=2.0))
        with pytest.raises(ns.WorkdirLockedError, match=rf"in use by another job: host .*, pid {holder.pid}"):
            trainer.train(batch_for)
        assert trainer.step == 0 and "checkpoints/" not in " ".join(objects(workdir))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.listdir(other) == []  # no local lock file where the holder started
    with pytest.warns(
        ns.CheckpointWarning, match=rf"taking over the lock .*pid {holder.pid}.*no longer runs"
    ):
        trainer.train(batch_for)
    assert trainer.step == 2 and "nnx_shard.lock" not in objects(workdir)  # released when train() returns


def test_a_stale_lock_is_taken_over_by_exactly_one_of_two_jobs(bucket, monkeypatch, elsewhere):
    lock = storage.location(f"{bucket}/run/nnx_shard.lock")
    storage.put_if(lock, json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}).encode(), "0")
    time.sleep(1.2)
    won, refused = take_together(f"{bucket}/run", 1.0, monkeypatch)
    assert len(won) == 1 and len(refused) == 1, (won, refused)
    holder = json.loads(storage.read_versioned(lock)[0])
    assert holder["token"] == won[0].token
    time.sleep(2.5)  # the winner's heartbeat keeps it fresh past stale_after
    assert storage.read_versioned(lock)[2] < 1.0
    with pytest.raises(ns.WorkdirLockedError):
        WorkdirLock(f"{bucket}/run", stale_after=1.0).acquire()
    won[0].release()
    assert storage.read_versioned(lock) is None


# -- setting a damaged step aside without a rename ---------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(gcs_emulator):
    """A run in a bucket workdir that saved steps 5 and 10, and its final state's digest."""
    workdir = "gs://" + gcs_emulator.make_bucket("finished") + "/run"
    trainer = RegressionTrainer(sync(workdir, total_steps=10, save_every=5, max_to_keep=None))
    trainer.train(batch_for)
    return workdir, digest(trainer), objects(f"{workdir}/checkpoints")


def copy_run(finished_run, bucket) -> str:
    fs, src = fsspec.core.url_to_fs(finished_run[0])
    fs.invalidate_cache()
    fs.copy(src, storage.key(f"{bucket}/run"), recursive=True)
    fs.invalidate_cache()
    return f"{bucket}/run"


def test_resume_auto_sets_a_damaged_newest_step_aside_in_a_bucket_and_keeps_its_objects(
    finished_run, bucket, elsewhere
):
    workdir = copy_run(finished_run, bucket)
    data = sorted(n for n in objects(f"{workdir}/checkpoints/10") if "ocdbt.process_0/d/" in n)
    flip_byte(f"{workdir}/checkpoints/10/{data[0]}")
    damaged = objects(f"{workdir}/checkpoints/10")
    trainer = RegressionTrainer(sync(workdir, total_steps=10, resume="auto", max_to_keep=None))
    with pytest.warns(ns.CheckpointWarning, match=r"set aside steps \[10\] .*rejected.*step 5 was restored"):
        trainer.train(batch_for)
    assert trainer.restored_step == 5 and digest(trainer) == finished_run[1]  # the same run, bitwise
    aside = objects(f"{workdir}/checkpoints.set_aside")
    (kind,) = {n.split("/")[0] for n in aside}
    assert kind.startswith("rejected-")
    assert {n.split("/", 2)[2]: s for n, s in aside.items()} == damaged  # every object kept, as it was
    again = RegressionTrainer(sync(workdir, total_steps=10, resume="auto", max_to_keep=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ns.CheckpointWarning)  # the bad step is not tried again
        again.train(batch_for)
    assert again.restored_step == 10 and digest(again) == finished_run[1]


@pytest.mark.parametrize("crash", ["after the copy", "after the markers went"])
def test_a_crash_while_setting_aside_leaves_the_step_readable(
    finished_run, bucket, crash, monkeypatch, elsewhere
):
    workdir = copy_run(finished_run, bucket)
    fs = storage.filesystem(workdir)
    calls = []
    real_rm = fs.rm

    def dying_rm(paths, *a, **k):
        calls.append(paths)
        if crash == "after the copy" or len(calls) == 2:
            raise KeyboardInterrupt("killed")  # stands for kill -9: nothing after it runs
        return real_rm(paths, *a, **k)

    monkeypatch.setattr(fs, "rm", dying_rm)
    ckpt = ns.Checkpointer(f"{workdir}/checkpoints", async_save=False)
    with pytest.raises(KeyboardInterrupt):
        ckpt.set_aside([10], kind="rejected", why="a test")
    monkeypatch.undo()
    (folder,) = {n.split("/")[0] for n in objects(f"{workdir}/checkpoints.set_aside")}
    aside = ns.Checkpointer(f"{workdir}/checkpoints.set_aside/{folder}", async_save=False)
    assert aside.all_steps() == [10]  # the copy is whole: it restores
    abstract = RegressionTrainer(sync(workdir, total_steps=10))
    abstract.init()
    target = abstract_target(abstract.states, abstract.plan)
    original = ns.Checkpointer(f"{finished_run[0]}/checkpoints", async_save=False).restore(10, target)[1]
    kept = aside.restore(10, target)[1]  # the copy is whole: it restores, verified, as saved
    assert all(np.array_equal(a, b) for a, b in zip(values(kept), values(original), strict=True))
    fresh = ns.Checkpointer(f"{workdir}/checkpoints", async_save=False)
    assert fresh.all_steps() == ([5, 10] if crash == "after the copy" else [5])
    if crash == "after the copy":  # still whole where it was, too
        where = fresh.restore(10, target)[1]
        assert all(np.array_equal(a, b) for a, b in zip(values(where), values(original), strict=True))


# -- metrics.jsonl and TensorBoard in the workdir ----------------------------------------------------


def test_metrics_and_tensorboard_go_to_the_bucket_workdir_and_a_resume_adds_to_them(bucket, elsewhere):
    workdir = f"{bucket}/run"
    RegressionTrainer(sync(workdir, total_steps=3, save_every=3)).train(batch_for)
    later = RegressionTrainer(sync(workdir, total_steps=5, save_every=5, resume="auto"))
    later.train(batch_for)
    fs, path = fsspec.core.url_to_fs(f"{workdir}/metrics.jsonl")
    fs.invalidate_cache()
    records = [json.loads(line) for line in fs.cat_file(path).decode().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # both runs', in order
    events = sorted(n for n in objects(f"{workdir}/tensorboard") if "tfevents" in n)
    assert len(events) == 2  # one file per Trainer
    losses = []
    for name in events:
        losses += tensorboard_losses(fs.cat_file(f"{storage.key(workdir)}/tensorboard/{name}"))
    assert sorted(step for step, _ in losses) == [1, 2, 3, 4, 5]
    logged = sorted((r["step"], r["loss"]) for r in records if "loss" in r)
    assert [v for _, v in sorted(losses)] == pytest.approx([v for _, v in logged], rel=1e-6)


def tensorboard_losses(data: bytes) -> list[tuple[int, float]]:
    """The (step, loss) scalars of an event file's bytes (TFRecord framing: length, crc, record, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    losses = []
    while data:
        n = int.from_bytes(data[:8], "little")
        event = Event.FromString(data[12 : 12 + n])
        data = data[16 + n :]
        losses += [(event.step, v.simple_value) for v in event.summary.value if v.tag == "loss"]
    return losses


# -- the pod case: processes under nnx-shard launch, the workdir in the bucket ------------------------


@pytest.mark.multihost
def test_a_pod_job_in_a_bucket_restarts_on_one_process_and_reads_each_example_once(
    bucket, gcs_emulator, tmp_path, elsewhere
):
    from tests.apps.launch_app import run_job, seen
    from tests.cluster.test_launch import finished, uninterrupted_on_numbered_data

    local, workdir = tmp_path / "job", f"{bucket}/run"
    local.mkdir()  # the app's own files (what each process fed, the result); the workdir is the bucket
    extra = ("--data", "elastic", "--bucket", workdir)
    done = run_job(local, 2, 4, "1:5", extra=extra, timeout=400, env=gcs_emulator.env)
    result = finished(local, done, "process 1 killed by SIGKILL", 1, 4)  # 2 x 4 devices, then 1 x 4
    assert result["restored_step"] == 4  # the newest checkpoint in the bucket
    history, expected = uninterrupted_on_numbered_data(tmp_path)
    got = {**seen(local, 0, range(1, 5)), **seen(local, 1, range(5, 9))}
    assert got == expected  # each example once: none twice, none skipped
    np.testing.assert_allclose(
        [result["losses"][str(s)] for s in range(5, 9)], [history[s] for s in range(5, 9)], rtol=1e-4
    )
    saved = objects(f"{workdir}/checkpoints")
    assert {n.split("/")[0] for n in saved} == {"4", "6", "8"}  # max_to_keep's newest, in the bucket
    fs, path = fsspec.core.url_to_fs(f"{workdir}/metrics.jsonl")
    fs.invalidate_cache()
    records = [json.loads(line) for line in fs.cat_file(path).decode().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "recovered"] == [4]  # the restart, from step 4
    assert not (ROOT / "gs:").exists() and "nnx_shard.lock" not in objects(workdir)


@pytest.mark.slow
def test_the_vit_example_trains_and_saves_with_its_workdir_in_a_bucket(bucket, elsewhere):
    from tests.scenarios.test_vit_example import train

    workdir = f"{bucket}/vit"
    done = train(
        "--workdir", workdir, "--steps", "2", "--total-steps", "2", "--devices", "8", "--batch-size", "32"
    )
    assert done["final_step"] == 2
    saved = objects(workdir)
    assert "metrics.jsonl" in saved and any(n.startswith("checkpoints/2/") for n in saved)
    fresh = ns.Checkpointer(f"{workdir}/checkpoints")
    assert fresh.all_steps() == [2] and fresh.metadata(2)["devices"] == 8
    assert not (ROOT / "gs:").exists()


# -- the other paths the package writes: Hugging Face folders, a plan's picture, the CLI's config --------


def test_a_hugging_face_folder_round_trips_through_a_bucket(bucket, elsewhere):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    rules = [(r"fc\.weight", "kernel", "T"), (r"fc\.bias", "bias")]
    written = ns.save_safetensors(model, f"{bucket}/hf", rules)
    assert written == [f"{bucket}/hf/model.safetensors"]
    assert sorted(objects(f"{bucket}/hf")) == ["model.safetensors", "model.safetensors.index.json"]
    again = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    report = ns.load_safetensors(again, f"{bucket}/hf", rules)
    assert report.tensors == 2
    np.testing.assert_array_equal(again.kernel.get_value(), model.kernel.get_value())
    exported = ns.save_safetensors(
        again, f"{bucket}/hf2", rules, like=f"{bucket}/hf"
    )  # like= in a bucket too
    assert exported == [f"{bucket}/hf2/model.safetensors"]
    with pytest.raises(ns.StorageError, match="does not exist"):
        ns.save_safetensors(model, "gs://no-such-bucket/hf", rules)


def test_a_plan_picture_and_a_cli_config_in_a_bucket(bucket, elsewhere):
    pytest.importorskip("matplotlib")
    plan = ns.sharding.plan_sharding(nnx.eval_shape(lambda: MLP(nnx.Rngs(0), width=32)), FSDP, mesh(8))
    assert plan.plot(f"{bucket}/plan.png") == f"{bucket}/plan.png"
    fs, path = fsspec.core.url_to_fs(f"{bucket}/plan.png")
    fs.invalidate_cache()
    assert fs.cat_file(path)[:8] == b"\x89PNG\r\n\x1a\n"
    config = 'model = "examples.toy_models:llama"\nmesh = "fsdp:4"\ndevices = 4\n'
    config += 'model_kwargs = { size = "tiny" }\nstrategy = [[".*", "replicate"]]\n'
    fs.pipe_file(storage.key(f"{bucket}/plan.toml"), config.encode())
    from tests.package.test_cli import cli

    done = cli("plan", "--config", f"{bucket}/plan.toml", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["mesh"] == {"fsdp": 4}


def test_a_steps_file_manifest_in_a_bucket_is_one_listing_and_names_a_changed_file(bucket, elsewhere):
    from nnx_shard._checkpoint._manifest import MANIFEST, checked_files

    with ns.Checkpointer(f"{bucket}/ck", async_save=False) as ckpt:
        ckpt.save(1, {"model": MLP(nnx.Rngs(0), width=32)}, mesh=mesh(8))
        step = ckpt.directory / "1"
    sums = json.loads(storage.read_many(step, [MANIFEST])[MANIFEST])
    small = {n for n, size in objects(f"{bucket}/ck/1").items() if size <= 2**20 and n != MANIFEST}
    assert set(sums) == small and checked_files(step)[0] == []
    flip_byte(f"{bucket}/ck/1/meta/metadata", 0)
    assert checked_files(step)[0] == ["meta/metadata"]


def test_a_listing_rereads_the_steps_metadata_only_when_another_writer_changed_the_steps(
    bucket, elsewhere, monkeypatch
):
    reloads = []
    reload = ocp.CheckpointManager.reload
    monkeypatch.setattr(ocp.CheckpointManager, "reload", lambda self: (reloads.append(1), reload(self))[1])
    state = {"model": MLP(nnx.Rngs(0), width=32)}
    with ns.Checkpointer(f"{bucket}/ck", async_save=False) as a, ns.Checkpointer(f"{bucket}/ck") as b:
        a.save(1, state, mesh=mesh(8))
        a.save(2, state, mesh=mesh(8))
        assert b.all_steps() == [1, 2]  # another writer's steps: Orbax's view of them read once
        reloads.clear()
        assert b.save(3, state, mesh=mesh(8))
        b.wait_until_finished()
        assert b.all_steps() == [1, 2, 3] and b.all_steps() == [1, 2, 3]
        assert reloads == []  # a save and its listings read no step's metadata: nothing changed
        assert a.all_steps() == [1, 2, 3] and len(reloads) == 1  # a sees b's step
        fs, path = fsspec.core.url_to_fs(f"{bucket}/ck/3")
        fs.rm(path, recursive=True)  # set aside by another writer
        assert b.all_steps() == [1, 2] and b.latest_step() == 2
        assert b.save(3, state, mesh=mesh(8)), b.last_skip_reason  # not "already saved"
        b.wait_until_finished()
        assert b.all_steps() == [1, 2, 3]


@pytest.mark.multihost
def test_two_processes_resume_past_a_damaged_newest_step_in_a_bucket(bucket, multiprocess, elsewhere):
    workdir = f"{bucket}/run"
    first, _ = multiprocess("tests.apps.mh_workers:train_in_a_bucket", 2, args={"workdir": workdir})
    assert all(r.returncode == 0 for r in first), [r.log[-2000:] for r in first]
    assert [r.value["steps"] for r in first] == [[5, 10], [5, 10]]
    data = sorted(n for n in objects(f"{workdir}/checkpoints/10") if "/d/" in n)
    flip_byte(f"{workdir}/checkpoints/10/{data[0]}")
    again, _ = multiprocess("tests.apps.mh_workers:train_in_a_bucket", 2, args={"workdir": workdir})
    assert all(r.returncode == 0 for r in again), [r.log[-2000:] for r in again]
    # process 0 set step 10 aside; every process listed what it left, restored 5 and saved 10 again
    assert [r.value["restored_step"] for r in again] == [5, 5]
    assert [r.value["steps"] for r in again] == [[5, 10], [5, 10]]
    assert any("set aside steps [10]" in w for w in again[0].value["warnings"])
    assert {r.value["digest"] for r in again} == {first[0].value["digest"]}  # the same run, bitwise
    assert any(n.startswith("rejected-") for n in objects(f"{workdir}/checkpoints.set_aside"))
