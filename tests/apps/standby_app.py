"""Workers: a Trainer resized off a process and back, in two real processes (tests/live/test_resize.py)."""

from __future__ import annotations

import json

import grain
import jax
import numpy as np

import nnx_shard as ns
from tests.apps.trainer_app import RegressionTrainer, batch_for, config, global_rows

ROWS = 8  # the global batch


def example(i: int) -> dict[str, np.ndarray]:
    """Example ``i``: its features, its target and its number."""
    x = np.random.default_rng(i).normal(size=8).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(keepdims=True)).astype(np.float32), "id": np.int32(i)}


def elastic_data() -> grain.experimental.ElasticIterator:
    """The numbered examples through grain's elastic iterator, sharded as JAX numbers the processes."""
    ds = grain.MapDataset.range(10_000).map(example)
    shards = grain.sharding.ShardOptions(jax.process_index(), jax.process_count())
    return grain.experimental.ElasticIterator(ds, ROWS, shards)


class Seen(RegressionTrainer):
    """Keeps the example numbers this process fed at each step."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: dict[int, list[int]] = {}

    def global_batch(self, batch):
        self.seen[self.step + 1] = np.asarray(batch["id"]).tolist()
        return super().global_batch(batch)


def elastic_off_a_host_and_back(workdir: str) -> dict:
    """3 steps on both processes, 3 on process 0's devices alone (a save at step 5 that process 1 joins), 3 on
    both again, snapshots every 2 steps; then a fresh Trainer restores step 5 and trains on. Against a run
    left alone."""
    alone = Seen(config("", total_steps=9))
    expected = [h["loss"] for h in alone.train(elastic_data())]
    trainer = Seen(config(workdir, total_steps=9, save_every=5, save_at_end=False, snapshot_every=2))
    data = elastic_data()
    got = {h["step"]: h["loss"] for h in trainer.train(data, steps=3)}
    shards = [trainer.data_shard]
    there = trainer.resize("fsdp:-1", devices=[d for d in jax.devices() if d.process_index == 0])
    shards.append(trainer.data_shard)
    history = trainer.train(data, steps=3)
    got |= {h["step"]: h["loss"] for h in history}
    after_standby = (trainer.step, trainer.stop_reason, len(history))
    trainer.resize("fsdp:-1")
    shards.append(trainer.data_shard)
    got |= {h["step"]: h["loss"] for h in trainer.train(data)}
    trainer.checkpointer.wait_until_finished()
    events = (
        [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")] if jax.process_index() == 0 else []
    )
    snapshots = [e["step"] for e in events if e.get("event", "").startswith("snapshot")]
    again = Seen(config(workdir, total_steps=9, save_at_end=False))
    restored = str(again.restore_and_reshard(5))
    resumed = {h["step"]: h["loss"] for h in again.train(elastic_data())}
    return {
        "expected": expected,
        "got": [got.get(s) for s in range(1, 10)],
        "seen": trainer.seen,
        "alone_seen": alone.seen,
        "resumed": [resumed.get(s) for s in range(6, 10)],
        "resumed_seen": again.seen,
        "shards": [None if s is None else list(s) for s in shards],
        "there": str(there),
        "after_standby": after_standby,
        "restored": restored,
        "steps": trainer.checkpointer.all_steps(),
        "snapshots": snapshots,
    }


def callables_off_a_host(steps: int = 2) -> dict:
    """A ``step -> batch`` callable slicing by ``trainer.data_shard`` feeds the same global batches after a
    resize off process 1; one slicing by ``jax.process_index()`` is refused by name at its first batch (and
    process 1, on standby, learns it)."""
    alone = RegressionTrainer(config("", total_steps=2 * steps))
    expected = [h["loss"] for h in alone.train(batch_for)]
    trainer = RegressionTrainer(config("", total_steps=2 * steps))

    def by_shard(step: int) -> dict[str, np.ndarray]:
        shard = trainer.data_shard
        per = 16 // shard.count
        return {k: v[shard.index * per : (shard.index + 1) * per] for k, v in global_rows(step).items()}

    got = [h["loss"] for h in trainer.train(by_shard, steps=steps)]
    trainer.resize("fsdp:-1", devices=[d for d in jax.devices() if d.process_index == 0])
    refused, standby = None, None
    try:
        trainer.train(batch_for, steps=1)  # its rows are for 2 processes
    except ns.BatchStructureError as e:
        refused = str(e)
    except ns.StandbyError as e:
        standby = str(e)
    history = trainer.train(by_shard)
    got += [h["loss"] for h in history]
    on_standby = None
    if jax.process_index() == 1:
        try:
            trainer.run_step({})
        except ns.MeshError as e:
            on_standby = str(e)
    return {
        "expected": expected,
        "got": got,
        "refused": refused,
        "standby": standby,
        "on_standby": on_standby,
        "step": trainer.step,
        "stop_reason": trainer.stop_reason,
        "shard": None if trainer.data_shard is None else list(trainer.data_shard),
    }


def preempted_on_standby(workdir: str) -> dict:
    """SIGTERM to both processes while process 1 is on standby: process 0 stops at JAX's preemption sync
    point and saves, process 1 joins the save and returns at the same step, both saying why."""
    import os
    import signal
    import threading

    trainer = RegressionTrainer(config(workdir, total_steps=100_000, log_every=50))
    data = elastic_data()
    trainer.train(data, steps=2)
    trainer.resize("fsdp:-1", devices=[d for d in jax.devices() if d.process_index == 0])
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()  # as a scheduler would
    trainer.train(data)
    trainer.checkpointer.wait_until_finished()
    return {"step": trainer.step, "reason": trainer.stop_reason, "steps": trainer.checkpointer.all_steps()}


def off_process_0_and_back(workdir: str) -> dict:
    """2 steps on both processes, 2 on process 1's devices alone (process 0, which hosts JAX's coordination
    service, on standby; a save at step 3), 2 on both again. The run's records (metrics.jsonl) are written by
    the first process of the mesh: process 1 while process 0 is left out."""
    alone = RegressionTrainer(config("", total_steps=6))
    expected = [h["loss"] for h in alone.train(elastic_data())]
    trainer = RegressionTrainer(config(workdir, total_steps=6, save_every=3, save_at_end=False))
    data = elastic_data()
    got = {h["step"]: h["loss"] for h in trainer.train(data, steps=2)}
    trainer.resize("fsdp:-1", devices=[d for d in jax.devices() if d.process_index == 1])
    got |= {h["step"]: h["loss"] for h in trainer.train(data, steps=2)}
    trainer.resize("fsdp:-1")
    got |= {h["step"]: h["loss"] for h in trainer.train(data)}
    trainer.checkpointer.wait_until_finished()
    ns.barrier_sync("records written")
    lines = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    return {
        "expected": expected,
        "got": [got.get(s) for s in range(1, 7)],
        "steps": trainer.checkpointer.all_steps(),
        "records": [r["step"] for r in lines if "event" not in r and "loss" in r],
        "events": [(r["event"], r["step"]) for r in lines if "event" in r],
    }
