"""nnx-shard plan, run as a user runs it: a subprocess, from abstract shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGY = '[[".*embed.*", "replicate"], [".*", "fsdp(axis=\\"fsdp\\", min_size_to_shard_mb=0)"]]'


def cli(*args, cwd=ROOT):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "nnx_shard", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plan_prints_table_and_timings():
    r = cli(
        "plan",
        "examples.toy_models:llama",
        "--model-kwargs",
        '{"size": "tiny"}',
        "--mesh",
        "fsdp:4",
        "--devices",
        "4",
        "--strategy",
        STRATEGY,
    )
    assert r.returncode == 0, r.stderr
    assert "mesh (fsdp=4), 4 devices" in r.stdout
    assert "model/layers/0/q/kernel" in r.stdout or "more leaves" in r.stdout
    assert "rule 1: ('.*'," in r.stdout
    assert "infer_sharding" in r.stdout and "nnx.eval_shape" in r.stdout


def test_plan_json_from_toml_config(tmp_path):
    cfg = tmp_path / "plan.toml"
    cfg.write_text(
        'model = "examples.toy_models:llama"\nmesh = "dp:2,tp:2"\ndevices = 4\n'
        'model_kwargs = { size = "tiny" }\noptimizer = "sgd"\nema = 0\n'
        "strategy = [['.*embedding', \"shard_dim(axis='tp', dim=-1)\"], ['.*', 'replicate']]\n"
    )
    r = cli("plan", "--config", str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["mesh"] == {"dp": 2, "tp": 2}
    leaves = {p["path"]: p for p in plan["leaves"]}
    assert leaves["model/embed/embedding"]["spec"] == [None, "tp"]
    assert leaves["optimizer/opt_state/0/trace/embed/embedding"]["spec"] == [None, "tp"]
    assert not any(p.startswith("ema/") for p in leaves)
    assert plan["bytes_per_device"] < plan["total_bytes"]


def test_plan_errors_are_clear(tmp_path):
    r = cli(
        "plan",
        "examples.toy_models:llama",
        "--devices",
        "4",
        "--mesh",
        "fsdp:4",
        "--strategy",
        '[[".*q/kernel", "fsdp(axis=\'fsdp\')"]]',
        "--model-kwargs",
        '{"size": "tiny"}',
    )
    assert r.returncode == 2
    assert "UnmatchedLeavesError" in r.stderr and "('.*', 'replicate')" in r.stderr
    assert (
        cli("plan", "nope:thing", "--mesh", "fsdp:1", "--strategy", "[]").stderr.count("cannot import 'nope'")
        == 1
    )
    assert "missing --mesh" in cli("plan", "examples.toy_models:mlp").stderr
    py = tmp_path / "cfg.py"
    py.write_text("open('x', 'w')")
    assert "expected .toml or .json" in cli("plan", "--config", str(py)).stderr
    assert (
        "not valid JSON"
        in cli("plan", "examples.toy_models:mlp", "--mesh", "fsdp:1", "--strategy", "[(x)]").stderr
    )
