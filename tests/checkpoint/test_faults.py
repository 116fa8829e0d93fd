"""A failed read leaves no dependency's traceback behind: its abandoned TensorStore reads, which come back
after Orbax closed their event loop, are logged, not printed; other unraisables still are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What Orbax does on a damaged checkpoint: one task per read in a fresh event loop; the first failure ends
# the loop and closes it while the other reads are still in flight in TensorStore. Each of those calls back
# into the closed loop when it finishes, and TensorStore reports that as an unraisable RuntimeError. Here
# TensorStore's own promises stand for the reads in flight, kept after the loop closed: no race with a disk.
CHILD = """
import asyncio, sys
import tensorstore as ts
from nnx_shard._checkpoint._faults import quiet

pending = [ts.Promise.new() for _ in range(8)]  # reads in flight: each finishes when its promise is kept

async def _wait(future):
    await future

async def reads():
    tasks = [asyncio.ensure_future(_wait(future)) for _, future in pending]
    await asyncio.sleep(0)  # every read awaited
    raise OSError("DATA_LOSS: a damaged file")

def failed_read():
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(reads())
    finally:
        loop.close()

try:
    if sys.argv[1] == "quiet":
        with quiet():
            failed_read()
    else:
        failed_read()
except OSError as e:
    print("caught", e, flush=True)
for promise, _ in pending:  # the abandoned reads finish now, after their loop closed
    promise.set_result(None)

class Broken:
    def __del__(self):
        raise ValueError("another unraisable")

Broken()
print("done", flush=True)
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_abandoned_reads_of_a_failed_restore_print_nothing(mode):
    pytest.importorskip("tensorstore")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0 and p.stdout.split() == ["caught", "DATA_LOSS:", "a", "damaged", "file", "done"]
    assert "ValueError: another unraisable" in p.stderr  # other unraisables are still reported
    if mode == "quiet":  # inside nnx_shard's read: the late callbacks are filtered, however late they come
        assert "Event loop is closed" not in p.stderr, p.stderr[-3000:]
    else:  # the same reads outside it: what a user saw, one traceback per abandoned read
        assert p.stderr.count("RuntimeError: Event loop is closed") == 8, p.stderr[-3000:]


def _unraisable(error: BaseException, obj: object = None):
    import types

    return types.SimpleNamespace(
        exc_type=type(error), exc_value=error, exc_traceback=error.__traceback__, err_msg=None, object=obj
    )


def test_only_a_closed_loops_callback_is_taken_for_an_abandoned_read():
    import asyncio

    from nnx_shard._checkpoint._faults import _abandoned_read

    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError) as closed:
        loop.call_soon_threadsafe(print)  # what TensorStore's late callback runs into
    assert _abandoned_read(_unraisable(closed.value))
    assert not _abandoned_read(_unraisable(closed.value, obj=loop))  # reported for an object: not ours
    with pytest.raises(RuntimeError) as own:
        raise RuntimeError("Event loop is closed")  # the same words from the user's own code
    assert not _abandoned_read(_unraisable(own.value))
    with pytest.raises(ValueError) as other:
        raise ValueError("something else")
    assert not _abandoned_read(_unraisable(other.value))
