"""Which path each backend takes: fingerprints, the gradient norm and the threefry lowering of sharded
creation.

The GPU and TPU paths cannot run here; these tests pin the choice (by platform) and check, on the CPU, that
the fused program computes what the blocked one and the host do, so that a GPU runs the same sum. Compiled
for a TPU through libtpu (nothing runs), the fused fingerprint and a snapshot's stage read each shard once."""

from __future__ import annotations

import importlib.util
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import nnx_shard as ns
from nnx_shard._base import CompiledAhead, threefry_kernel
from nnx_shard._checkpoint import _fingerprint as fp
from nnx_shard._checkpoint._fingerprint_shares import block_fingerprint
from nnx_shard._trainer._norm import global_norm, norm_route
from tests.helpers import mesh_of

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu extra)"
)


class FakeDevice:
    def __init__(self, platform):
        self.platform = platform


class FakeMesh:
    def __init__(self, platform):
        self.devices = np.array([FakeDevice(platform)])


@pytest.mark.parametrize("platform, route", [("cpu", "shard_map"), ("gpu", "fused"), ("tpu", "fused")])
def test_the_norm_takes_one_collective_on_cpus_and_fuses_elsewhere(platform, route):
    assert norm_route(FakeMesh(platform)) == route


def test_both_norm_routes_give_the_same_norm(monkeypatch):
    mesh = mesh_of("8")
    grads = {"a": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones(3)}
    shardings = {"a": NamedSharding(mesh, PartitionSpec("fsdp")), "b": NamedSharding(mesh, PartitionSpec())}
    placed = {k: jax.device_put(v, shardings[k]) for k, v in grads.items()}
    one = jax.jit(lambda g: global_norm(g, shardings, mesh))(placed)
    from nnx_shard._trainer import _norm

    monkeypatch.setattr(_norm, "norm_route", lambda mesh: "fused")
    fused = jax.jit(lambda g: global_norm(g, shardings, mesh))(placed)
    want = np.sqrt(sum(float(np.sum(np.square(np.asarray(v)))) for v in grads.values()))
    np.testing.assert_allclose([float(one), float(fused)], [want, want], rtol=1e-6)


def test_fingerprint_routes_by_size_place_and_platform(monkeypatch):
    mesh = mesh_of("8")
    big = jax.device_put(jnp.ones((1024, 64)), NamedSharding(mesh, PartitionSpec("fsdp")))
    assert fp.route(jnp.ones(8)) == "host"
    assert fp.route(big) == "in_place"
    monkeypatch.setattr(fp, "_in_place", lambda x: False)  # as across processes: a program per shard
    assert fp.route(big) == "blocks"
    assert fp.route(jax.device_put(jnp.ones((1024, 64)), NamedSharding(mesh, PartitionSpec()))) == "blocks"
    monkeypatch.setattr(fp, "_platform", lambda x: "gpu")
    assert fp.route(big) == "fused"
    small = jnp.ones((64, 300))  # > HOST_BYTES, <= SMALL_BYTES
    assert fp.route(small, count=65) == "batched"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float64])
def test_the_fused_shard_program_sums_what_the_blocked_one_and_the_host_do(dtype):
    mesh = mesh_of("8")
    with jax.enable_x64(dtype == jnp.float64):
        x = jax.device_put(
            jnp.asarray(np.random.default_rng(0).normal(size=(4096, 24)) * 50).astype(dtype),
            NamedSharding(mesh, PartitionSpec("fsdp", None)),
        )
        sums = [
            int(np.asarray(fp._shard_program(x.shape, x.dtype, x.sharding, blocks)(x))[0])
            for blocks in (True, False)
        ]
        host = block_fingerprint(np.asarray(x), (0,) * x.ndim, x.shape)
    assert sums[0] == sums[1] == host


@needs_libtpu
@pytest.mark.parametrize("dtype, spec", [(jnp.float32, ("fsdp",)), (jnp.bfloat16, (None, "fsdp"))])
def test_on_tpus_the_fused_fingerprint_is_one_pass_over_each_shard_with_no_loop(dtype, spec):
    """Compiled for a v5e:2x2 slice through libtpu (nothing runs): the fused program reads each device's
    shard once, with no loop and no temporary the size of a shard; the blocked one (CPU devices) loops."""
    mesh = jax.sharding.Mesh(np.array(ns.cluster.tpu_devices("v5e:2x2")), ("fsdp",))
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    shape = (2048, 2048)
    target = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    shard_bytes = math.prod(shape) * jnp.dtype(dtype).itemsize // 4
    compiled = {
        blocks: fp._shard_program(shape, jnp.dtype(dtype), sharding, blocks).lower(target).compile()
        for blocks in (False, True)
    }
    loops = {blocks: re.search(r"\) while\(", c.as_text()) is not None for blocks, c in compiled.items()}
    assert loops == {False: False, True: True}
    fused = compiled[False]
    cost = fused.cost_analysis()
    cost = cost if isinstance(cost, dict) else cost[0]
    slack = 64 * 1024  # the index vectors along each dimension (a few KiB), not a copy of the shard
    assert fused.memory_analysis().temp_size_in_bytes <= slack
    assert shard_bytes <= cost["bytes accessed"] <= shard_bytes + slack


