"""The device copy (GPUs, TPUs): each device copies its shards within its memory and sums their shares in one
program; the copies leave for the host in the background. Run here on CPU devices made to look roomy."""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import nnx_shard as ns
from nnx_shard._checkpoint import tree_fingerprints
from nnx_shard._snapshots import SnapshotWriter, _device, _file, own_shards
from tests.helpers import mesh_of
from tests.snapshots.test_file import assemble, shares


def staged_writer(tmp_path, monkeypatch) -> SnapshotWriter:
    monkeypatch.setattr(_device, "has_room", lambda shards, work=None: True)
    return SnapshotWriter(tmp_path / "snap")


def test_staged_snapshots_hold_each_steps_values_and_shares(tmp_path, monkeypatch):
    """Each snapshot holds the values it was given, even when the next step overwrites (donates) the live
    buffers right after ``write`` returns: the devices' copies are new buffers, not the live ones."""
    mesh = mesh_of("8")
    states = {
        "w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh, PartitionSpec("fsdp"))),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, PartitionSpec())),
        "n": jax.device_put(jnp.arange(16, dtype=jnp.int8), NamedSharding(mesh, PartitionSpec("fsdp"))),
    }
    monkeypatch.setattr(_device, "CHUNK_BYTES", 3 * 64 * 4)  # w's shards leave in 3 + 3 + 2 rows
    writer = staged_writer(tmp_path, monkeypatch)
    later = jax.tree.map(lambda x: (x * 3 + 1).astype(x.dtype), states)
    expected = {3: jax.tree.map(np.asarray, states), 4: jax.tree.map(np.asarray, later)}
    assert writer.write(3, states)
    for x in jax.tree.leaves(states):
        x.delete()  # as a donating step would
    assert writer.write(4, later)
    writer.wait()
    for step in (3, 4):
        header, pieces = _file.unpack(np.fromfile(writer.folder / f"step-{step}" / "own.bin", np.uint8))
        whole = assemble(pieces, {p.path: p.shape for p in header.pieces})
        for path, value in expected[step].items():
            np.testing.assert_array_equal(whole[path], value)
    header, _ = _file.unpack(np.fromfile(writer.folder / "step-4" / "own.bin", np.uint8))
    assert shares(header) == tree_fingerprints(later)
    writer.close(remove=True)


def test_staging_needs_room_on_every_device():
    """The CPU keeps no allocator statistics: no staging there; a device whose free memory cannot hold the
    copies is not staged either (the snapshot copies from the live buffers on the step)."""
    assert not _device.has_room(own_shards({"w": jnp.ones((256, 256))}))

    class Device:
        platform = "gpu"

        def __init__(self, free):
            self.free = free

        def memory_stats(self):
            return {"bytes_limit": self.free + 100, "bytes_in_use": 100}

    class Data:
        nbytes, shape, dtype = 2**20, (2**18,), jnp.dtype("float32")

        def __init__(self, device):
            self.device = device

        def devices(self):
            return {self.device}

    roomy, tight = Device(2**22), Device(2**20)
    assert _device.has_room([_file.Shard("w", [[0, 1]], Data(roomy), (1,))])
    both = [_file.Shard("w", [[0, 1]], Data(roomy), (1,)), _file.Shard("v", [[0, 1]], Data(tight), (1,))]
    assert not _device.has_room(both)


def test_a_transfer_that_fails_in_the_background_loses_that_snapshot_only(tmp_path, monkeypatch, caplog):
    """The runtime refusing a copy's transfer to the host (no host memory left, say) is logged when the
    writer next waits; that snapshot is not published, and the next one is written whole."""
    states = {
        "w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh_of("8"), PartitionSpec()))
    }
    writer = staged_writer(tmp_path, monkeypatch)
    real = _device.to_host

    def refuse(copy):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: no host memory for a transfer")

    monkeypatch.setattr(_device, "to_host", refuse)
    assert writer.write(1, states)
    with caplog.at_level("WARNING", logger="nnx_shard"):
        writer.wait()
    assert "the snapshot of step 1 could not be written: RESOURCE_EXHAUSTED" in caplog.text
    assert not (writer.folder / "step-1").exists()
    monkeypatch.setattr(_device, "to_host", real)
    assert writer.write(2, states)
    writer.wait()
    header, _ = _file.unpack(np.fromfile(writer.folder / "step-2" / "own.bin", np.uint8))
    assert header.step == 2 and shares(header) == tree_fingerprints(states)
    writer.close(remove=True)


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu extra)"
)


def _readers(hlo: str) -> dict[int, int]:
    """How many instructions of the entry computation read each of its parameters."""
    entry = hlo[hlo.index("\nENTRY") :].splitlines()[1:]
    names = {}
    for line in entry:
        found = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = .* parameter\((\d+)\)", line)
        if found:
            names[int(found.group(2))] = found.group(1)
    return {
        k: sum(1 for line in entry if re.search(re.escape(name) + r"(?![\w.-])", line.split(" = ", 1)[-1]))
        for k, name in names.items()
    }


@needs_libtpu
def test_on_tpus_a_snapshot_stage_reads_each_shard_once():
    """Compiled for one v5e chip: each shard's copy, in chunks or whole, and its fingerprint share come from
    one read of it (the share summed over the chunks XLA is writing), not a copy and then a second pass."""
    from jax.sharding import SingleDeviceSharding

    from nnx_shard._snapshots import _device as stage

    device = ns.cluster.tpu_devices("v5e:2x2")[0]
    shards = [
        ((4096, 4096), jnp.float32),
        ((1024, 8192), jnp.bfloat16),
        ((4096,), jnp.float32),
        ((), jnp.int32),
    ]
    key = tuple((shape, 0, stage._rows(shape, jnp.dtype(dtype).itemsize)) for shape, dtype in shards)
    assert len(key[0][2]) == 2  # 64 MiB: two chunks of 32 MiB
    args = [
        jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device)) for shape, dtype in shards
    ]
    readers = _readers(stage._program(key).lower(args).compile().as_text())
    assert readers == {k: 1 for k in range(len(shards))}
