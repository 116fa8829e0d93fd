"""A small Trainer subclass the tests run in this process and in fresh ones (save here, restore there)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_shard as ns

STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 64):
        self.l1 = nnx.Linear(8, width, rngs=rngs)
        self.l2 = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.tanh(self.l2(jax.nn.tanh(self.l1(x)))))


class RegressionTrainer(ns.Trainer):
    @classmethod
    def default_config(cls):
        c = super().default_config()
        c.width = 64
        return c

    def create_model(self, rngs):
        return MLP(rngs, width=self.config.width)

    def create_optimizer(self):
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

    def loss_fn(self, model, batch):
        pred = model(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2), {"mae": jnp.mean(jnp.abs(pred - batch["y"]))}


class DropoutBN(nnx.Module):
    """The standard NNX pattern: a model holding an RNG stream (dropout) and running statistics."""

    def __init__(self, rngs: nnx.Rngs, width: int = 64):
        self.l1 = nnx.Linear(8, width, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.tanh(self.bn(self.l1(x)))))


class DropoutTrainer(RegressionTrainer):
    def create_model(self, rngs):
        return DropoutBN(rngs, width=self.config.width)


TRAINERS = {"mlp": RegressionTrainer, "dropout": DropoutTrainer}


def global_rows(step: int, rows: int = 16) -> dict[str, np.ndarray]:
    """The whole global batch of a step, the same in every run."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)}


def batch_for(step: int, rows: int = 16) -> dict[str, np.ndarray]:
    """The global batch of a step, the same in every run; each process takes its own rows."""
    n, i = jax.process_count(), jax.process_index()
    per = rows // n
    return {k: v[i * per : (i + 1) * per] for k, v in global_rows(step, rows).items()}


# Every test of several processes runs with a step timeout: a hang ends them within a minute with the
# watchdog's message (the process, the section, the collective each waits in), not at the harness's deadline;
# and with a startup timeout (init, restore and the first step with its compile, slow under load).
MULTIPROCESS_STEP_TIMEOUT = 60.0
MULTIPROCESS_STARTUP_TIMEOUT = 180.0


def _several_processes() -> bool:
    """In a job of several processes (``nnx-shard launch``'s or the test harness's): a watchdog must not end a
    pytest process."""
    n = os.environ.get("NNX_SHARD_NUM_PROCESSES") or os.environ.get("NNX_SHARD_TEST_PROCESSES") or "1"
    return int(n) > 1


def multiprocess_step_timeout() -> float:
    """``MULTIPROCESS_STEP_TIMEOUT`` in a job of several processes, else 0 (off)."""
    return MULTIPROCESS_STEP_TIMEOUT if _several_processes() else 0.0


def multiprocess_startup_timeout() -> float:
    """``MULTIPROCESS_STARTUP_TIMEOUT`` in a job of several processes, else 0 (off)."""
    return MULTIPROCESS_STARTUP_TIMEOUT if _several_processes() else 0.0


def config(workdir: str, mesh: str = "fsdp:-1", **extra) -> dict:
    return {
        "mesh": mesh,
        "sharding_strategy": STRATEGY,
        "workdir": workdir,
        "log_every": 1,
        "progress": "off",
        "total_steps": 12,
        "step_timeout": multiprocess_step_timeout(),
        "startup_timeout": multiprocess_startup_timeout(),
        **extra,
    }


def digest(trainer: ns.Trainer) -> str:
    """A hash of every array of model, optimizer and EMA, gathered to the host (bitwise)."""
    from jax.experimental import multihost_utils

    h = hashlib.sha256()
    flat = jax.tree_util.tree_flatten_with_path(trainer.states)[0]
    for path, x in sorted(flat, key=lambda kv: jax.tree_util.keystr(kv[0])):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        host = (
            np.asarray(multihost_utils.process_allgather(x, tiled=True))
            if jax.process_count() > 1
            else np.asarray(x)
        )
        h.update(jax.tree_util.keystr(path).encode())
        h.update(host.tobytes())
    return h.hexdigest()


def run_with_checkpoint_at_6(trainer: ns.Trainer, workdir: str) -> dict:
    """Trains 6 steps, saves (and waits for the save), trains on: what a resume is compared with."""
    trainer.train(batch_for, steps=6)  # saves at its end (save_at_end)
    trainer.checkpointer.wait_until_finished()
    assert trainer.checkpointer.latest_step() == 6
    saved = digest(trainer)
    history = trainer.train(batch_for)
    return {"workdir": workdir, "digest": saved, "losses": [h["loss"] for h in history], "trainer": trainer}


