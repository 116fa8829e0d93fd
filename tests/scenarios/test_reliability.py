"""What a week-long unattended job meets: another run's checkpoints, damaged steps, full disks, a second
writer, NaNs."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from tests.apps.chaos_app import DAMAGE, damage, largest
from tests.apps.trainer_app import MLP, STRATEGY, RegressionTrainer, batch_for, config, digest

ROOT = Path(__file__).resolve().parents[2]


def sync(workdir, **extra):
    return {**config(str(workdir)), "async_save": False, **extra}


def other_data(step):
    batch = batch_for(step + 1000)
    return {"x": batch["x"], "y": -batch["y"]}


def params_at(workdir, step):
    """The l1 kernel a checkpoint holds, read back into a fresh model."""
    model = MLP(nnx.Rngs(7))
    mesh = ns.create_mesh((8,), ("fsdp",))
    ns.restore_and_reshard(str(workdir) + "/checkpoints", {"model": model}, STRATEGY, mesh, step=step)
    return np.asarray(model.l1.kernel.get_value())


# -- 1. never save silently over another run ------------------------------------------------


def test_a_run_that_restored_an_older_step_sets_the_newer_ones_aside_and_saves_its_own(tmp_path):
    first = RegressionTrainer(sync(tmp_path, total_steps=20, save_every=10))
    first.train(batch_for)
    old_20 = params_at(tmp_path, 20)
    second = RegressionTrainer(sync(tmp_path, total_steps=20, save_every=10))
    second.restore_and_reshard(10)
    with pytest.warns(ns.CheckpointWarning, match=r"set aside steps \[20\] .*abandoned.*restored step 10"):
        second.train(other_data)
    live = np.asarray(second.states["model"]["l1"]["kernel"].get_value())
    np.testing.assert_array_equal(params_at(tmp_path, 20), live)  # step 20 is this run's now
    assert not np.array_equal(live, old_20)
    moved = list((tmp_path / "checkpoints.set_aside").glob("abandoned-*/20"))
    assert len(moved) == 1  # moved, not deleted: the first run's step 20 is still there
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "save"][-1] == 20


def test_a_fresh_run_in_a_workdir_with_checkpoints_refuses_before_its_first_step(tmp_path):
    RegressionTrainer(sync(tmp_path, total_steps=4, save_every=2)).train(batch_for)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "metrics" not in p.name)
    fresh = RegressionTrainer(sync(tmp_path, total_steps=4))
    with pytest.raises(ns.CheckpointExistsError, match=r"steps \[2, 4\]") as e:
        fresh.train(other_data)
    for way_out in ("resume='auto'", "another workdir", "overwrite=True"):
        assert way_out in str(e.value)
    assert isinstance(e.value, ns.CheckpointError) and fresh.step == 0
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "metrics" not in p.name)
    assert after == before  # nothing in the workdir touched


def test_overwrite_sets_the_old_run_aside_and_starts_afresh(tmp_path):
    RegressionTrainer(sync(tmp_path, total_steps=4, save_every=2)).train(batch_for)
    fresh = RegressionTrainer(sync(tmp_path, total_steps=2, overwrite=True))
    with pytest.warns(ns.CheckpointWarning, match=r"set aside steps \[2, 4\].*overwrite=True"):
        fresh.train(other_data)
    assert fresh.checkpointer.all_steps() == [2]
    assert sorted(p.name for p in (tmp_path / "checkpoints.set_aside").glob("overwritten-*/*")) == ["2", "4"]


def test_a_save_that_does_not_write_returns_false_and_says_why(tmp_path):
    trainer = RegressionTrainer(sync(tmp_path, total_steps=2))
    trainer.train(batch_for)
    with pytest.warns(ns.CheckpointWarning, match="step 2 was not saved .*already saved"):
        assert trainer.save() is False
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e.get("event") == "save_skipped"]
    assert skipped and "already saved" in skipped[-1]["reason"]
    assert sum(e.get("event") == "save" for e in events) == 1  # never logged as a save
    ckpt = trainer.checkpointer
    with pytest.warns(ns.CheckpointWarning, match="older than the newest step 2"):
        assert ckpt.save(1, trainer.states) is False
    assert ckpt.last_skip_reason.startswith("it is older") and ckpt.all_steps() == [2]


# -- 2. resume falls back ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 9 steps with synchronous saves at 3, 6 and 9 (all kept), and its final digest."""
    workdir = tmp_path_factory.mktemp("finished")
    trainer = RegressionTrainer(sync(workdir, total_steps=9, save_every=3, max_to_keep=None))
    trainer.train(batch_for)
    return workdir, digest(trainer)


