"""The ViT train step compiled for TPU pods on this machine: per-chip memory, fits, compile seconds, FLOPs.

Question: from a laptop, does a ViT config fit a pod, and what does each chip hold? Each
(config, topology) pair is compiled ahead of time by XLA's TPU compiler through libtpu
(``examples/vit/train.py --aot``, which calls ``Trainer.compile_report``), in a fresh process so
that every compile starts cold. Then ``ns.resharding.plan_reshard`` plans moving ViT-L/16's training state
from all 256 chips of v5e:16x16 to its first 128, compiling its programs for that topology, and
says what each chip sends and receives.

    python benchmarks/bench_tpu.py [--smoke]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
RUNS = [
    ("b16", "v5e:16x16", 1, 4096),
    ("l16", "v5e:16x16", 1, 4096),
    ("h14", "v5e:16x16", 1, 4096),
    ("b16", "v5p:4x4x8", 1, 4096),
    ("l16", "v5p:4x4x8", 1, 4096),
    ("h14", "v5p:4x4x8", 1, 4096),
    ("b16", "v5e:16x16", 2, 8192),
    ("l16", "v5e:16x16", 2, 8192),
    ("h14", "v5e:16x16", 2, 8192),
]
SMOKE = [("tiny", "v5e:2x4", 1, 64)]


def compile_one(config: str, topology: str, slices: int, batch: int) -> dict:
    args = [sys.executable, str(ROOT / "examples/vit/train.py"), "--config", config, "--aot", topology]
    args += ["--slices", str(slices), "--batch-size", str(batch)]
    start = time.perf_counter()
    done = subprocess.run(
        args, capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    )
    if done.returncode != 0:
        raise SystemExit(f"{config} on {topology} failed:\n{done.stderr[-3000:]}")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("SUMMARY "))
    report = json.loads(line.removeprefix("SUMMARY "))
    report["process_seconds"] = round(time.perf_counter() - start, 1)
    report["batch"] = batch
    return report


def reshard_move(smoke: bool) -> dict:
    """ViT-L/16's state (model, adamw, EMA) planned from all chips of a topology to its first half."""
    import jax

    import nnx_shard as ns
    from examples.vit.config import get_config
    from examples.vit.trainer import ViTTrainer

    topology, config = ("v5e:2x4", "tiny") if smoke else ("v5e:16x16", "l16")
    devices = ns.cluster.tpu_devices(topology)
    cfg = get_config(config)
    cfg.progress = "off"
    trainer = ViTTrainer(cfg)
    from flax import nnx

    states = {k: nnx.state(v) for k, v in nnx.eval_shape(trainer._create).items()}
    strategy = list(cfg.sharding_strategy)
    big = ns.create_mesh((len(devices),), ("fsdp",), devices=devices)
    small = ns.create_mesh((len(devices) // 2,), ("fsdp",), devices=devices[: len(devices) // 2])
    src = ns.plan_sharding(states, strategy, big)
    dst = ns.plan_sharding(states, strategy, small)
    tree = {k: ns.placement.abstract_target(states[k], src.shardings[k]) for k in states}
    start = time.perf_counter()
    plan = ns.resharding.plan_reshard(tree, dst.shardings)
    seconds = time.perf_counter() - start
    del jax
    return {
        "config": config,
        "move": f"{topology}: {len(devices)} -> {len(devices) // 2} chips",
        "plan_and_compile_seconds": round(seconds, 1),
        "summary": plan.summary(),
        "bytes_moved": plan.bytes_moved,
        "ideal_bytes": plan.ideal_bytes,
        "most_sent_per_chip": plan.most_sent_per_device,
        "most_received_per_chip": plan.most_received_per_device,
        "peak_per_chip": plan.peak_bytes_per_device,
        "never_whole": plan.never_whole,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    result = {"benchmark": "bench_tpu", "machine": machine(), "compiles": []}
    for run in SMOKE if args.smoke else RUNS:
        r = compile_one(*run)
        keep = (
            "config",
            "topology",
            "slices",
            "batch",
            "devices",
            "device_kind",
            "argument_bytes",
            "temp_bytes",
        )
        keep += (
            "peak_bytes",
            "hbm_bytes",
            "fits",
            "flops",
            "compile_seconds",
            "state_bytes",
            "process_seconds",
        )
        result["compiles"].append({k: r[k] for k in keep} | {"collectives": r["collectives"]})
        print(json.dumps(result["compiles"][-1]), file=sys.stderr, flush=True)
    result["reshard"] = reshard_move(args.smoke)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
