"""Functions the multi-process tests run in every worker; each returns JSON-ready data."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns


def barriers(rounds: int = 3):
    t = time.monotonic()
    for i in range(rounds):
        ns.barrier_sync("step", timeout=30)
        ns.barrier_sync(f"named-{i}", timeout=30)
        ns.barrier_sync(timeout=30)  # unnamed: a per-process counter
    return {"seconds": time.monotonic() - t, "processes": jax.process_count()}


def mismatched_names(timeout: float = 3.0):
    me = jax.process_index()
    if me == jax.process_count() - 1:
        time.sleep(timeout + 3)  # never reaches a barrier, stays alive
        return "skipped"
    start = time.monotonic()
    try:
        ns.barrier_sync("save" if me == 0 else "restore", timeout=timeout)
    except ns.BarrierTimeoutError as e:
        return {"message": str(e), "seconds": time.monotonic() - start}
    return "passed"


def crash_one(timeout: float = 5.0):
    if jax.process_index() == 1:
        os._exit(3)  # dies without a word, as a segfault or OOM kill would
    start = time.monotonic()
    try:
        ns.barrier_sync("after-crash", timeout=timeout)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return "passed"


def placement():
    mesh = ns.create_mesh((2, -1), ("dp", "fsdp"))
    full = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    target = {"w": NamedSharding(mesh, P("dp", "fsdp")), "b": NamedSharding(mesh, P()), "tag": None}
    out = ns.place_like_target({"w": full, "b": np.float32(2.5), "tag": "x"}, target)
    w = out["w"]
    shards = [
        {
            "bounds": [
                [i.start or 0, i.stop if i.stop is not None else n]
                for i, n in zip(s.index, w.shape, strict=True)
            ],
            "data": np.asarray(s.data).tolist(),
        }
        for s in w.addressable_shards
    ]
    total = float(jax.jit(lambda x, b: (x * b).sum())(w, out["b"]))  # a real cross-process reduction
    others = [d for d in jax.devices() if d.process_index != jax.process_index()]
    try:
        ns.place_like_target(
            {"w": full}, {"w": NamedSharding(jax.sharding.Mesh(np.array(others), ("x",)), P())}
        )
        foreign = "placed"
    except ns.PlacementError as e:
        foreign = str(e)
    return {
        "global_shape": list(w.shape),
        "local_shards": shards,
        "total": total,
        "tag": out["tag"],
        "foreign": foreign,
    }


def local_global():
    me = jax.process_index()
    local = np.full((4, 3), me, dtype=np.float32) + np.arange(4)[:, None]
    x = ns.compat.make_fsarray_from_local_slice(local, jax.devices())
    back = ns.compat.get_local_slice_from_fsarray(x)
    mesh = ns.create_mesh((-1, 2), ("dp", "tp"))
    batch = ns.cluster.host_local_to_global({"x": local, "y": np.full((4,), me)}, mesh)
    per_process_sum = jax.jit(lambda b: b["y"].reshape(jax.process_count(), -1).sum(axis=1))(batch)
    errors = []
    for bad in (np.ones((3, 3)), np.float32(1)):
        try:
            ns.compat.make_fsarray_from_local_slice(bad, jax.devices())
        except ns.LocalSliceError as e:
            errors.append(str(e))
    return {
        "global_shape": list(x.shape),
        "global_sum": float(jax.jit(jnp.sum)(x)),
        "roundtrip": bool((back == local).all()),
        "batch_shape": list(batch["x"].shape),
        "batch_spec": str(batch["x"].sharding.spec),
        "per_process_sum": np.asarray(jax.device_get(per_process_sum.addressable_shards[0].data)).tolist()
        if False
        else [
            int(v)
            for v in np.asarray(
                jax.experimental.multihost_utils.process_allgather(per_process_sum, tiled=True)
            )
        ],
        "errors": errors,
    }


def infer_everywhere():
    import optax
    from flax import nnx

    mesh = ns.create_mesh((2, -1), ("dp", "fsdp"))

    def create():
        model = nnx.Linear(64, 128, rngs=nnx.Rngs(0))
        return {
            "model": model,
            "opt": nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
            "ema": nnx.EMA(model, 0.9),
        }

    shardings = ns.infer_sharding(
        nnx.eval_shape(create), [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh
    )
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    described = [(jax.tree_util.keystr(p), str(s.spec), [d.id for d in s.mesh.devices.flat]) for p, s in flat]
    objects, _ = ns.create_sharded(create, [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh)
    kernel = objects["model"].kernel.get_value()
    return {
        "shardings": described,
        "kernel_spec": str(kernel.sharding.spec),
        "kernel_local_shards": len(kernel.addressable_shards),
    }


def hang_in_a_collective(hang: int) -> dict:
    """Process ``hang`` sleeps; the other waits for it in a collective until its watchdog ends it."""
    from jax.experimental import multihost_utils

    from nnx_shard._trainer._watchdog import Watchdog

    dog = Watchdog()
    dog.arm("step 2", 60, "step_timeout")
    multihost_utils.sync_global_devices("both in step 2")
    if jax.process_index() == hang:
        time.sleep(8)
        return {}
    dog.arm("step 3", 2, "step_timeout")
    multihost_utils.process_allgather(np.zeros(1))
    return {"arrived": True}


def load_and_export(folder: str, out: str) -> dict:
    """Loads Hugging Face-named weights into a model sharded over both processes, then exports it."""
    import jax
    from flax import nnx

    import nnx_shard as ns
    from tests.weights.test_safetensors import RULES, STRATEGY, Tiny

    mesh = ns.create_mesh((jax.device_count(),), ("fsdp",))
    model = ns.create_sharded(lambda: Tiny(nnx.Rngs(3)), STRATEGY, mesh)[0]
    report = ns.load_safetensors(model, folder, RULES)
    written = ns.save_safetensors(model, out, RULES, like=folder)
    return {"read": report.bytes_read, "needed": report.bytes_needed, "written": written}


def hooks_across_hosts(workdir: str):
    """Worker: ShardingHooks move model, optimizer and EMA onto process 0's devices alone and back, in the
    processes: process 1 holds no shard meanwhile and process 0 holds every value, unchanged. A restore onto
    process 0's devices alone is refused first, the live state untouched."""
    from jax.experimental import multihost_utils

    from tests.helpers import no_host_transfers, train_objects

    strategy = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]

    def arrays():
        flat = jax.tree_util.tree_flatten_with_path(hooks.states())[0]
        out = {}
        for path, x in flat:
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            out[jax.tree_util.keystr(path)] = x
        return out

    everywhere = ns.create_mesh((-1,), ("fsdp",))
    hooks = ns.ShardingHooks(strategy, everywhere)
    objects = hooks.on_init(train_objects)
    before = {k: np.asarray(multihost_utils.process_allgather(x, tiled=True)) for k, x in arrays().items()}
    first = [d for d in jax.devices() if d.process_index == 0]
    with ns.Checkpointer(workdir, async_save=False) as ckpt:
        hooks.save(ckpt, 1)
        try:
            ns.restore_and_reshard(ckpt, objects, strategy, ns.create_mesh((-1,), ("fsdp",), devices=first))
            refused = None
        except ns.MeshError as e:
            refused = str(e)
    untouched = all(
        np.array_equal(np.asarray(multihost_utils.process_allgather(x, tiled=True)), before[k])
        for k, x in arrays().items()
    )
    with no_host_transfers():
        there = hooks.on_mesh_change(ns.create_mesh((-1,), ("fsdp",), devices=first))
    on_first = arrays()
    shards_here = sum(len(x.addressable_shards) for x in on_first.values())
    equal_there = None
    kernel_spec = str(objects["model"].up.kernel.get_value().sharding.spec)
    if jax.process_index() == 0:  # every value is here: compared, and a step on these devices alone
        equal_there = all(np.array_equal(np.asarray(x), before[k]) for k, x in on_first.items())
        kernel = objects["model"].up.kernel.get_value()
        doubled = jax.jit(lambda k: k * 2)(kernel)
        equal_there = equal_there and np.array_equal(np.asarray(doubled), 2 * before[_key("up", on_first)])
    host_rows = np.arange(24, dtype=np.float32).reshape(6, 4)  # host data placed on process 0's devices alone
    placed = ns.reshard({"rows": host_rows}, NamedSharding(hooks.mesh, P("fsdp")))["rows"]
    placed_here = [np.asarray(s.data).tolist() for s in placed.addressable_shards]
    with no_host_transfers():
        back = hooks.on_mesh_change(everywhere)
    after = {k: np.asarray(multihost_utils.process_allgather(x, tiled=True)) for k, x in arrays().items()}
    return {
        "there": str(there),
        "back": str(back),
        "shards_here": shards_here,
        "equal_there": equal_there,
        "kernel_spec": kernel_spec,
        "bitwise_back": all(np.array_equal(after[k], before[k]) for k in before),
        "mesh_after": dict(hooks.mesh.shape),
        "restore_refused": refused,
        "placed_here": placed_here,
        "untouched": untouched,
    }