def copy_of(finished, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(finished[0], workdir)
    return workdir


def test_resume_auto_goes_back_to_the_newest_step_that_verifies(finished, tmp_path):
    workdir = copy_of(finished, tmp_path)
    damage(workdir / "checkpoints" / "9", "flip_data")
    trainer = RegressionTrainer(sync(workdir, total_steps=9, resume="auto", max_to_keep=None))
    with pytest.warns(ns.CheckpointWarning, match=r"set aside steps \[9\] .*rejected.*step 6 was restored"):
        trainer.train(batch_for)
    assert trainer.restored_step == 6 and digest(trainer) == finished[1]  # the same run, bitwise
    assert list((workdir / "checkpoints.set_aside").glob("rejected-*/9"))  # kept for a post-mortem
    again = RegressionTrainer(sync(workdir, total_steps=9, resume="auto", max_to_keep=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ns.CheckpointWarning)  # the bad step is not tried again
        again.train(batch_for)
    assert again.restored_step == 9


def test_when_no_step_verifies_the_run_does_not_start_from_scratch(finished, tmp_path):
    workdir = copy_of(finished, tmp_path)
    for step in (3, 6, 9):
        damage(workdir / "checkpoints" / str(step), "truncate_data")
    trainer = RegressionTrainer(sync(workdir, total_steps=12, resume="auto"))
    with pytest.raises(ns.CheckpointCorruptError, match=r"no step .* reads and verifies") as e:
        trainer.train(batch_for)
    assert all(f"step {s}:" in str(e.value) for s in (3, 6, 9)) and trainer.step == 0
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6", "9"]  # nothing moved


# -- 3. damage gives a named, short error -------------------------------------------------------

KINDS_NAMING = {  # the kind of damage -> what the error must name
    "flip_data": "ocdbt.process_0/d/",  # small files are checked against their CRC first
    "truncate_data": "state",
    "delete_data": "state",
    "empty_all": "nnx_shard_files.json",
    "garbage_tree_metadata": "_METADATA",
    "garbage_json_metadata": "meta/metadata",
    "delete_state_folder": "state/",
    "delete_checkpoint_metadata": "_CHECKPOINT_METADATA",
    "truncate_ocdbt_manifest": "manifest.ocdbt",
    "garbage_array_metadata": "array_metadatas",
    "garbage_sharding": "_sharding",
    "flip_manifest_of_files": "nnx_shard_files.json",
}


def restore_in_subprocess(workdir, step, verify=True):
    """Restores ``step`` of every item with a Trainer in a fresh process: its last line and its stderr."""
    code = (
        "import jax; jax.config.update('jax_num_cpu_devices', 8)\n"
        "import nnx_shard as ns\n"
        "from tests.apps.trainer_app import RegressionTrainer, config, digest\n"
        f"trainer = RegressionTrainer({{**config({str(workdir)!r}), 'verify': {verify}}})\n"
        "trainer.init(); before = digest(trainer)\n"
        "try:\n"
        f"    trainer.restore_and_reshard({step})\n"
        "except ns.NnxShardError as e:\n"
        "    assert digest(trainer) == before  # the live state is untouched\n"
        "    print('ERROR', type(e).__name__, str(e).replace(chr(10), ' '))\n"
        "else:\n"
        "    print('RESTORED')\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    return p.returncode, p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "", p.stderr


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_every_kind_of_damage_is_a_named_short_error(finished, tmp_path, kind):
    workdir = copy_of(finished, tmp_path)
    damage(workdir / "checkpoints" / "9", kind)
    rc, line, stderr = restore_in_subprocess(workdir, 9)
    assert rc == 0, stderr[-3000:]
    assert line.startswith("ERROR CheckpointCorruptError step 9 in "), line
    assert KINDS_NAMING[kind] in line, line
    assert len(stderr.splitlines()) <= 20, stderr[-3000:]
    assert (
        "Other steps: [3, 6]" in line
    )  # still there; tests/scenarios/test_chaos.py restores them after each kind


WITHOUT_VERIFY_NAMES = {
    "truncate_data": "arrays ['",
    "delete_data": "arrays ['",
    "garbage_tree_metadata": "_METADATA",
    "empty_all": "_METADATA",
}


@pytest.mark.parametrize("kind", sorted(WITHOUT_VERIFY_NAMES))
def test_damage_without_verification_is_still_named(finished, tmp_path, kind):
    # verify=False reads no fingerprints or file checksums: Orbax's own errors must be translated.
    workdir = copy_of(finished, tmp_path)
    damage(workdir / "checkpoints" / "9", kind)
    rc, line, stderr = restore_in_subprocess(workdir, 9, verify=False)
    assert rc == 0, stderr[-3000:]
    assert line.startswith("ERROR CheckpointCorruptError step 9 in "), line
    assert WITHOUT_VERIFY_NAMES[kind] in line, line  # the array or file
    assert len(stderr.splitlines()) <= 20, stderr[-3000:]


def test_a_bug_is_not_disguised_as_corruption(finished, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    def broken(self, *a, **k):
        raise TypeError("a bug in the restore path")

    monkeypatch.setattr(ocp.CheckpointManager, "restore", broken)
    with pytest.raises(TypeError, match="a bug in the restore path"):
        ns.Checkpointer(str(finished[0]) + "/checkpoints").metadata(9)


def test_ema_as_model_on_a_model_of_parameters_only(tmp_path):
    trainer = RegressionTrainer(sync(tmp_path, total_steps=6, save_every=3))
    trainer.train(batch_for)
    model = MLP(nnx.Rngs(99))
    mesh = ns.create_mesh((8,), ("fsdp",))
    report = ns.restore_and_reshard(
        str(tmp_path / "checkpoints"), {"model": model}, STRATEGY, mesh, step=6, ema_as_model=True
    )
    assert "EMA parameters as the model" in str(report)
    np.testing.assert_array_equal(
        np.asarray(model.l1.kernel.get_value()),
        np.asarray(trainer.states["ema"]["params"]["l1"]["kernel"].get_value()),
    )


# -- 4. a save that cannot be written says so --------------------------------------------------

FULL_DISK = """
import resource, signal, sys, jax
jax.config.update('jax_num_cpu_devices', 8)
from flax import nnx
import numpy as np, nnx_shard as ns
from tests.apps.trainer_app import MLP, STRATEGY
mesh = ns.create_mesh((8,), ('fsdp',))
model = {'model': MLP(nnx.Rngs(0), width=512)}
ckpt = ns.Checkpointer(sys.argv[1], async_save=sys.argv[2] == 'async')
ckpt.save(1, model, mesh=mesh); ckpt.wait_until_finished()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))  # a full disk
try:
    ckpt.save(2, model, mesh=mesh)
    ckpt.wait_until_finished()
except ns.CheckpointSaveError as e:
    print('SAVE_ERROR', str(e).replace(chr(10), ' '))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print('STEPS', ckpt.all_steps())
print('SAVED', ckpt.save(3, model, mesh=mesh)); ckpt.wait_until_finished()
print('STEPS', ckpt.all_steps())
for step in (1, 3):
    m = MLP(nnx.Rngs(5), width=512)
    ns.restore_and_reshard(ckpt, {'model': m}, STRATEGY, mesh, step=step)
    saved = np.asarray(model['model'].l1.kernel.get_value())
    assert np.array_equal(np.asarray(m.l1.kernel.get_value()), saved)
print('RESTORED')
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_raises_a_save_error_and_the_next_save_writes(tmp_path, mode):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    p = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path / "ck"), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    out = p.stdout.splitlines()
    assert p.returncode == 0, p.stderr[-3000:]
    error = next(line for line in out if line.startswith("SAVE_ERROR"))
    assert "step 2 could not be written to" in error and str(tmp_path / "ck") in error
    assert "File too large (errno 27)" in error and "writing model/" in error  # the OS error, the array
    assert out[-4:] == ["STEPS [1]", "SAVED True", "STEPS [1, 3]", "RESTORED"]
    assert not [p.name for p in (tmp_path / "ck").iterdir() if not p.name.isdigit()]  # no leftovers


def test_an_unwritable_directory_raises_a_save_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    ckpt = ns.Checkpointer(tmp_path / "file" / "checkpoints", async_save=False)
    with pytest.raises(
        ns.CheckpointSaveError, match=r"step 1 could not be written to .*file/checkpoints"
    ) as e:
        ckpt.save(1, {"model": nnx.Linear(2, 2, rngs=nnx.Rngs(0))})
    assert "NotADirectoryError" in str(e.value) or "FileExistsError" in str(e.value)
    assert isinstance(e.value.__cause__, OSError)


def test_leftovers_of_an_interrupted_save_are_removed_with_a_note(tmp_path, caplog):
    ckpt = ns.Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {"model": nnx.Linear(2, 2, rngs=nnx.Rngs(0))})
    ckpt.close()
    (tmp_path / "2.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "2.orbax-checkpoint-tmp-1234" / "partial").write_text("x")
    with caplog.at_level("WARNING", logger="nnx_shard"):
        ckpt = ns.Checkpointer(tmp_path, async_save=False)
        assert ckpt.save(2, {"model": nnx.Linear(2, 2, rngs=nnx.Rngs(0))})
    assert "removed 1 temporary folders of interrupted saves" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_retention_never_deletes_the_newest_step_that_verified(tmp_path):
    trainer = RegressionTrainer(sync(tmp_path, total_steps=6, save_every=2, max_to_keep=1))
    trainer.train(batch_for)
    assert trainer.checkpointer.all_steps() == [6]
    damage(
        tmp_path / "checkpoints" / "6", "flip_data"
    )  # the only step left is bad: a named error, not a loss
    with pytest.raises(ns.CheckpointCorruptError, match="step 6"):
        RegressionTrainer(sync(tmp_path, total_steps=8, resume="auto", max_to_keep=1)).train(batch_for)
    assert (tmp_path / "checkpoints" / "6").exists()


# -- 5. one writer per workdir ------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from nnx_shard._checkpoint._workdir import WorkdirLock; "
            f"WorkdirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        trainer = RegressionTrainer(sync(tmp_path, total_steps=2))
        with pytest.raises(
            ns.WorkdirLockedError, match=rf"in use by another job: host .*, pid {holder.pid}, started "
        ):
            trainer.train(batch_for)
        assert trainer.step == 0 and not (tmp_path / "checkpoints").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # its holder is dead now: the lock is taken over with a warning
    with pytest.warns(
        ns.CheckpointWarning, match=rf"taking over the lock .*pid {holder.pid}.*no longer runs"
    ):
        trainer.train(batch_for)
    assert trainer.step == 2 and not (tmp_path / "nnx_shard.lock").exists()  # released when train() returns


def test_a_lock_without_heartbeat_from_another_host_is_taken_over(tmp_path):
    lock = tmp_path / "nnx_shard.lock"
    lock.write_text(
        json.dumps({"host": "elsewhere", "pid": 1, "started": "2026-01-01T00:00:00", "token": "t"})
    )
    os.utime(lock, (0, 0))
    trainer = RegressionTrainer(sync(tmp_path, total_steps=1, lock_stale_after=30.0))
    with pytest.warns(ns.CheckpointWarning, match="host elsewhere.*heartbeat is .* s old"):
        trainer.train(batch_for)
    fresh = tmp_path / "other"
    fresh.mkdir()
    (fresh / "nnx_shard.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "now"}))
    with pytest.raises(ns.WorkdirLockedError, match="host elsewhere, pid 1"):
        RegressionTrainer(sync(fresh, total_steps=1, lock_stale_after=30.0)).train(batch_for)


def test_a_stale_lock_is_taken_over_by_exactly_one_of_two_jobs_that_read_it_together(tmp_path, monkeypatch):
    from tests.bucket import take_together

    lock = tmp_path / "nnx_shard.lock"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then", "token": "t"}))
    os.utime(lock, (0, 0))
    won, refused = take_together(str(tmp_path), 30.0, monkeypatch)
    assert len(won) == 1 and len(refused) == 1, (won, refused)
    assert json.loads(lock.read_text())["token"] == won[0].token
    won[0].release()
    assert sorted(os.listdir(tmp_path)) == []  # nothing left beside it


def test_a_later_trainer_in_the_same_process_takes_the_lock_again(tmp_path):
    RegressionTrainer(sync(tmp_path, total_steps=2)).train(batch_for)
    later = RegressionTrainer(sync(tmp_path, total_steps=4, resume="auto"))
    later.train(batch_for)
    assert later.step == 4 and not (tmp_path / "nnx_shard.lock").exists()


# -- 6. non-finite steps ------------------------------------------------------------------------


def poisoned(bad_steps):
    """Data whose batches at ``bad_steps`` (0-based call index = step) make the loss NaN."""

    def data(step):
        batch = batch_for(step)
        if step in bad_steps:
            batch = {"x": batch["x"], "y": np.full_like(batch["y"], np.nan)}
        return batch

    return data


def test_a_nan_stops_the_run_without_applying_or_saving_it(tmp_path):
    trainer = RegressionTrainer(sync(tmp_path, total_steps=12, save_every=2))
    digests = {}
    trainer.add_callback(lambda step, m, t: digests.setdefault(step, digest(t)), every=1)
    trainer.train(poisoned({6}))  # batch_for(6) is the batch of step 7
    assert trainer.stop_reason == "non-finite loss at step 7"
    assert trainer.step == 6 and digest(trainer) == digests[6]  # the state from before the bad step
    assert trainer.checkpointer.all_steps()[-1] == 6  # nothing of step 7 or later was saved
    states = trainer.states
    assert all(
        bool(jnp.all(jnp.isfinite(x)))
        for x in jax.tree.leaves(states)
        if jnp.issubdtype(x.dtype, jnp.floating)
    )


def test_skip_leaves_the_state_as_before_and_counts_the_skipped_steps(tmp_path):
    trainer = RegressionTrainer({**config(""), "total_steps": 8, "on_nonfinite": "skip", "log_every": 1})
    digests = {}
    trainer.add_callback(lambda step, m, t: digests.setdefault(step, digest(t)), every=1)
    history = trainer.train(poisoned({3, 4}))
    assert trainer.stop_reason == "finished" and trainer.step == 8
    assert digests[4] == digests[5] == digests[3]  # steps 4 and 5 changed nothing
    assert digests[6] != digests[5]
    assert [h["skipped_steps"] for h in history] == [0, 0, 0, 1, 2, 2, 2, 2]


def test_skip_stops_after_too_many_in_a_row(tmp_path):
    trainer = RegressionTrainer(
        {**config(""), "total_steps": 20, "on_nonfinite": "skip", "max_consecutive_nonfinite": 3}
    )
    trainer.train(poisoned(set(range(5, 100))))
    assert trainer.stop_reason.startswith("non-finite loss at steps 6-8 (3 in a row")
    assert trainer.step in (8, 9)  # the host learns a step late; skipped steps change nothing


# -- 7. config values checked at construction ---------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("total_steps", "20", "a whole number >= 0"),
        ("save_every", -1, "a whole number >= 0"),
        ("max_to_keep", 0, "a whole number >= 1, or None to keep every step"),
        ("log_every", True, "a whole number >= 0"),
        ("on_nonfinite", "ignore", "one of ('stop', 'skip')"),
        ("max_consecutive_nonfinite", 0, "a whole number >= 1"),
        ("resume", "yes", "one of ('off', 'auto')"),
        ("async_save", "no", "True or False"),
        ("barrier_timeout", 0, "a number of seconds > 0"),
        ("ema_decay", 2.0, "a number in [0, 1], or None for no EMA"),
        ("workdir", 3, "a string ('' for none)"),
        ("sharding_strategy", ".*", "a list of (regex, tactic) pairs"),
        ("width", 3.5, "a int, like its default 64"),
    ],
)
def test_a_config_value_of_the_wrong_type_or_range_is_named(key, value, expected):
    with pytest.raises(ns.ConfigError) as e:
        RegressionTrainer({**config(""), key: value})
    assert f"config.{key} must be {expected}; got {value!r}" in str(e.value)


def test_config_strategies_and_meshes_are_checked_at_construction():
    with pytest.raises(ns.ConfigError, match=r"sharding_strategy\[1\] .*fsdpp"):
        RegressionTrainer({**config(""), "sharding_strategy": [(".*bias", "replicate"), (".*", "fsdpp()")]})
    with pytest.raises(ns.ConfigError, match=r"sharding_strategy\[0\] regex '\(' does not compile"):
        RegressionTrainer({**config(""), "sharding_strategy": [("(", "replicate")]})
    with pytest.raises(ns.ConfigError, match=r"config\.mesh 'fsdp:3' does not fit"):
        RegressionTrainer({**config(""), "mesh": "fsdp:3"})


def test_subclass_keys_are_checked_against_their_defaults():
    class Mine(RegressionTrainer):
        @classmethod
        def default_config(cls):
            c = super().default_config()
            c.lr, c.note, c.anything = 0.1, "x", None
            return c

        def create_optimizer(self):
            return optax.sgd(self.config.lr)

    assert Mine({**config(""), "lr": 1, "anything": [1]}).config.lr == 1  # an int where a float is expected
    with pytest.raises(ns.ConfigError, match=r"config.lr must be a float, like its default 0.1; got '1e-3'"):
        Mine({**config(""), "lr": "1e-3"})
    with pytest.raises(ns.ConfigError, match=r"config\.note must be a str"):
        Mine({**config(""), "note": 5})


# -- 8. the EMA's own state mirrors the model's parameters -------------------------------------


def test_a_standalone_ema_state_is_placed_by_rules_written_for_the_model():
    model = MLP(nnx.Rngs(0))
    ema = nnx.EMA(model, decay=0.9)
    mesh = ns.create_mesh((8,), ("fsdp",))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ns.UnusedRuleWarning)
        shardings = ns.infer_sharding(
            nnx.state(ema), [("^l1/kernel$", "shard_dim(axis='fsdp', dim=0)"), (".*", "replicate")], mesh
        )
    assert shardings["params"]["l1"]["kernel"].spec == jax.sharding.PartitionSpec("fsdp", None)
    assert shardings["params"]["l2"]["kernel"].is_fully_replicated


def test_damage_helpers_damage_what_they_say(finished, tmp_path):
    workdir = copy_of(finished, tmp_path)
    big = largest(workdir / "checkpoints" / "9")
    size = big.stat().st_size
    damage(workdir / "checkpoints" / "9", "truncate_data")
    assert big.stat().st_size == size // 2
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY  # no limit leaked here
