"""In-memory snapshots: own shards plus a peer's copy through a JAX ppermute, per process."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from nnx_shard._checkpoint._snapshot import peers
from nnx_shard._checkpoint._snapshot_file import HEADER, unpack


def assemble(pieces: dict, shapes: dict) -> dict[str, np.ndarray]:
    out = {}
    for (path, index), data in pieces.items():
        whole = out.setdefault(path, np.zeros(shapes[path], data.dtype))
        whole[tuple(slice(a, b) for a, b in json.loads(index))] = data
    return out


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
        assert header["step"] == 9 and header["process"] == pid
        own.update(pieces)
        shapes.update({p["path"]: p["shape"] for p in header["pieces"]})
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


def test_a_snapshots_copy_goes_to_the_peer_once_its_packing_has_had_the_steps_it_took(multiprocess, tmp_path):
    """With several processes the copy to the peer waits for the packing. The first snapshot's goes before the
    next step, which waits; the later ones go as many steps later as the slowest process's last packing
    took (agreed at each snapshot, so every process sends at the same step), and the steps wait far less.
    The next train() call's writer starts from what the last one measured. The copy's program is compiled
    once."""
    results, _ = multiprocess(
        "tests.apps.snapshot_workers:exchange_when_packed", 2, devices=2, args={"folder": str(tmp_path / "s")}
    )
    first, second = (r.ok() for r in results)
    assert first["sent"] == second["sent"]  # a collective: the same steps on both
    assert first["taken"] == [True] * 5 and first["skipped"] == 0
    sent = first["sent"]
    assert sent[0] == 10  # before step 11: nothing measured yet
    # the next train() call's writer knows the last one's packing: its first copy waits for it as well
    for snapshot, step in zip((20, 30, 40, 60), sent[1:], strict=True):
        assert snapshot + 1 < step < snapshot + 10, sent  # later, and before the next snapshot is due
    for pid, r in enumerate((first, second)):
        waited = r["waited"]
        assert waited[0] >= 0.1, waited  # the packing's 0.15 s, less the step before the copy
        assert max(waited[1:]) < waited[0] / 2, waited  # a step's seconds measured between the polls
        assert r["next_call_waited"] < waited[0] / 2, r
        assert r["peers"] == [f"peer-{1 - pid}.bin"] * 2  # the 2 kept snapshots, each with the peer's copy
        assert r["programs"] == [1, 1]  # the copy's ppermute built and compiled once, for 5 lengths of copy
        # the copy for the peer made with the packing, off the step's path; what came back, after
        assert r["background"][-3:] == ["peer_copy", "peer", "publish"], r["background"]


def test_a_flipped_byte_is_refused(multiprocess, tmp_path):
    folder = tmp_path / "snap"
    [
        r.ok()
        for r in multiprocess(
            "tests.apps.snapshot_workers:write", 2, devices=2, args={"folder": str(folder)}
        )[0]
    ]
    buf = np.fromfile(folder / "process-0" / "step-9" / "own.bin", np.uint8)
    buf[HEADER + 5] ^= 0xFF  # a byte of the first piece
    with pytest.raises(ValueError, match="differs from what was written"):
        unpack(buf)


def test_peers_leave_their_failure_domain():
    assert peers(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert peers(["b", "a", "b", "a"]) == [1, 0, 3, 2]
    assert peers(["h"] * 3) == [1, 2, 0]
    dest = peers(["x", "y", "z"])
    assert sorted(dest) == [0, 1, 2] and all(d != i for i, d in enumerate(dest))


def test_the_trainer_snapshots_every_n_steps_and_refuses_to_start_without_the_memory(tmp_path, monkeypatch):
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
    assert header["step"] == 4 and {p["path"] for p in header["pieces"]} == set(live[4])
    # written while steps 5 and on ran, the snapshot is of the step it claims: its shares sum to step 4's
    sums = {}
    for p in header["pieces"]:
        sums[p["path"]] = (sums.get(p["path"], 0) + p["share"]) % 2**32
    assert {path: f"{v:08x}" for path, v in sums.items()} == live[4] != live[5]
    trainer.train(batch_for)  # to the end: a finished run frees the memory its snapshots held
    assert not (snap / "process-0").exists()
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "snapshot"] == [2, 4, 6]  # 6: in the second call
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    again = RegressionTrainer({**cfg, "workdir": str(tmp_path / "run2")})
    with pytest.raises(ns.ConfigError, match=r"snapshots need .* MiB in .*snap .* and 0.0 MiB are free"):
        again.train(batch_for)


def test_after_a_restore_of_an_older_step_the_left_branchs_snapshots_are_not_kept(tmp_path, monkeypatch):
    """A run that restores an older step and trains on leaves a branch: its snapshots newer than the step now
    written go at that write, before it completes (a restart then would take the checkpoints), and the kept
    snapshots are the new branch's only."""
    from nnx_shard._checkpoint import _snapshot, storable, tree_fingerprints
    from nnx_shard._checkpoint._snapshot_read import held
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
    real = _snapshot.SnapshotWriter._reuse
    # what is kept when a write starts, before anything of it is written
    monkeypatch.setattr(
        _snapshot.SnapshotWriter, "_reuse", lambda w, tmp: seen.append(sorted(held(folder))) or real(w, tmp)
    )
    live = {}
    trainer.add_callback(lambda step, m, t: live.setdefault(step, tree_fingerprints(storable(t.states)[0])))
    # steps 3 to 6 of the new branch, on other data: snapshots 4 and 6
    trainer.train(lambda step: {k: v + 1.0 for k, v in batch_for(step).items()}, steps=4)
    assert seen[0] == []  # at the write of step 4, before it completed, 6 and 8 were gone
    assert sorted(held(folder)) == [4, 6]
    header, _ = unpack(np.fromfile(folder / "step-6" / "own.bin", np.uint8))
    sums = {}
    for p in header["pieces"]:
        sums[p["path"]] = (sums.get(p["path"], 0) + p["share"]) % 2**32
    assert {path: f"{v:08x}" for path, v in sums.items()} == live[6]  # the new branch's step 6


