"""Where a data iterator stopped, carried to a run on another number of processes (unit level; the real
process-count changes are in tests/cluster/test_launch.py)."""

from __future__ import annotations

import grain
import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard._trainer._data import Batches, is_elastic

ROWS = 6


def numbered(shard: int = 0, shards: int = 1) -> grain.experimental.ElasticIterator:
    ds = grain.MapDataset.range(1000).map(lambda i: {"id": np.int32(i)})
    return grain.experimental.ElasticIterator(ds, ROWS, grain.sharding.ShardOptions(shard, shards))


def test_grain_elastic_iterators_are_recognised_and_per_process_ones_are_not():
    assert is_elastic(numbered()) and is_elastic(iter(numbered()))
    per_process = grain.MapDataset.range(10).batch(2).to_iter_dataset()
    assert not is_elastic(per_process) and not is_elastic(iter(per_process))


def test_a_position_saved_by_two_processes_resumes_one_at_the_next_global_example():
    # two processes read 3 rows each of the 6-row global batches; both saved after 4 steps
    writers = [iter(numbered(p, 2)) for p in range(2)]
    for _ in range(4):
        rows = [next(w)["id"] for w in writers]
    assert sorted(np.concatenate(rows)) == list(range(18, 24))
    saved = [w.get_state() for w in writers]
    batches = Batches(numbered(), saved)  # one process now
    assert batches.resumed and list(batches.next(4)["id"]) == list(range(24, 30))


def test_an_iterator_that_cannot_be_remapped_starts_again_and_says_so():
    per_process = grain.MapDataset.range(100).batch(3).to_iter_dataset()
    it = iter(per_process)
    next(it)
    saved = [it.get_state(), it.get_state()]
    with pytest.warns(ns.DataPositionWarning, match=r"saved by 2 processes and this run has 1.*not elastic"):
        batches = Batches(per_process, saved)
    assert not batches.resumed and list(batches.next(0)) == [0, 1, 2]  # from its beginning
    # an elastic iterator whose processes stopped at different places cannot choose one either
    states = [{"global_next_index": 12}, {"global_next_index": 18}]
    with pytest.warns(ns.DataPositionWarning, match="saved 2 different positions"):
        assert not Batches(numbered(), states).resumed


def test_the_same_process_count_takes_its_own_state_and_a_callable_needs_none():
    it = iter(numbered())
    next(it)
    assert Batches(numbered(), [it.get_state()]).next(1)["id"][0] == ROWS
    assert Batches(lambda step: step, [{"global_next_index": 6}]).next(3) == 3


def test_an_elastic_iterator_moves_onto_a_new_data_shard_at_its_global_position():
    # a Trainer resized off a process: the reader of shard 0 of 2 reads the whole global batch, and back
    data = numbered(0, 2)
    first = Batches(data, None, shard=ns.cluster.DataShard(0, 2))
    assert list(first.next(0)["id"]) == [0, 2, 4]  # 3 of the 6 rows of step 1
    alone = Batches(data, None, shard=ns.cluster.DataShard(0, 1))
    assert list(alone.next(1)["id"]) == list(range(6, 12))  # the whole of step 2, none skipped
    again = Batches(data, None, shard=ns.cluster.DataShard(1, 2))
    assert list(again.next(2)["id"]) == [13, 15, 17]
    assert data.get_state() == {"global_next_index": 18}


def test_an_elastic_iterator_that_cannot_move_says_so_and_reshard_is_asked_otherwise():
    class Steps:
        elastic = True

        def __iter__(self):
            return self

        def __next__(self):
            return {"id": np.zeros(3)}

    with pytest.warns(ns.DataPositionWarning, match=r"cannot be moved onto data shard 1 of 2.*reshard"):
        Batches(Steps(), None, shard=ns.cluster.DataShard(1, 2))

    class Movable(Steps):
        def reshard(self, shard_index, shard_count):
            self.shard = (shard_index, shard_count)

    movable = Movable()
    Batches(movable, None, shard=ns.cluster.DataShard(1, 3))
    assert movable.shard == (1, 3)


def test_data_shard_names_the_rows_a_process_reads(any_mesh):
    # one process holds every row; the two-process cases are in tests/live/test_resize.py
    assert ns.cluster.data_shard(any_mesh) == ns.cluster.DataShard(0, 1)
    assert ns.cluster.data_shard(any_mesh, process=3) is None  # no device of the mesh: it reads nothing