def _key(layer: str, arrays: dict) -> str:
    """The flattened path of the model's ``layer`` kernel among ``arrays``' keys."""
    (key,) = [k for k in arrays if "'model'" in k and f"'{layer}'" in k and "'kernel'" in k]
    return key


def train_in_a_bucket(workdir: str) -> dict:
    """Worker: a Trainer with its workdir in a bucket trains to step 10 (saves at 5 and 10), resuming what is
    there; returns what it restored, the state's digest, the steps every process lists after, and warnings."""
    import warnings

    from tests.apps.trainer_app import RegressionTrainer, batch_for, config, digest

    cfg = {**config(workdir, total_steps=10), "save_every": 5, "async_save": False, "max_to_keep": None}
    trainer = RegressionTrainer({**cfg, "resume": "auto"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ns.CheckpointWarning)
        trainer.train(batch_for)
    return {
        "restored_step": trainer.restored_step,
        "digest": digest(trainer),
        "steps": trainer.checkpointer.all_steps(),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, ns.CheckpointWarning)],
    }


def branch_with_a_late_listing(workdir: str) -> dict:
    """Trains to step 4 (saved at 2 and 4), restores step 2 and trains on: the branch's first save sets the
    left run's step 4 aside. Process 1 lists its steps 1.5 s late, so process 0 (which moves them) has long
    moved step 4 when process 1 lists, unless the processes agreed on the list first."""
    from pathlib import Path

    from tests.apps.trainer_app import RegressionTrainer, batch_for, config

    cfg = {**config(workdir, total_steps=6), "save_every": 2, "async_save": False, "barrier_timeout": 20}
    trainer = RegressionTrainer(cfg)
    trainer.train(batch_for, steps=4)
    trainer.restore_and_reshard(step=2)
    if jax.process_index() == 1:
        listing = trainer.checkpointer.all_steps

        def late() -> list[int]:
            time.sleep(1.5)
            return listing()

        trainer.checkpointer.all_steps = late
    trainer.train(lambda step: {k: v + 1.0 for k, v in batch_for(step).items()}, steps=2)
    aside = Path(workdir, "checkpoints.set_aside")
    return {"steps": trainer.checkpointer.all_steps(), "aside": sorted(p.name for p in aside.glob("*/*"))}


