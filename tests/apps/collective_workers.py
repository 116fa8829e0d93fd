"""Workers of tests/cluster/test_collectives.py: processes that issue collectives the others do not."""

from __future__ import annotations

import time


def extra_agreement(folder: str) -> dict:
    """Both processes snapshot step 3; then process 1 snapshots step 5 as well, which process 0 does not:
    its agreement meets process 0's agreement of step 10. Returns what each raised and its flight record."""
    import jax
    import jax.numpy as jnp

    import nnx_shard as ns
    from nnx_shard._snapshots import SnapshotWriter
    from tests.apps.snapshot_workers import watched

    watched("the extra agreement worker")
    writer = SnapshotWriter(folder, keep=2)
    states = {"w": jnp.arange(64.0)}
    writer.write(3, states)
    writer.wait()
    try:
        if jax.process_index() == 1:
            writer.write(5, states, skip_if_busy=True)
        writer.write(10, states, skip_if_busy=True)
    except ns.errors.CollectiveMismatchError as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def diverge_and_time_out() -> dict:
    """Process 0 waits in an agreement; process 1 waits elsewhere (a recorded section that never ends in
    time); both watchdogs end their processes, naming where the records part."""
    import jax

    from nnx_shard._cluster import agree, recorded
    from nnx_shard._trainer._watchdog import Watchdog

    agree("both.before", [1], step=1)
    dog = Watchdog()
    dog.arm("step 2", 3, "step_timeout")
    if jax.process_index() == 0:
        agree("snapshot.agree", [0, 1], step=2)
    else:
        with recorded("snapshot.exchange", 1, (1, 2**20)):
            time.sleep(30)
    return {}
