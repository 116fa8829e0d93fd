"""Smoke tests: the demo and each benchmark run for a few steps, as a user would run them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=ROOT):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_sharding_demo():
    out = run("examples/sharding_demo.py", "--steps", "3")
    placed = re.search(r"fullest device holds (.*) \(plan: (.*)\)", out)
    assert placed and placed.group(1) == placed.group(2), out
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "still P(None, 'fsdp') after training" in out


def test_bench_infer_smoke(tmp_path):
    out_file = tmp_path / "infer.json"
    run("bench_infer.py", "--smoke", "--out", str(out_file), cwd=ROOT / "benchmarks")
    result = json.loads(out_file.read_text())
    assert result["jax_arrays_allocated"] == 0
    assert result["leaves"] == 4 * 16 * 4 + 2  # model, mu, nu, EMA per layer, + count and step
    # 6 kernels under anchored rules, in the model, adam mu and nu, and the EMA.
    assert result["leaves_matched_by_parameter_path"] == 4 * 6 * 4


def test_bench_init_smoke(tmp_path):
    out_file = tmp_path / "init.json"
    run("bench_init.py", "--smoke", "--out", str(out_file), cwd=ROOT / "benchmarks")
    result = json.loads(out_file.read_text())
    ours, base = result["runs"]["create_sharded"], result["runs"]["init_then_device_put"]
    assert ours["checksum"] == base["checksum"]
    assert ours["live_bytes_fullest_device"] == ours["plan_bytes_per_device"]
    assert ours["mu_spec"] == "P(None, 'fsdp')"


def test_bench_reshard_smoke(tmp_path):
    out_file = tmp_path / "reshard.json"
    run("bench_reshard.py", "--smoke", "--out", str(out_file), cwd=ROOT / "benchmarks")
    result = json.loads(out_file.read_text())
    ours = result["runs"]["nnx_shard.reshard"]
    assert ours["goes_through_host"] is False
    assert ours["bytes_moved"] == ours["ideal_bytes"]
    assert result["runs"]["host round trip"]["goes_through_host"] is True


def test_bench_step_smoke(tmp_path):
    out_file = tmp_path / "step.json"
    run("bench_step.py", "--smoke", "--out", str(out_file), cwd=ROOT / "benchmarks")
    result = json.loads(out_file.read_text())
    assert result["trainer_step_ms"] > 0 and result["hand_jit_step_ms"] > 0


def test_bench_restore_smoke(tmp_path):
    out_file = tmp_path / "restore.json"
    run("bench_restore.py", "--smoke", "--out", str(out_file), cwd=ROOT / "benchmarks")
    result = json.loads(out_file.read_text())
    ours = result["runs"]["nnx_shard"]
    assert ours["kernel_mesh"] == {"fsdp": 4}
    assert ours["report"] == "restored step 1, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)"


def test_bench_vit_smoke(tmp_path):
    out_file = tmp_path / "vit.json"
    run("bench_vit.py", "--smoke", "--out", str(out_file), cwd=ROOT / "benchmarks")
    result = json.loads(out_file.read_text())
    assert result["mesh"] == "fsdp=8" and result["trainer_images_per_s"] > 0