def fresh_run_with_another_listing(workdir: str, how: str) -> dict:
    """A run that saved steps 2 and 4, then a fresh run in the same workdir whose process 1 lists the steps
    ``how`` the first time: ``"late"`` (1.5 s after process 0, which sets them aside with ``overwrite=True``)
    or ``"empty"`` (it sees none, as a host whose view of the storage lags would; ``overwrite`` off), or
    ``"resume"`` (it sees step 2 only, and the run has ``resume="auto"``). Either way the processes must act
    on agreed listings: set aside the same steps, all refuse the workdir, or all restore the same step."""
    from pathlib import Path

    from tests.apps.trainer_app import RegressionTrainer, batch_for, config

    cfg = {**config(workdir, total_steps=4), "save_every": 2, "async_save": False, "barrier_timeout": 20}
    RegressionTrainer(cfg).train(batch_for, steps=4)
    resume = "auto" if how == "resume" else "off"
    trainer = RegressionTrainer({**cfg, "resume": resume, "overwrite": how == "late"})
    if jax.process_index() == 1:
        listing = trainer.checkpointer.all_steps

        def other() -> list[int]:  # its first listing only
            trainer.checkpointer.all_steps = listing
            time.sleep(1.5)
            steps = listing()  # (the first listing also opens Orbax's manager, on every process)
            return {"late": steps, "empty": [], "resume": [s for s in steps if s < 4]}[how]

        trainer.checkpointer.all_steps = other
    try:
        trainer.train(batch_for, steps=2)
    except ns.CheckpointExistsError as e:
        return {"refused": "already holds checkpoints" in str(e)}
    aside = Path(workdir, "checkpoints.set_aside")
    listed = {"steps": trainer.checkpointer.all_steps(), "aside": sorted(p.name for p in aside.glob("*/*"))}
    return {**listed, "restored": trainer.restored_step}


