"""The snapshot writer: own shards plus a peer's copy through a JAX ppermute, every collective agreed."""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._snapshots import SnapshotWriter, unpack
from tests.helpers import mesh_of
from tests.snapshots.test_file import assemble, shares


@pytest.fixture
def every_snapshot_taken(monkeypatch):
    """The trainer skips a snapshot due while the last is still written; on a loaded machine that is any of
    them. Tests of what a snapshot holds take each one, the last waited for (skipping has its own tests)."""
    real = SnapshotWriter.write

    def write(self, step, states, data_state=None, *, skip_if_busy=False):
        return real(self, step, states, data_state)

    monkeypatch.setattr(SnapshotWriter, "write", write)


def test_each_process_holds_its_shards_and_a_peers_and_together_they_make_the_state(multiprocess, tmp_path):
    folder = tmp_path / "snap"
    results, _ = multiprocess("tests.apps.snapshot_workers:write", 2, devices=4, args={"folder": str(folder)})
    values = [r.ok() for r in results]
    assert [v["dest"] for v in values] == [[1, 0], [1, 0]]
    own, shapes = {}, {}
    for pid in (0, 1):
        mine = folder / f"process-{pid}"
        assert sorted(p.name for p in mine.iterdir()) == ["step-6", "step-9"]  # the newest two
        step = mine / "step-9"
        assert sorted(p.name for p in step.iterdir()) == ["own.bin", f"peer-{1 - pid}.bin"]
        header, pieces = unpack(np.fromfile(step / "own.bin", np.uint8))
        assert header.step == 9 and header.process == pid
        own.update(pieces)
        shapes.update({p.path: p.shape for p in header.pieces})
        # The peer copy is the other process's own buffer, byte for byte.
        other = np.fromfile(folder / f"process-{1 - pid}" / "step-9" / "own.bin", np.uint8)
        np.testing.assert_array_equal(np.fromfile(step / f"peer-{1 - pid}.bin", np.uint8), other)
    state = assemble(own, shapes)
    digests = values[0]["digests"]
    assert set(state) == set(digests)
    for path, whole in state.items():
        assert hashlib.sha256(whole.tobytes()).hexdigest() == digests[path], path
    packed = 2 * (values[0]["bytes"][0] + values[0]["bytes"][1])  # own + peer, 2 kept, with headers
    assert 0 < values[0]["need"] <= packed  # the estimate counts the arrays, not the JSON headers


@pytest.mark.parametrize("slow", ["packing", "receive", "copy"])
def test_processes_issue_the_same_collectives_whatever_one_of_them_is_slow_at(multiprocess, tmp_path, slow):
    """Process 1's packing, receive of the peer's copy, or copy on the step is 0.15 s slower than process
    0's: the two still issue the same collectives (site, step, shape) in the same order, each copy goes to
    the peer before the second step after its snapshot, every snapshot is taken and kept with the peer's
    copy, and the copy's program is compiled once for copies of several lengths."""
    results, _ = multiprocess(
        "tests.apps.snapshot_workers:delayed",
        2,
        devices=2,
        args={"folder": str(tmp_path / "s"), "slow": slow},
    )
    first, second = (r.ok() for r in results)
    assert first["journal"] == second["journal"]  # each thread's collectives, in order
    sites = [site for site, _, _ in first["journal"]["main"]]
    assert sites.count("snapshot.agree") == 5 and "snapshot.exchange" not in sites, sites
    assert [site for site, _, _ in first["journal"]["snapshot"]] == ["snapshot.exchange"] * 5
    assert first["sent"] == second["sent"] == [11, 21, 31, 41, 61]
    for pid, r in enumerate((first, second)):
        assert r["taken"] == [True] * 5 and r["skipped"] == 0
        assert r["peers"] == [f"peer-{1 - pid}.bin"] * 2, r  # the 2 kept, each with the peer's copy
        assert r["programs"] == [1, 1]


def test_the_copy_to_the_peer_never_crosses_a_steps_ppermute_over_the_same_devices(multiprocess, tmp_path):
    """One device per process, steps of ``ppermute``s over both in process order: the snapshots' copies
    go to the peer from the writer's thread beside those steps, on a communicator of their own (a ``ppermute``
    of each on one communicator would take the other's message and abort both processes). Every step's
    values come back as sent, and each kept snapshot holds the other process's own file byte for byte."""
    folder = tmp_path / "snap"
    results, _ = multiprocess(
        "tests.apps.snapshot_workers:beside_a_steps_ppermute", 2, devices=1, args={"folder": str(folder)}
    )
    for pid, r in enumerate(results):
        assert r.ok() == {"wrong": [], "kept": [25, 30]}
        for step in (25, 30):
            other = np.fromfile(folder / f"process-{1 - pid}" / f"step-{step}" / "own.bin", np.uint8)
            peer = np.fromfile(folder / f"process-{pid}" / f"step-{step}" / f"peer-{1 - pid}.bin", np.uint8)
            np.testing.assert_array_equal(peer, other)


