"""make demo: train the ViT on 8 simulated devices, save, resume on 4 through restore_and_reshard, report.

    python examples/vit/demo.py [--workdir /tmp/nnx_shard_vit_demo] [--steps 200] [--more 150]

Each phase is a fresh process, as it would be after a node lost half its devices.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def phase(workdir: Path, devices: int, steps: int, total: int, resume: bool) -> dict:
    cmd = [
        sys.executable,
        str(HERE / "train.py"),
        "--workdir",
        str(workdir),
        "--steps",
        str(steps),
        "--total-steps",
        str(total),
        "--devices",
        str(devices),
    ]
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    # Progress goes to the terminal (stderr); the summary comes back on stdout.
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise SystemExit(f"the {devices}-device phase failed (exit {out.returncode})")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("SUMMARY "))
    return json.loads(line.removeprefix("SUMMARY "))


def plot(workdir: Path, restore_step: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    before = [r for r in records if r["step"] <= restore_step]
    after = [r for r in records if r["step"] > restore_step]
    ax.plot([r["step"] for r in before], [r["loss"] for r in before], label="8 devices (fsdp=8)")
    ax.plot(
        [r["step"] for r in after],
        [r["loss"] for r in after],
        label="4 devices (fsdp=4), after restore_and_reshard",
    )
    ax.axvline(restore_step, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("ViT on scikit-learn digits: 8 devices, then 4")
    ax.legend()
    fig.tight_layout()
    path = workdir / "loss_curve.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/nnx_shard_vit_demo")
    ap.add_argument("--steps", type=int, default=400, help="steps on 8 devices")
    ap.add_argument("--more", type=int, default=200, help="further steps on 4 devices after the restore")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    start = time.time()
    print(f"== phase 1: training the ViT on 8 simulated CPU devices for {args.steps} steps", flush=True)
    total = args.steps + args.more  # one learning-rate schedule across both phases
    first = phase(workdir, 8, args.steps, total, resume=False)
    print(f"== phase 2: a new process with 4 devices resumes and trains {args.more} more steps", flush=True)
    second = phase(workdir, 4, total, total, resume=True)
    png = plot(workdir, first["final_step"])
    last_before = first["losses"][-1]
    first_after = second["losses"][0]
    print()
    print("== report")
    print("sharding plan (8 devices):")
    print("  " + first["plan"].replace("\n", "\n  "))
    print(f"reshard: {second['restore']}")
    print(
        f"loss just before the restore: step {last_before[0]} train loss {last_before[1]:.4f}; test loss "
        f"{first['eval']['eval_loss']:.4f}"
    )
    print(
        f"loss just after the restore:  test loss {second['eval_after_restore']['eval_loss']:.4f} (same "
        f"state, now on 4 devices); step {first_after[0]} train loss {first_after[1]:.4f}"
    )
    print(
        f"final test accuracy (step {second['final_step']}): {100 * second['eval']['eval_accuracy']:.1f}% "
        f"(EMA: {100 * second['eval_ema']['eval_accuracy']:.1f}%)"
    )
    print(f"loss curve: {png}")
    print(f"checkpoints and metrics: {workdir}; {time.time() - start:.0f} s in all")


if __name__ == "__main__":
    main()