def test_a_snapshot_restores_onto_more_processes_than_it_had(tmp_path, multiprocess):
    import jax

    import nnx_shard as ns
    from nnx_shard._checkpoint._snapshot import SnapshotWriter
    from tests.apps.snapshot_workers import _states

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


def test_shares_summed_by_the_devices_when_the_copy_leaves_them_are_the_bytes_shares(tmp_path, monkeypatch):
    """As on a GPU: the shards' copies to host memory are asynchronous, and each piece's fingerprint share is
    summed on its device before the next step; the header then holds what the bytes give (unpack checks)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from nnx_shard._checkpoint import _snapshot, _snapshot_file, tree_fingerprints
    from tests.helpers import mesh_of

    mesh = mesh_of("8")
    states = {
        "w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh, PartitionSpec("fsdp"))),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, PartitionSpec())),
    }
    calls = []
    monkeypatch.setattr(_snapshot, "host_memory", lambda data: jnp.copy(data))  # a copy, not the buffer
    real = _snapshot.device_shares
    monkeypatch.setattr(_snapshot, "device_shares", lambda blocks: calls.append(len(blocks)) or real(blocks))
    writer = _snapshot.SnapshotWriter(tmp_path / "snap")
    assert writer.write(3, states)
    writer.wait()
    assert calls == [9]  # 8 blocks of w, the one replica-0 copy of b
    header, _ = _snapshot_file.unpack(np.fromfile(writer.folder / "step-3" / "own.bin", np.uint8))
    sums = {}
    for p in header["pieces"]:
        sums[p["path"]] = (sums.get(p["path"], 0) + p["share"]) % 2**32
    assert {k: f"{v:08x}" for k, v in sums.items()} == tree_fingerprints(states)
    writer.close(remove=True)


def test_with_room_on_the_devices_each_copies_its_shards_and_sums_their_shares_in_one_program(
    tmp_path, monkeypatch
):
    """As on a GPU with free memory: each device copies its shards within its memory and sums their shares
    in one program, compiled ahead by ``prepare``; the copies then leave for the host in the background. The
    file holds the state's bytes, and its shares add up to the state's fingerprints."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from nnx_shard._base import CompiledAhead
    from nnx_shard._checkpoint import _snapshot, _snapshot_file, _snapshot_stage, tree_fingerprints
    from tests.helpers import mesh_of

    mesh = mesh_of("8")
    states = {
        "w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh, PartitionSpec("fsdp"))),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, PartitionSpec())),
        "n": jax.device_put(jnp.arange(16, dtype=jnp.int8), NamedSharding(mesh, PartitionSpec("fsdp"))),
    }
    monkeypatch.setattr(_snapshot, "_accelerated", lambda shards: True)
    monkeypatch.setattr(_snapshot_stage, "has_room", lambda shards, groups=None: True)
    monkeypatch.setattr(_snapshot, "device_shares", lambda blocks: pytest.fail("not staged"))
    monkeypatch.setattr(_snapshot_stage, "_COMPILED", CompiledAhead("snapshot"))
    monkeypatch.setattr(_snapshot_stage, "CHUNK_BYTES", 3 * 64 * 4)  # w's shards leave in 3 + 3 + 2 rows
    writer = _snapshot.SnapshotWriter(tmp_path / "snap")
    writer.prepare(states)
    writer._staging._thread.join()
    assert len(_snapshot_stage._COMPILED) == 8  # one program per device, compiled ahead
    again = _snapshot.SnapshotWriter(tmp_path / "snap")
    again.prepare(states)
    assert again._staging._thread is None  # a later train() call's writer finds them
    made = []  # what each staging queued, read before the background sends (and drops) the chunks

    def stage(self, shards, layout=None, real=_snapshot_stage.Staging.stage):
        staged = real(self, shards, layout)
        made.append([[(at, c.unsafe_buffer_pointer()) for at, c in chunks] for chunks in staged.chunks])
        return staged

    monkeypatch.setattr(_snapshot_stage.Staging, "stage", stage)
    assert writer.write(3, states)
    shards = _snapshot_file.own_shards(states)
    assert len(made) == 1 and len(made[0]) == 8 + 1 + 8
    w = [chunks for chunks, (path, _, _, _) in zip(made[0], shards, strict=True) if path == "w"]
    assert [[at for at, _ in chunks] for chunks in w] == [[0, 3 * 256, 6 * 256]] * 8
    for chunks, (_, _, data, _) in zip(made[0], shards, strict=True):
        assert all(pointer != data.unsafe_buffer_pointer() for _, pointer in chunks)  # copies
    writer.wait()
    # the next snapshot of new values, laid out as the last: the remembered plan, the new bytes and shares
    later = jax.tree.map(lambda x: (x * 3 + 1).astype(x.dtype), states)
    assert writer.write(4, later)
    writer.wait()
    assert writer.write(5, states)  # into step 3's file, its pages mapped when step 4 was done
    writer.wait()
    assert sorted(p.name for p in writer.folder.iterdir()) == ["step-4", "step-5"]
    for step, values in ((4, later), (5, states)):
        header, pieces = _snapshot_file.unpack(
            np.fromfile(writer.folder / f"step-{step}" / "own.bin", np.uint8)
        )
        sums = {}
        for p in header["pieces"]:
            sums[p["path"]] = (sums.get(p["path"], 0) + p["share"]) % 2**32
        assert {k: f"{v:08x}" for k, v in sums.items()} == tree_fingerprints(values)
        whole = assemble(pieces, {p["path"]: p["shape"] for p in header["pieces"]})
        for path, value in values.items():
            np.testing.assert_array_equal(whole[path], np.asarray(value))
    # the step queued the devices' programs; the copies left for the host, and the shares were read, after
    phases = writer.phases
    assert list(phases["on_the_steps_path"]) == ["layout", "stage", "thread"]  # the folder: after the step
    # the waits for the transfers apart from the copies into the file
    background = ["folder", "map", "to_host", "into_file", "shares", "header", "publish"]
    assert list(phases["in_the_background"]) == background
    writer.close(remove=True)