def resume(workdir: str, mesh: str = "fsdp:-1", step: int | None = None, until: int = 12, model: str = "mlp"):
    """Worker: restore onto this process's devices, report the restore, digest and later losses.

    It writes nothing (the workdir is shared by several tests): a save after
    restoring step 6 would set the reference's newer steps aside.
    """
    trainer = TRAINERS[model]({**config(workdir, mesh, total_steps=until), "save_at_end": False})
    report = trainer.restore_and_reshard(step)
    restored = digest(trainer)
    kernel = trainer.states["model"]["l1"]["kernel"].get_value()
    lock = os.path.join(workdir, "nnx_shard.lock")
    # whose pid the workdir lock names while training (process 0's, for every process); not after the last
    # step, which process 0 may finish, lock released, before another process's callback reads the file
    holders = []
    trainer.add_callback(
        lambda s, m, t: (
            s < until and holders.append(json.load(open(lock))["pid"] if os.path.exists(lock) else None)
        )
    )
    history = trainer.train(batch_for)
    return {
        "pid": os.getpid(),
        "lock_holders": sorted(set(holders)),
        "lock_left": os.path.exists(lock),
        "report": str(report),
        "digest": restored,
        "devices": jax.device_count(),
        "kernel_spec": str(kernel.sharding.spec),
        "kernel_mesh": dict(kernel.sharding.mesh.shape),
        "losses": [h["loss"] for h in history],
    }


if (
    __name__ == "__main__"
):  # python tests/apps/trainer_app.py WORKDIR DEVICES [STEP [MODEL]]: resume in a fresh process
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("XLA_FLAGS", None)
    jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))
    step = int(sys.argv[3]) if len(sys.argv) > 3 else None
    print(json.dumps(resume(sys.argv[1], step=step, model=sys.argv[4] if len(sys.argv) > 4 else "mlp")))


def resize_worker(steps: int = 3):
    """Worker: train on all devices, resize to half of each process's devices and back; compare with a run
    left alone."""
    left_alone = RegressionTrainer(config("", total_steps=3 * steps))
    expected = [h["loss"] for h in left_alone.train(batch_for)]
    trainer = RegressionTrainer(config("", total_steps=3 * steps))
    got = [h["loss"] for h in trainer.train(batch_for, steps=steps)]
    half = [d for d in jax.devices() if d.id % jax.local_device_count() < jax.local_device_count() // 2]
    before = digest(trainer)
    there = trainer.resize("fsdp:-1", devices=half)
    bitwise = [digest(trainer) == before]
    got += [h["loss"] for h in trainer.train(batch_for, steps=steps)]
    kernel = trainer.states["model"]["l2"]["kernel"].get_value()
    spec, mesh = str(kernel.sharding.spec), dict(kernel.sharding.mesh.shape)
    before = digest(trainer)
    back = trainer.resize("fsdp:-1")
    bitwise.append(digest(trainer) == before)
    got += [h["loss"] for h in trainer.train(batch_for)]
    return {
        "expected": expected,
        "got": got,
        "there": str(there),
        "back": str(back),
        "half_mesh": mesh,
        "half_spec": spec,
        "bitwise": bitwise,
    }


def resize_off_a_process_worker(steps: int = 2):
    """Worker: a resize onto process 0's devices alone is refused on every process, nothing moved; training
    goes on on the old mesh as if it had not been asked."""
    left_alone = RegressionTrainer(config("", total_steps=2 * steps))
    expected = [h["loss"] for h in left_alone.train(batch_for)]
    trainer = RegressionTrainer(config("", total_steps=2 * steps))
    got = [h["loss"] for h in trainer.train(batch_for, steps=steps)]
    before = digest(trainer)
    try:
        trainer.resize("fsdp:-1", devices=[d for d in jax.devices() if d.process_index == 0])
        error = None
    except ns.MeshError as e:
        error = str(e)
    unchanged = digest(trainer) == before
    got += [h["loss"] for h in trainer.train(batch_for)]
    return {"expected": expected, "got": got, "error": error, "unchanged": unchanged}