def resume_past_one_hosts_damage(workdir: str) -> dict:
    """Trains to step 4 (saved at 2 and 4); process 1's own data file of step 4 is cut in half; a new run
    with ``resume="auto"`` must fall back to step 2 on every process alike."""
    from pathlib import Path

    from tests.apps.trainer_app import RegressionTrainer, batch_for, config

    cfg = {**config(workdir, total_steps=6), "save_every": 2, "async_save": False, "barrier_timeout": 20}
    RegressionTrainer(cfg).train(batch_for, steps=4)
    ns.barrier_sync("trained", timeout=60)
    if jax.process_index() == 1:
        data = max(
            Path(workdir, "checkpoints", "4", "state", "ocdbt.process_1", "d").iterdir(),
            key=lambda p: p.stat().st_size,
        )
        os.truncate(data, data.stat().st_size // 2)
    ns.barrier_sync("damaged", timeout=60)
    trainer = RegressionTrainer({**cfg, "resume": "auto"})
    trainer.train(batch_for, steps=1)
    aside = Path(workdir, "checkpoints.set_aside")
    return {"restored": trainer.restored_step, "aside": sorted(p.name for p in aside.glob("*/*"))}


def restore_the_newest_with_a_lagging_listing(workdir: str) -> dict:
    """Trains to step 4 (saved at 2 and 4); then, while process 1's listing lags (it lists step 2 only, as a
    host whose view of the storage lags would), every process restores "the newest step": the newest one
    every process lists, the same on each."""
    from tests.apps.trainer_app import RegressionTrainer, batch_for, config, digest

    cfg = {**config(workdir, total_steps=4), "save_every": 2, "async_save": False}
    trainer = RegressionTrainer(cfg)
    trainer.train(batch_for, steps=4)
    reads = trainer.checkpointer._reads  # every listing of the checkpointer's goes through its reader's
    listing = reads.all_steps
    if jax.process_index() == 1:
        reads.all_steps = lambda: [s for s in listing() if s < 4]
    report = trainer.restore_and_reshard()
    reads.all_steps = listing
    return {"restored": report.step, "digest": digest(trainer)}


def restore_the_newest_where_a_process_lists_none(workdir: str, who: str) -> dict:
    """``restore_and_reshard()`` with no step where ``who`` lists no step: ``"all"`` (nothing was saved) or
    ``"one"`` (steps 2 and 4 saved, process 1's listing lags and shows none); returns each one's error."""
    from tests.apps.trainer_app import RegressionTrainer, batch_for, config

    trainer = RegressionTrainer({**config(workdir, total_steps=4), "save_every": 2, "async_save": False})
    if who == "one":
        trainer.train(batch_for, steps=4)
        if jax.process_index() == 1:
            trainer.checkpointer._reads.all_steps = lambda: []  # the listing every read goes through
    else:
        trainer.init()
    try:
        trainer.restore_and_reshard()
    except ns.NoCheckpointError as e:
        return {"error": str(e).split(str(trainer.checkpointer.directory))[-1]}
    return {"error": None}