def test_a_remembered_layout_gives_the_new_states_shards_and_a_changed_one_is_laid_out_again():
    """``Layouts``: what ``own_shards`` and ``layout`` give, the shards of the state passed (never the last
    one's), with one key while the layout stays; a new sharding is laid out again."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnx_shard._checkpoint import _snapshot_file
    from tests.helpers import mesh_of

    mesh = mesh_of("8")

    def state(scale, spec=("fsdp",)):
        w = jax.device_put(jnp.arange(128.0).reshape(16, 8) * scale, NamedSharding(mesh, P(*spec)))
        b = jax.device_put(jnp.ones(4) * scale, NamedSharding(mesh, P()))  # replicated: one copy
        return nnx.State({"w": nnx.Param(w), "b": nnx.Param(b), "rng": jax.random.key(scale), "n": 3})

    layouts = _snapshot_file.Layouts()
    first, second = state(1), state(2)
    got = [layouts(s) for s in (first, second)]
    for (shards, pieces, size, _), s in zip(got, (first, second), strict=True):
        expected = _snapshot_file.own_shards(s)
        assert [(p, i, sh) for p, i, _, sh in shards] == [(p, i, sh) for p, i, _, sh in expected]
        for (_, _, data, _), (_, _, want, _) in zip(shards, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(data), np.asarray(want))  # this state's values
        assert (pieces, size) == _snapshot_file.layout(expected)
    assert got[0][3] == got[1][3] and got[0][1] is not got[1][1]  # one layout; the pieces new dicts
    assert [p for p, *_ in got[0][0]].count("b") == 1 and "rng" in [p for p, *_ in got[0][0]]
    moved = layouts(state(1, (None, "fsdp")))
    assert moved[3] != got[0][3]
    assert [i for p, i, *_ in moved[0] if p == "w"] == [[[0, 16], [k, k + 1]] for k in range(8)]
    # a Variable without a value has no leaf in a plain flatten: the leaves are walked as Variables then
    for scale in (4, 5):
        holed = nnx.State({**state(scale), "none": nnx.Param(None)})
        shards = layouts(holed)[0]
        assert [np.asarray(d).sum() for *_, d, _ in shards] == [
            np.asarray(d).sum() for *_, d, _ in _snapshot_file.own_shards(holed)
        ]


def test_a_snapshots_phases_say_where_its_time_went(tmp_path, monkeypatch):
    """``SnapshotWriter.phases``: the last finished snapshot's seconds by phase, on the step's path and in the
    background. A slow phase shows where it is: here the shares, which the CPU sums from the bytes."""
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from nnx_shard._checkpoint import _snapshot
    from tests.helpers import mesh_of

    states = {"w": jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh_of("8"), PartitionSpec("fsdp")))}
    real = _snapshot.header_bytes

    def slow(*args):
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(_snapshot, "header_bytes", slow)
    writer = _snapshot.SnapshotWriter(tmp_path / "snap")
    assert writer.phases == {}  # none finished yet
    began = time.perf_counter()
    writer.write(1, states)
    on_path = time.perf_counter() - began
    writer.wait()
    total = time.perf_counter() - began
    on, background = writer.phases["on_the_steps_path"], writer.phases["in_the_background"]
    # CPU devices: the step copies into the file (before the next step may donate the buffers)
    assert list(on) == ["layout", "to_host_started", "folder", "copy", "thread"]
    assert list(background) == ["map", "to_host", "shares", "header", "publish"]
    assert all(v >= 0 for v in [*on.values(), *background.values()])
    assert sum(on.values()) <= on_path and sum(background.values()) <= total
    assert max(background, key=background.get) == "shares" and background["shares"] >= 0.3
    writer.close(remove=True)


def test_staging_needs_room_on_every_device():
    """The CPU keeps no allocator statistics: no staging there; a device whose free memory cannot hold the
    copies is not staged either (the snapshot copies from the live buffers)."""
    import jax.numpy as jnp

    from nnx_shard._checkpoint import _snapshot_stage
    from nnx_shard._checkpoint._snapshot_file import own_shards

    shards = own_shards({"w": jnp.ones((256, 256))})
    assert not _snapshot_stage.has_room(shards)

    class Device:
        platform = "gpu"

        def __init__(self, free):
            self.free = free

        def memory_stats(self):
            return {"bytes_limit": self.free + 100, "bytes_in_use": 100}

    class Data:
        nbytes = 2**20

        def __init__(self, device):
            self.device = device

        def devices(self):
            return {self.device}

    roomy, tight = Device(2**22), Device(2**20)
    assert _snapshot_stage.has_room([("w", [[0, 1]], Data(roomy), (1,))])
    both = [("w", [[0, 1]], Data(roomy), (1,)), ("v", [[0, 1]], Data(tight), (1,))]
    assert not _snapshot_stage.has_room(both)


def test_a_transfer_that_fails_in_the_background_loses_that_snapshot_only(tmp_path, monkeypatch, caplog):
    """The runtime refusing a chunk's transfer to the host (no pinned memory left, say) is logged when the
    writer next waits; that snapshot is not published, and the next one is written whole."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from nnx_shard._checkpoint import _snapshot, _snapshot_file, _snapshot_stage, tree_fingerprints
    from tests.helpers import mesh_of

    states = {
        "w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh_of("8"), PartitionSpec()))
    }
    monkeypatch.setattr(_snapshot, "_accelerated", lambda shards: True)
    monkeypatch.setattr(_snapshot_stage, "has_room", lambda shards, groups=None: True)
    real = _snapshot_stage.host_memory

    def refuse(chunk):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: no pinned host memory for a transfer")

    monkeypatch.setattr(_snapshot_stage, "host_memory", refuse)
    writer = _snapshot.SnapshotWriter(tmp_path / "snap")
    assert writer.write(1, states)
    with caplog.at_level("WARNING", logger="nnx_shard"):
        writer.wait()
    assert "the snapshot of step 1 could not be written: RESOURCE_EXHAUSTED" in caplog.text
    assert not (writer.folder / "step-1").exists()
    monkeypatch.setattr(_snapshot_stage, "host_memory", real)
    assert writer.write(2, states)
    writer.wait()
    header, _ = _snapshot_file.unpack(np.fromfile(writer.folder / "step-2" / "own.bin", np.uint8))
    assert header["step"] == 2
    assert {p["path"]: f"{p['share']:08x}" for p in header["pieces"]} == tree_fingerprints(states)
    writer.close(remove=True)


