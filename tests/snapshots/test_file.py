"""A snapshot file: typed pieces and header, each piece's share of its array's fingerprint, damage named."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_shard._checkpoint import tree_fingerprints
from nnx_shard._snapshots import SnapshotWriter, _file
from tests.helpers import mesh_of


def assemble(pieces: dict, shapes: dict) -> dict[str, np.ndarray]:
    """The whole arrays from ``unpack``'s pieces."""
    out = {}
    for (path, index), data in pieces.items():
        whole = out.setdefault(path, np.zeros(shapes[path], data.dtype))
        whole[tuple(slice(a, b) for a, b in json.loads(index))] = data
    return out


def shares(header: _file.Header) -> dict[str, str]:
    """Each array's fingerprint, from its pieces' shares."""
    sums: dict[str, int] = {}
    for p in header.pieces:
        sums[p.path] = (sums.get(p.path, 0) + p.share) % 2**32
    return {k: f"{v:08x}" for k, v in sums.items()}


def written(tmp_path, states, step=3):
    writer = SnapshotWriter(tmp_path / "snap")
    assert writer.write(step, states)
    writer.wait()
    return writer, np.fromfile(writer.folder / f"step-{step}" / "own.bin", np.uint8)


def test_a_file_holds_the_state_and_its_pieces_add_up_to_the_fingerprints(tmp_path):
    mesh = mesh_of("8")
    states = {
        "w": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh, P("fsdp"))),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P())),
        "n": jax.device_put(jnp.arange(16, dtype=jnp.int8), NamedSharding(mesh, P("fsdp"))),
    }
    writer, buf = written(tmp_path, states)
    header, pieces = _file.unpack(buf)
    assert header.step == 3 and header.process == 0 and len(header.pieces) == 8 + 1 + 8  # b: replica 0 only
    assert all(isinstance(p, _file.Piece) and p.offset % _file.ALIGN == 0 for p in header.pieces)
    assert shares(header) == tree_fingerprints(states)
    whole = assemble(pieces, {p.path: p.shape for p in header.pieces})
    for path, value in states.items():
        np.testing.assert_array_equal(whole[path], np.asarray(value))
    writer.close(remove=True)


@pytest.mark.parametrize("where", ["piece", "header"])
def test_damage_is_named(tmp_path, where):
    """A flipped byte of a piece is named by its path and block; a cut header does not parse."""
    states = {"w": jax.device_put(jnp.arange(256.0), NamedSharding(mesh_of("8"), P("fsdp")))}
    writer, buf = written(tmp_path, states)
    if where == "piece":
        buf[_file.HEADER + 5] ^= 0xFF  # a byte of the first piece
        with pytest.raises(ValueError, match=r"snapshot piece w \[\[0, 32\]\] differs from what was written"):
            _file.unpack(buf)
    else:
        with pytest.raises(ValueError):  # json's error is a ValueError; the reader names the file
            _file.unpack(buf[:-3])
    writer.close(remove=True)


def test_the_header_bound_holds_whatever_the_shares_are():
    """The width every process agrees on for the peer's copy comes from ``Header.bound``: never less than
    the header once its shares are summed."""
    pieces = [
        _file.Piece("a/b", [[4 * k, 4 * k + 4], [0, 2]], [12, 2], "float32", 64 * k, 32) for k in range(3)
    ]
    header = _file.Header(12, 0, pieces, {"pos": "x" * 10})
    bound = header.bound(_file.widest_bytes(pieces))
    for share in (0, 7, 2**32 - 1):
        for p in header.pieces:
            p.share = share
        assert len(header.to_bytes()) <= bound
    assert len(header.to_bytes()) == bound  # each share at its widest: exactly
    assert _file.Header.from_bytes(header.to_bytes()) == header


def test_a_remembered_layout_gives_the_new_states_shards_and_a_changed_one_is_laid_out_again():
    """``Layouts``: the shards of the state passed (never the last one's), one key while the layout stays; a
    new sharding is laid out again; a typed key is stored as its key data, a replicated array once."""
    mesh = mesh_of("8")

    def state(scale, spec=("fsdp",)):
        w = jax.device_put(jnp.arange(128.0).reshape(16, 8) * scale, NamedSharding(mesh, P(*spec)))
        b = jax.device_put(jnp.ones(4) * scale, NamedSharding(mesh, P()))
        return nnx.State({"w": nnx.Param(w), "b": nnx.Param(b), "rng": jax.random.key(scale), "n": 3})

    layouts = _file.Layouts()
    first, second = state(1), state(2)
    got = [(*layouts(s), layouts.key) for s in (first, second)]
    for (shards, pieces, size, _), s in zip(got, (first, second), strict=True):
        expected = _file.own_shards(s)
        assert [(x.path, x.index, x.shape) for x in shards] == [(x.path, x.index, x.shape) for x in expected]
        for a, b in zip(shards, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))  # this state's values
        assert (pieces, size) == tuple(_file.Layouts()(s)[1:])  # as laid out afresh
    assert got[0][3] == got[1][3] and got[0][1] is not got[1][1]
    assert [x.path for x in got[0][0]].count("b") == 1 and "rng" in [x.path for x in got[0][0]]
    moved = (*layouts(state(1, (None, "fsdp"))), layouts.key)
    assert moved[3] != got[0][3]
    assert [x.index for x in moved[0] if x.path == "w"] == [[[0, 16], [k, k + 1]] for k in range(8)]
    # a Variable without a value has no leaf in a plain flatten: the leaves are walked as Variables then
    for scale in (4, 5):
        holed = nnx.State({**state(scale), "none": nnx.Param(None)})
        shards = layouts(holed)[0]
        total = sum(float(np.asarray(s.data).sum()) for s in shards if s.path == "w")
        assert total == float(np.arange(128.0).sum() * scale)
