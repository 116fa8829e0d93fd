"""Shared fixtures (meshes of 1, 8, 2x4 and 2x2x2 devices, processes), the slow marks, and Flax's flags
restored."""

from __future__ import annotations

import gc
import math
import os
from pathlib import Path

import jax
import pytest

import nnx_shard as ns
from tests.helpers import MESHES, need_devices


@pytest.fixture(params=sorted(MESHES))
def any_mesh(request):
    dims, names = MESHES[request.param]
    need_devices(math.prod(dims))
    return ns.create_mesh(dims, names, devices=jax.devices()[: math.prod(dims)])


@pytest.fixture
def multiprocess(tmp_path):
    """``multiprocess(target, n, devices=2, args=..., deadline_s=...)`` -> (results, seconds)."""
    from tests.apps.multihost import run_processes

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
    "test_reader",
    "test_reliability",
    "test_tpu",
    "test_trainer_jobs",
    "test_vit_example",
    "test_writer",
}


SLOW_TESTS_FILE = Path(__file__).with_name("slow_tests.txt")


def pytest_collection_modifyitems(config, items):
    timed = {
        line.strip()
        for line in SLOW_TESTS_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    if os.environ.get("NNX_SHARD_RETIME"):  # make slow-list: time every test the modules leave fast
        timed = set()
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


@pytest.fixture(scope="session")
def gcs_emulator():
    """fake-gcs-server on 127.0.0.1 for this test process, every GCS client pointed at it (tests/bucket);
    with ``NNX_SHARD_TEST_BUCKET=gs://my-bucket`` set, that real bucket instead (each test a new prefix)."""
    from tests.bucket import FakeGCS, RealBucket, point_at, restore_env

    if os.environ.get("NNX_SHARD_TEST_BUCKET"):
        yield RealBucket(os.environ["NNX_SHARD_TEST_BUCKET"])
        return

    with FakeGCS() as gcs:
        before = point_at(gcs.url)
        try:
            yield gcs
        finally:
            gc.collect()  # what still writes to the emulator (an open TensorBoard file) does it now
            restore_env(before)


@pytest.fixture
def bucket(gcs_emulator):
    """A new, empty bucket of the emulator: ``gs://<name>``."""
    import uuid

    return "gs://" + gcs_emulator.make_bucket(f"t-{uuid.uuid4().hex[:12]}")