def test_threefry_kernel_is_set_inside_the_context_on_gpus_only():
    before = jax.config.jax_threefry_gpu_kernel_lowering
    with threefry_kernel("cpu"):
        assert jax.config.jax_threefry_gpu_kernel_lowering == before
    with threefry_kernel("gpu"):
        assert jax.config.jax_threefry_gpu_kernel_lowering is True
    assert jax.config.jax_threefry_gpu_kernel_lowering == before


def test_sharded_creation_leaves_the_users_settings_as_they_were():
    from flax import nnx

    before = jax.config.jax_threefry_gpu_kernel_lowering
    init, _, _ = ns.placement.sharded_init_fn(
        lambda: nnx.Linear(8, 64, rngs=nnx.Rngs(0)), [(".*", "replicate")], mesh_of("8")
    )
    states = init()
    assert init.lower().compile().memory_analysis() is not None
    assert jax.config.jax_threefry_gpu_kernel_lowering == before
    assert states["kernel"].get_value().shape == (8, 64)


def test_a_verified_read_compiles_its_fused_programs_ahead_and_uses_them(tmp_path, monkeypatch):
    """As on a GPU: the read starts compiling the fingerprint programs of its targets before Orbax reads, and
    the verification calls those executables (no second compile); the values are the jitted program's."""
    from flax import nnx

    monkeypatch.setattr(fp, "_platform", lambda x: "gpu")
    monkeypatch.setattr(fp, "_AHEAD", CompiledAhead("fingerprint"))
    mesh = mesh_of("8")
    hooks = ns.ShardingHooks([(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh)
    hooks.on_init(lambda: {"model": nnx.Linear(512, 1024, rngs=nnx.Rngs(0))})
    with ns.Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        hooks.save(ckpt, 1)
        kernel = hooks.states()["model"]["kernel"]
        jitted = fp._fingerprints([kernel.get_value()])
        started = []
        real = fp.compile_ahead
        monkeypatch.setattr(
            fp, "compile_ahead", lambda targets: started.append(len(targets)) or real(targets)
        )
        from nnx_shard._checkpoint import _reads

        monkeypatch.setattr(_reads, "compile_ahead", fp.compile_ahead)
        fp._AHEAD.clear()
        calls = []
        real_program = fp._shard_program
        monkeypatch.setattr(
            fp, "_shard_program", lambda *a: calls.append(a[3]) or real_program.__wrapped__(*a)
        )
        hooks.restore_and_reshard(ckpt)
    assert started and len(fp._AHEAD) == 1  # the kernel's signature (the bias is summed on the host)
    assert calls == [False]  # lowered once, for the compile ahead; the verification ran the executable
    assert fp._fingerprints([hooks.states()["model"]["kernel"].get_value()]) == jitted


def test_a_trainers_first_save_runs_fingerprint_programs_compiled_as_the_run_started(tmp_path, monkeypatch):
    """As on a GPU: ``train()`` starts compiling a verified save's fingerprint programs beside the first steps
    (``Checkpointer.prepare``); the save then runs those executables, compiling nothing, and its
    fingerprints are the jitted programs'."""
    from nnx_shard._checkpoint import tree_fingerprints
    from tests.apps.trainer_app import RegressionTrainer, config

    monkeypatch.setattr(fp, "_platform", lambda x: "gpu")
    monkeypatch.setattr(fp, "_AHEAD", CompiledAhead("fingerprint"))
    calls = []
    real_program = fp._shard_program
    monkeypatch.setattr(fp, "_shard_program", lambda *a: calls.append(a[3]) or real_program.__wrapped__(*a))
    trainer = RegressionTrainer(config(str(tmp_path / "run"), width=1024, save_every=2, async_save=False))
    rows = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    batch = {"x": jnp.asarray(rows), "y": jnp.asarray(rows[:, :1])}
    trainer.train(lambda step: batch, steps=2)
    # l2's kernel (1024 x 1024) in model, adamw's two moments and EMA: one signature; the rest: on the host
    assert len(fp._AHEAD) == 1 and calls == [False]  # lowered once, ahead; the save ran the executable
    assert trainer.checkpointer.latest_step() == 2
    saved = trainer.checkpointer.metadata(2)["fingerprints"]
    fp._AHEAD.clear()  # the state saved at step 2, fingerprinted again by the plain jitted program
    again = {k: v for k, v in tree_fingerprints(trainer.hooks.states()).items() if k in saved}
    assert again == saved and len(saved) > 10
