"""The peer exchange: a ring over failure domains, and rows of an agreed width that carry their length."""

from __future__ import annotations

import numpy as np
import pytest

from nnx_shard._snapshots._peer import (
    PART_BYTES,
    PREFIX,
    ROW_STEP,
    exchange,
    outgoing,
    peers,
    place,
    received,
    row_width,
)


def test_peers_leave_their_failure_domain():
    assert peers(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert peers(["b", "a", "b", "a"]) == [1, 0, 3, 2]
    assert peers(["h"] * 3) == [1, 2, 0]
    dest = peers(["x", "y", "z"])
    assert sorted(dest) == [0, 1, 2] and all(d != i for i, d in enumerate(dest))


def test_a_row_carries_its_copy_and_length_and_comes_back_as_it_was():
    """``outgoing``: the length, the file's parts one after the other, zeros to the agreed width (one shape
    from one snapshot to the next, so that the ``ppermute`` compiles once); ``received`` gives the parts'
    bytes (one process: its own peer). A copy wider than agreed is not sent; an empty row says none."""
    shards = np.arange(ROW_STEP + 5, dtype=np.int64).astype(np.uint8)
    parts = [shards, np.frombuffer(b'{"step": 3}', np.uint8)]
    size = ROW_STEP + 5 + 11
    width = row_width(size)
    assert width == 2 * ROW_STEP and row_width(ROW_STEP - PREFIX) == ROW_STEP
    row = outgoing(parts, width)
    assert row.shape == (1, width) and not row[0, PREFIX + size :].any()
    assert bytes(received(exchange(place(row), [0], step=3))) == b"".join(p.tobytes() for p in parts)
    with pytest.raises(ValueError, match=f"wider than the {ROW_STEP} bytes agreed"):
        outgoing(parts, ROW_STEP)
    assert received(exchange(place(outgoing([], width)), [0], step=3)).size == 0


def test_a_row_wider_than_a_part_travels_in_parts_and_comes_back_whole():
    """A row goes in parts of at most ``PART_BYTES`` (one ``ppermute`` each); what comes back is the copy as
    it was, its length read from the first part."""
    copy = np.random.default_rng(0).integers(0, 256, 2 * PART_BYTES + 3, dtype=np.uint8)
    width = row_width(copy.size)
    sent = place(outgoing([copy], width))
    assert [p.shape[1] for p in sent] == [PART_BYTES, PART_BYTES, width - 2 * PART_BYTES]
    np.testing.assert_array_equal(received(exchange(sent, [0], step=1)), copy)