def test_the_trainer_snapshots_every_n_steps_and_refuses_to_start_without_the_memory(
    tmp_path, monkeypatch, every_snapshot_taken
):
    import shutil
    from collections import namedtuple

    import nnx_shard as ns
    from nnx_shard._checkpoint import storable, tree_fingerprints
    from tests.apps.trainer_app import RegressionTrainer, batch_for, config

    snap = tmp_path / "snap"
    cfg = {**config(str(tmp_path / "run"), total_steps=6), "snapshot_every": 2, "snapshot_dir": str(snap)}
    trainer = RegressionTrainer(cfg)
    live = {}  # the state's fingerprints at each step, taken on the step's path (as a checkpoint would)
    trainer.add_callback(lambda step, m, t: live.setdefault(step, tree_fingerprints(storable(t.states)[0])))
    trainer.train(batch_for, steps=5)
    assert sorted(p.name for p in (snap / "process-0").iterdir()) == ["step-2", "step-4"]
    header, _ = unpack(np.fromfile(snap / "process-0" / "step-4" / "own.bin", np.uint8))
    assert header.step == 4 and {p.path for p in header.pieces} == set(live[4])
    # written while steps 5 and on ran, the snapshot is of the step it claims: its shares sum to step 4's
    assert shares(header) == live[4] != live[5]
    trainer.train(batch_for)  # to the end: a finished run frees the memory its snapshots held
    assert not (snap / "process-0").exists()
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "snapshot"] == [2, 4, 6]  # 6: in the second call
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    again = RegressionTrainer({**cfg, "workdir": str(tmp_path / "run2")})
    with pytest.raises(
        ns.ConfigError, match=r"snapshots need room in .*snap .*: process 0 needs .* MiB and has 0.0 MiB free"
    ):
        again.train(batch_for)


def test_after_a_restore_of_an_older_step_the_left_branchs_snapshots_are_not_kept(
    tmp_path, monkeypatch, every_snapshot_taken
):
    """A run that restores an older step and trains on leaves a branch: its snapshots newer than the step now
    written go at that write, before it completes (a restart then would take the checkpoints), and the kept
    snapshots are the new branch's only."""
    from nnx_shard._checkpoint import storable, tree_fingerprints
    from nnx_shard._snapshots._reader import held
    from tests.apps.trainer_app import RegressionTrainer, batch_for, config

    snap = tmp_path / "snap"
    cfg = {**config(str(tmp_path / "run"), total_steps=20), "snapshot_every": 2, "snapshot_dir": str(snap)}
    trainer = RegressionTrainer(cfg)
    trainer.train(batch_for, steps=2)  # saved at its end
    trainer.train(batch_for, steps=6)  # to step 8: snapshots 6 and 8 kept
    folder = snap / "process-0"
    assert sorted(held(folder)) == [6, 8]
    trainer.restore_and_reshard(step=2)
    seen = []
    real = SnapshotWriter._open
    # what is kept when a write starts, before anything of it is written
    monkeypatch.setattr(
        SnapshotWriter, "_open", lambda w, tmp, size: seen.append(sorted(held(folder))) or real(w, tmp, size)
    )
    live = {}
    trainer.add_callback(lambda step, m, t: live.setdefault(step, tree_fingerprints(storable(t.states)[0])))
    # steps 3 to 6 of the new branch, on other data: snapshots 4 and 6
    trainer.train(lambda step: {k: v + 1.0 for k, v in batch_for(step).items()}, steps=4)
    assert seen[0] == []  # at the write of step 4, before it completed, 6 and 8 were gone
    assert sorted(held(folder)) == [4, 6]
    header, _ = unpack(np.fromfile(folder / "step-6" / "own.bin", np.uint8))
    assert shares(header) == live[6]  # the new branch's step 6


