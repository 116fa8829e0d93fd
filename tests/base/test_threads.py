"""The work split that snapshot copies and fingerprints share: every item once, in order, balanced."""

import threading

from nnx_shard._base import in_threads
from nnx_shard._base._threads import balanced_shares


def test_every_item_runs_once_and_results_come_back_in_order():
    sizes = [5, 1, 9, 3, 7, 2, 8]
    ran = []
    results = in_threads(lambda k: ran.append(k) or k * k, sizes)
    assert results == [k * k for k in range(len(sizes))]
    assert sorted(ran) == list(range(len(sizes)))


def test_small_work_stays_in_the_callers_thread():
    where = in_threads(lambda k: threading.get_ident(), [10, 10, 10], serial_below=100)
    assert set(where) == {threading.get_ident()}


def test_shares_are_balanced_by_size():
    sizes = [100, 90, 10, 10, 5, 5, 1]
    shares = balanced_shares(sizes, 2)
    assert sorted(k for share in shares for k in share) == list(range(len(sizes)))
    loads = [sum(sizes[k] for k in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= 10  # 221 split 111 / 110, where in order it would be 190 / 31
