"""The work split that snapshot copies and fingerprints share: every item once, in order, balanced; the
worker a snapshot writer hands its background work to."""

import threading

from nnx_shard._base import Worker, in_threads
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


def test_a_worker_runs_its_jobs_in_turn_on_one_thread_and_submitting_does_not_wait_for_them():
    worker, go, ran = Worker("test"), threading.Event(), []
    first = worker.submit(lambda: go.wait(10) and ran.append(("first", threading.get_ident())))
    second = worker.submit(lambda: ran.append(("second", threading.get_ident())))
    assert not first.is_set() and not second.is_set() and ran == []  # both queued, the first still waiting
    go.set()
    assert second.wait(10) and first.is_set()
    assert [name for name, _ in ran] == ["first", "second"]
    assert ran[0][1] == ran[1][1] != threading.get_ident()  # one thread, not the caller's


def test_a_job_that_raises_is_reported_and_the_jobs_queued_after_it_still_run(monkeypatch):
    worker, go, ran, raised = Worker("test"), threading.Event(), [], []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(str(args.exc_value)))

    def fail():
        go.wait(10)
        raise RuntimeError("a bug in a background job")

    failed = worker.submit(fail)
    first = worker._thread
    queued = worker.submit(ran.append, "queued behind it")  # while the failing job runs
    go.set()
    assert failed.wait(10) and queued.wait(10)
    first.join(10)  # its exception is reported as the thread ends (after the next thread has started)
    assert ran == ["queued behind it"] and raised == ["a bug in a background job"]
    assert worker.submit(ran.append, "later").wait(10) and ran[-1] == "later"


def test_an_idle_worker_ends_its_thread_and_the_next_job_starts_another():
    worker, ran = Worker("test-idle", idle_s=0.05), []
    assert worker.submit(ran.append, 1).wait(10)
    for _ in range(1000):  # the thread ends once idle (a writer that is gone leaves no thread behind)
        if worker._thread is None:
            break
        threading.Event().wait(0.01)
    assert worker._thread is None and "test-idle" not in [t.name for t in threading.enumerate()]
    assert worker.submit(ran.append, 2).wait(10) and ran == [1, 2]