def test_each_writer_reuses_the_kept_files_and_every_snapshot_holds_its_state(tmp_path):
    """A writer keeping 2 snapshots writes into 2 files in turn, over several writers (``train()`` calls) and
    a change of size; every snapshot holds the state it was given, and a finished job's folder is gone."""
    sharding = NamedSharding(mesh_of("8"), PartitionSpec("fsdp"))

    def states(k, rows=64):
        return {"w": jax.device_put(jnp.full((rows, 64), float(k)), sharding)}

    folder, step = tmp_path / "snap", 0
    for rows in (64, 64, 128):  # one writer per train() call
        writer = SnapshotWriter(folder, keep=2)
        for _ in range(3):
            step += 1
            assert writer.write(step, states(step, rows))
            writer.wait()
            _, pieces = unpack(np.fromfile(writer.folder / f"step-{step}" / "own.bin", np.uint8))
            np.testing.assert_array_equal(assemble(pieces, {"w": [rows, 64]})["w"], np.full((rows, 64), step))
        assert sorted(p.name for p in writer.folder.iterdir()) == [f"step-{step - 1}", f"step-{step}"]
        writer.close(remove=rows == 128)
    assert not writer.folder.exists()


@pytest.mark.parametrize("processes", [2, 3, 4])
def test_every_processes_local_view_gives_the_same_collectives(tmp_path, monkeypatch, processes):
    """A model of a job of 2-4 processes over 8 steps (a snapshot every 2, skipped when busy): whatever each
    process sees locally (its last snapshot still in flight or not, at each snapshot), every process issues
    the same collectives (site, step) in the same order, since each decision is taken from agreed values.
    The processes run one after the other here, each told what the others would have put in."""
    import itertools
    import random

    from nnx_shard._snapshots import _writer

    snaps = [2, 4, 6, 8]
    combos = list(itertools.product([False, True], repeat=processes * len(snaps)))
    if len(combos) > 48:
        combos = random.Random(processes).sample(combos, 48)
    states = {"w": jnp.arange(64.0)}
    me, journal, sends = [0], [], []

    def busy(p, step):
        return combo[p * len(snaps) + snaps.index(step)]

    def agree(site, values, *, step=-1):
        journal.append((site, step))
        return np.array([[busy(p, step), values[1]] for p in range(processes)], np.int64)

    def exchange(row, dest, step):  # on CPU devices from the writer's thread, in its own order
        sends.append(("snapshot.exchange", step))
        return row

    monkeypatch.setattr(jax, "process_count", lambda: processes)
    monkeypatch.setattr(_writer, "agree", agree)
    monkeypatch.setattr(_writer, "exchange", exchange)
    monkeypatch.setattr(_writer, "place", lambda row: [row])  # no device of another process to place on
    monkeypatch.setattr(_writer, "gather_json", lambda value, **kw: [value] * processes)
    monkeypatch.setattr(
        _writer.SnapshotWriter, "in_flight", property(lambda w: w._step if busy(me[0], w._step) else None)
    )
    for k, combo in enumerate(combos):
        schedules = []
        for p in range(processes):
            me[0], journal, sends = p, [], []
            writer = _writer.SnapshotWriter(tmp_path / f"{k}-{p}")
            for step in range(1, 9):
                writer.poll(step - 1)
                if step in snaps:
                    writer._step = step
                    writer.write(step, states, skip_if_busy=True)
            writer.close(remove=True)
            schedules.append((journal, sends))
        assert all(s == schedules[0] for s in schedules), (combo, schedules)
        assert [s for site, s in schedules[0][0] if site == "snapshot.agree"] == snaps


def test_a_failure_of_ours_in_the_packing_is_raised_after_the_copys_collective_not_hidden(
    tmp_path, monkeypatch
):
    """The packing runs in the writer's thread, and on CPU devices the copy's collective goes from there
    too: an unexpected error in the packing (a bug, not a full disk) still lets the collective go, with an
    empty row, so that the peer is not left waiting in it; then it is raised on the caller's thread, and
    the snapshot is not published."""
    from nnx_shard._snapshots import _writer

    sends = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_writer, "agree", lambda site, values, **kw: np.array([[0, values[1]]] * 2, np.int64))
    monkeypatch.setattr(_writer, "gather_json", lambda value, **kw: [value] * 2)
    monkeypatch.setattr(_writer, "place", lambda row: [row])
    monkeypatch.setattr(_writer, "exchange", lambda parts, dest, step: sends.append(step) or parts)

    def broken(buf, pieces):
        raise RuntimeError("a bug in the packing")

    monkeypatch.setattr(_writer, "sum_shares", broken)
    writer = _writer.SnapshotWriter(tmp_path / "snap")
    assert writer.write(4, {"w": jnp.arange(64.0)})
    with pytest.raises(RuntimeError, match="a bug in the packing"):
        writer.wait()
    assert sends == [4] and not list(writer.folder.glob("step-*"))
    writer.close(remove=True)
