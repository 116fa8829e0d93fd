"""nnx-shard plan, run as a user runs it: a subprocess, from abstract shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def test_plan_with_the_users_own_optimizer_and_whole_state(tmp_path):
    common = [
        "--devices",
        "4",
        "--mesh",
        "fsdp:4",
        "--strategy",
        '[[".*", "fsdp(axis=\'fsdp\', min_size_to_shard_mb=0)"]]',
        "--json",
    ]
    r = cli("plan", "examples.toy_models:mlp", "--optimizer", "examples.toy_models:optimizer", *common)
    assert r.returncode == 0, r.stderr
    leaves = {leaf["path"]: leaf for leaf in json.loads(r.stdout)["leaves"]}
    # MultiSteps accumulators are sharded like the parameters they mirror
    assert leaves["optimizer/opt_state/acc_grads/head/kernel"]["spec"] == leaves["model/head/kernel"]["spec"]
    r = cli("plan", "examples.toy_models:train_state", "--model-kwargs", '{"width": 64}', *common)
    assert r.returncode == 0, r.stderr
    paths = [leaf["path"] for leaf in json.loads(r.stdout)["leaves"]]
    assert "optimizer/opt_state/0/mu/head/kernel" in paths  # lion's state: the paths of the real run
    assert "ema/params/head/kernel" in paths and not any(
        p.startswith("ema/params/") and "rngs" in p for p in paths
    )


def test_bad_model_kwargs_and_optimizers_are_clear_errors():
    base = [
        "plan",
        "examples.toy_models:mlp",
        "--devices",
        "4",
        "--mesh",
        "fsdp:4",
        "--strategy",
        '[[".*", "replicate"]]',
    ]
    r = cli(*base, "--model-kwargs", '{"widht": 64}')
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "building examples.toy_models:mlp with --model-kwargs {'widht': 64} failed" in r.stderr
    assert "unexpected keyword argument 'widht'" in r.stderr
    r = cli(*base[:1], "examples.toy_models:llama", *base[2:], "--model-kwargs", '{"sise": "tiny"}')
    assert "--model-kwargs ['sise'] are not parameters of examples.toy_models:llama" in r.stderr
    r = cli(*base, "--model-kwargs", "[64]")
    assert r.returncode == 2 and "is a JSON object of keyword arguments" in r.stderr
    r = cli(*base, "--optimizer", "lion")
    assert r.returncode == 2 and "use adamw, adam, sgd, none, or package.module:factory" in r.stderr
    r = cli(*base, "--optimizer", "examples.toy_models:mlp")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_plan_builds_a_module_class_as_well_as_a_factory(tmp_path):
    (tmp_path / "mlp.py").write_text(
        "from flax import nnx\n\n"
        "class MLP(nnx.Module):\n"
        "    def __init__(self, width: int, *, rngs: nnx.Rngs):\n"
        "        self.up = nnx.Linear(width, 4 * width, rngs=rngs)\n"
        "        self.down = nnx.Linear(4 * width, width, rngs=rngs)\n"
    )
    env_path = f"{tmp_path}:{ROOT}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nnx_shard",
            "plan",
            "mlp:MLP",
            "--model-kwargs",
            '{"width": 64}',
            "--mesh",
            "fsdp:2",
            "--devices",
            "2",
            "--strategy",
            STRATEGY,
        ],
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "model/up/kernel" in r.stdout and "mesh (fsdp=2), 2 devices" in r.stdout
