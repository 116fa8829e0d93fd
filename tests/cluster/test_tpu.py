"""TPU pods compiled here: topologies, the Trainer's compile report, the CLI and the ViT example, reshard
plans."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import nnx_shard as ns
from tests.apps.trainer_app import MLP

ROOT = Path(__file__).resolve().parents[2]
HAS_LIBTPU = __import__("importlib").util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="libtpu is not installed (pip install 'nnx-shard[tpu]')"
)
STRATEGY = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
BATCH = {"x": jax.ShapeDtypeStruct((64, 8), np.float32), "y": jax.ShapeDtypeStruct((64, 1), np.float32)}


class Regression(ns.Trainer):
    @classmethod
    def default_config(cls):
        c = super().default_config()
        c.width = 512
        return c

    def create_model(self, rngs):
        return MLP(rngs, width=self.config.width)

    def create_optimizer(self):
        return optax.adamw(1e-3)

    def loss_fn(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def test_the_compile_report_of_a_step_on_this_machines_devices():
    trainer = Regression({"mesh": "fsdp:-1", "sharding_strategy": STRATEGY, "progress": "off"})
    report = trainer.compile_report(jax.devices(), BATCH)
    assert not trainer.hooks.initialized  # nothing was created to compile it
    assert report.devices == 8 and report.device_kind == jax.devices()[0].device_kind
    # the state's share of the arguments is the plan's bytes per device, exactly; then the batch and counters
    assert report.argument_bytes == report.state_bytes + report.batch_bytes + 8
    assert report.state_bytes == trainer.plan.bytes_per_device
    assert report.peak_bytes >= report.argument_bytes and report.flops > 0
    assert report.collectives["all-reduce"]["count"] >= 1 and report.compile_seconds > 0
    assert "fits: unknown" in report.table()  # a CPU reports no memory limit


def test_topologies_and_their_errors(monkeypatch):
    with pytest.raises(ns.TopologyError, match="'v9:2x2' is not one of the forms v4:AxBxC, v5e:AxB"):
        ns.cluster.tpu_devices("v9:2x2")
    real_import = builtins.__import__

    def no_libtpu(name, *args, **kwargs):
        if name == "libtpu":
            raise ImportError("No module named 'libtpu'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libtpu)
    with pytest.raises(
        ns.TopologyError, match=r"needs libtpu, which is not installed: pip install 'nnx-shard\[tpu\]'"
    ):
        ns.cluster.tpu_devices("v5e:2x4")
    assert issubclass(ns.TopologyError, ns.NnxShardError)


@needs_libtpu
def test_tpu_topologies_slices_and_a_refused_layout():
    devices = ns.cluster.tpu_devices("v5e:2x4")
    assert len(devices) == 8 and devices[0].device_kind == "TPU v5 lite"
    assert len(ns.cluster.tpu_devices("v4:2x2x2")) == 8  # one device per chip (megacore)
    two = ns.cluster.tpu_devices("v5e:2x4", slices=2)
    assert len(two) == 16 and {d.slice_index for d in two} == {0, 1}
    mesh = ns.create_mesh((2, 8), ("dp", "fsdp"), devices=two)  # dp over DCN, fsdp within each slice
    assert {d.slice_index for d in mesh.devices[0]} == {0} and {d.slice_index for d in mesh.devices[1]} == {1}
    with pytest.raises(ns.TopologyError, match=r"libtpu does not make TPU topology 'v5e:3x7'.*not divisible"):
        ns.cluster.tpu_devices("v5e:3x7")


@needs_libtpu
def test_a_step_that_fits_a_pod_and_one_that_does_not():
    trainer = Regression({"mesh": "fsdp:-1", "sharding_strategy": STRATEGY, "progress": "off"})
    report = trainer.compile_report(ns.cluster.tpu_devices("v5e:2x4"), BATCH)
    assert report.fits is True and report.hbm_bytes == 16 * 2**30 and report.device_kind == "TPU v5 lite"
    assert report.argument_bytes >= report.state_bytes + report.batch_bytes  # TPU tiles pad small arrays
    table = report.table()
    assert "8 x TPU v5 lite, HBM 16.00 GiB per chip" in table and "fits: yes" in table and "headroom" in table
    huge = Regression({"mesh": "fsdp:-1", "sharding_strategy": [(".*", "replicate")], "width": 1 << 20})
    refused = huge.compile_report(
        ns.cluster.tpu_devices("v5e:2x4"), BATCH
    )  # 8 GiB of MLP x 4 copies, replicated
    assert refused.fits is False and refused.peak_bytes > refused.hbm_bytes
    assert "RESOURCE_EXHAUSTED" in refused.error and "fits: no" in refused.table()
    assert "largest arrays per chip" in refused.table() and "rule 0 ('.*', 'replicate')" in refused.table()


@needs_libtpu
def test_reshard_programs_compile_for_a_pod_and_say_what_each_chip_sends():
    devices = ns.cluster.tpu_devices("v5e:4x4")
    big = jax.sharding.NamedSharding(ns.create_mesh((16,), ("fsdp",), devices=devices), jax.P("fsdp", None))
    half = jax.sharding.NamedSharding(
        ns.create_mesh((8,), ("fsdp",), devices=devices[:8]), jax.P("fsdp", None)
    )
    plan = ns.resharding.plan_reshard(
        {"w": jax.ShapeDtypeStruct((4096, 1024), np.float32, sharding=big)}, {"w": half}
    )
    assert str(plan.leaves[0].route) == "collective" and not plan.through_host
    assert plan.bytes_moved == plan.ideal_bytes == 14 * 2**20
    assert plan.most_sent_per_device == 2**20 and plan.most_received_per_device == 2 * 2**20
    assert plan.never_whole and "no device ever holds a whole sharded array" in plan.summary()


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )


@needs_libtpu
def test_the_cli_plans_on_a_topology_and_reports_a_trainers_compile():
    done = run(
        "-m",
        "nnx_shard",
        "plan",
        "examples.toy_models:llama",
        "--mesh",
        "fsdp:-1",
        "--topology",
        "v5e:4x4",
        "--strategy",
        '[[".*", "fsdp(axis=\'fsdp\')"]]',
        "--rows",
        "2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "each TPU v5 lite chip holds 6.28 GiB of state (39.2% of its HBM 16.00 GiB)" in done.stdout
    done = run(
        "-m",
        "nnx_shard",
        "plan",
        "--trainer",
        "tests.cluster.test_tpu:Regression",
        "--topology",
        "v5e:2x4",
        "--mesh",
        "fsdp:-1",
        "--batch",
        '{"x": [64, 8], "y": {"shape": [64, 1], "dtype": "float32"}}',
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "8 x TPU v5 lite, HBM 16.00 GiB per chip" in done.stdout and "fits: yes" in done.stdout
    bad = run(
        "-m",
        "nnx_shard",
        "plan",
        "--trainer",
        "tests.cluster.test_tpu:Regression",
        "--topology",
        "v5e:3x7",
        "--batch",
        '{"x": [4, 8]}',
    )
    assert bad.returncode == 2 and "TopologyError" in bad.stderr and "v5e:3x7" in bad.stderr


@needs_libtpu
def test_the_vit_example_compiles_for_a_pod_and_trains_nothing(tmp_path):
    done = run("examples/vit/train.py", "--config", "tiny", "--aot", "v5e:2x4", "--batch-size", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("SUMMARY "))[8:])
    assert summary["fits"] is True and summary["devices"] == 8 and summary["flops"] > 0
    assert "fits: yes" in done.stdout