def test_a_devices_pinned_host_memory_is_looked_up_once_and_none_where_it_has_none():
    """The copies of a snapshot leave in many chunks: each device's ``pinned_host`` target is found once."""
    import jax

    from nnx_shard._checkpoint._snapshot_file import _pinned

    device = jax.devices()[0]
    pinned = _pinned(device)
    assert pinned.memory_kind == "pinned_host" and pinned.device_set == {device}
    assert _pinned(device) is pinned

    class Bare:  # a device that knows no memory kinds: its shards are read where they are
        def addressable_memories(self):
            raise NotImplementedError

    assert _pinned(Bare()) is None


def _mapped_snapshot_files(folder) -> list[str]:
    """The files under ``folder`` this process has mapped (``/proc/self/maps``), deleted ones marked so."""
    lines = open("/proc/self/maps").read().splitlines()
    return sorted({line.split(None, 5)[5] for line in lines if str(folder) in line})


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_each_snapshot_file_is_mapped_once_and_unmapped_when_it_is_no_longer_kept(tmp_path, monkeypatch):
    """A writer keeping 2 snapshots writes into 2 files in turn: each is mapped once (the next ``train()``
    call's writer finds them too), every snapshot holds the state it was given, a new size is mapped
    again, and a file no longer kept, or a finished job's, is unmapped (its memory freed)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from nnx_shard._checkpoint import _snapshot, _snapshot_file
    from tests.helpers import mesh_of

    made = []
    real = _snapshot_file.mapped
    monkeypatch.setattr(
        _snapshot_file, "mapped", lambda path, size, **kw: made.append(size) or real(path, size, **kw)
    )
    sharding = NamedSharding(mesh_of("8"), PartitionSpec("fsdp"))

    def states(k, rows=64):
        return {"w": jax.device_put(jnp.full((rows, 64), float(k)), sharding)}

    folder = tmp_path / "snap"
    step = 0
    for _ in range(3):  # one writer per train() call
        writer = _snapshot.SnapshotWriter(folder, keep=2)
        for _k in range(3):
            step += 1
            assert writer.write(step, states(step))
            writer.wait()
            _, pieces = unpack(np.fromfile(writer.folder / f"step-{step}" / "own.bin", np.uint8))
            np.testing.assert_array_equal(assemble(pieces, {"w": [64, 64]})["w"], np.full((64, 64), step))
        assert _mapped_snapshot_files(folder) == sorted(
            str(writer.folder / f"step-{s}" / "own.bin") for s in (step - 1, step)
        )
        writer.close(remove=False)
    assert len(made) == 2  # the two files, once each: 9 snapshots over 3 writers
    writer = _snapshot.SnapshotWriter(folder, keep=2)
    assert writer.write(step + 1, states(7, rows=128))  # a new size: mapped again, the old mapping let go
    writer.wait()
    _, pieces = unpack(np.fromfile(writer.folder / f"step-{step + 1}" / "own.bin", np.uint8))
    np.testing.assert_array_equal(assemble(pieces, {"w": [128, 64]})["w"], np.full((128, 64), 7.0))
    assert len(made) == 3 and not any("deleted" in f for f in _mapped_snapshot_files(folder))
    writer.close(remove=True)
    assert _mapped_snapshot_files(folder) == []


def test_the_copy_for_the_peer_is_padded_to_whole_mebibytes_and_comes_back_as_it_was():
    """``outgoing``: the file's parts one after the other, padded with zeros to a multiple of ``ROW_STEP``
    (one shape from one snapshot to the next, so that the ``ppermute`` compiles once); what ``received``
    gives is the parts' bytes (one process: its own peer)."""
    from nnx_shard._checkpoint._snapshot_peer import ROW_STEP, exchange, outgoing, received

    shards = np.arange(ROW_STEP + 5, dtype=np.int64).astype(np.uint8)
    parts = [shards, np.frombuffer(b'{"step": 3}', np.uint8)]
    row, size = outgoing(parts)
    assert row.shape == (1, 2 * ROW_STEP) and size == ROW_STEP + 5 + 11 and not row[0, size:].any()
    assert bytes(received(exchange((row, size), [0]))) == b"".join(p.tobytes() for p in parts)
