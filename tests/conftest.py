"""Shared fixtures: meshes of 1, 8, 2x4 and 2x2x2 devices, and a small model."""

from __future__ import annotations

from pathlib import Path

import jax
import optax
import pytest
from flax import nnx

import nnx_shard as ns


def no_host_transfers():
    """Any transfer between host and device raises inside it (``benchmarks/common.py``'s guard, shared)."""
    from benchmarks.common import no_host_transfers as guard

    return guard(jax)


def need_devices(n: int) -> None:
    if jax.device_count() < n:
        pytest.skip(
            f"needs {n} devices, found {jax.device_count()}: run pytest from the repository root, "
            f"whose conftest.py simulates 8 CPU devices (or run `make test`)"
        )


MESHES = {
    "1": ((1,), ("fsdp",)),
    "8": ((8,), ("fsdp",)),
    "2x4": ((2, 4), ("dp", "fsdp")),
    "2x2x2": ((2, 2, 2), ("dp", "fsdp", "tp")),
}


@pytest.fixture(params=sorted(MESHES))
def any_mesh(request):
    dims, names = MESHES[request.param]
    need_devices(max(1, __import__("math").prod(dims)))
    return ns.create_mesh(dims, names, devices=jax.devices()[: __import__("math").prod(dims)])


def mesh_of(key: str):
    dims, names = MESHES[key]
    import math

    need_devices(math.prod(dims))
    return ns.create_mesh(dims, names, devices=jax.devices()[: math.prod(dims)])


class MLP(nnx.Module):
    """up -> layers[0..n) -> embedding; paths like up/kernel, layers/0/kernel."""

    def __init__(self, rngs: nnx.Rngs, din: int = 16, dh: int = 32, n: int = 2):
        self.up = nnx.Linear(din, dh, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(dh, dh, rngs=rngs) for _ in range(n)])
        self.emb = nnx.Embed(10, din, rngs=rngs)

    def __call__(self, x):
        x = self.up(x)
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def make_train_state(tx=None):
    """Abstract model, optimizer and EMA built the way users build them."""

    def build():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx or optax.adamw(1e-3), wrt=nnx.Param)
        return model, opt, nnx.EMA(model, decay=0.99)

    return nnx.eval_shape(build)


@pytest.fixture
def multiprocess(tmp_path):
    """``multiprocess(target, n, devices=2, args=..., deadline_s=...)`` -> (results, seconds)."""
    from tests.multihost import run_processes

    def run(target, n, devices=2, **kwargs):
        sub = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        sub.mkdir()
        return run_processes(target, n, devices, tmp=sub, **kwargs)

    return run


# Whole modules whose tests start processes, train for many steps or compile for seconds:
# `make test-fast` (-m "not slow") leaves them out; `make test` runs everything.
SLOW_MODULES = {
    "test_chaos",
    "test_examples",
    "test_launch",
    "test_multihost",
    "test_reliability",
    "test_snapshot",
    "test_tpu",
    "test_trainer_jobs",
    "test_vit_example",
}


SLOW_TESTS_FILE = Path(__file__).with_name("slow_tests.txt")


def pytest_collection_modifyitems(config, items):
    timed = {
        line.strip()
        for line in SLOW_TESTS_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
        uses_processes = "multiprocess" in getattr(item, "fixturenames", ()) or item.get_closest_marker(
            "multihost"
        )
        if module in SLOW_MODULES or uses_processes or item.nodeid.split("[")[0] in timed:
            item.add_marker(pytest.mark.slow)


# tests/data holds test data and the script that regenerates it with torch (not a test module)
collect_ignore_glob = ["data/*"]


@pytest.fixture(autouse=True)
def _flax_flags_restored():
    """Flax's global flags as each test found them: importing google-tunix turns eager sharding off for the
    whole process (``flax_always_shard_variable=False``), which must not leak into the tests after it."""
    import flax

    before = flax.config.flax_always_shard_variable
    yield
    flax.config.update("flax_always_shard_variable", before)
