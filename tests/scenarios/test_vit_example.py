"""Smoke tests of the ViT example, run with its documented commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.apps.multihost import free_port

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "vit" / "train.py")


def env():
    e = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    e.pop("XLA_FLAGS", None)
    return e


def summary(stdout: str) -> dict:
    return json.loads(
        next(ln for ln in stdout.splitlines() if ln.startswith("SUMMARY ")).removeprefix("SUMMARY ")
    )


def train(*args):
    r = subprocess.run(
        [sys.executable, TRAIN, "--progress", "off", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return summary(r.stdout)


def test_train_save_and_resume_on_fewer_devices(tmp_path):
    first = train(
        "--workdir",
        str(tmp_path),
        "--steps",
        "4",
        "--total-steps",
        "8",
        "--devices",
        "8",
        "--batch-size",
        "32",
    )
    assert first["mesh"] == "fsdp=8" and first["final_step"] == 4
    assert "sharded" in first["plan"]
    second = train(
        "--workdir",
        str(tmp_path),
        "--steps",
        "8",
        "--total-steps",
        "8",
        "--devices",
        "2",
        "--batch-size",
        "32",
        "--resume",
    )
    assert second["restore"] == "restored step 4, saved on 8 devices (fsdp=8), onto 2 devices (fsdp=2)"
    assert second["eval_after_restore"]["eval_loss"] == pytest.approx(first["eval"]["eval_loss"], rel=1e-5)
    assert second["final_step"] == 8 and 0 <= second["eval"]["eval_accuracy"] <= 1


def test_tensor_parallel_config_runs(tmp_path):
    out = train(
        "--config",
        "tiny_tp",
        "--workdir",
        str(tmp_path),
        "--steps",
        "2",
        "--devices",
        "8",
        "--batch-size",
        "32",
    )
    assert out["mesh"] == "fsdp=4, tp=2"


@pytest.mark.multihost
def test_two_local_processes_and_resume_on_one(tmp_path):
    port = free_port()
    common = [
        "--workdir",
        str(tmp_path),
        "--steps",
        "4",
        "--total-steps",
        "8",
        "--devices",
        "2",
        "--batch-size",
        "32",
        "--progress",
        "off",
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                TRAIN,
                *common,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    first = summary(outs[0][0])
    assert first["processes"] == 2 and first["devices"] == 4
    # Resume the 2-process run on a single process with one device.
    second = train(
        "--workdir",
        str(tmp_path),
        "--steps",
        "6",
        "--total-steps",
        "8",
        "--devices",
        "1",
        "--batch-size",
        "32",
        "--resume",
    )
    assert (
        second["restore"]
        == "restored step 4, saved on 4 devices (fsdp=4) in 2 processes, onto 1 device in 1 process"
    )
