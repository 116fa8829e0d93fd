"""Train the ViT with the nnx_shard Trainer, and resume on any number of devices or hosts.

    python examples/vit/train.py --workdir /tmp/vit --steps 200                    # 8 simulated CPU devices
    python examples/vit/train.py --workdir /tmp/vit --steps 300 --devices 4 --resume python
    examples/vit/train.py --config b16_tp,synthetic --real-devices --workdir /tmp/b16   # GPU / TPU host
    python examples/vit/train.py --coordinator 127.0.0.1:9876 --num-processes 2 --process-id 0 --devices 2 ...
    python examples/vit/train.py --distributed --real-devices ...                  # TPU pod: every worker
    runs this python examples/vit/train.py --config l16 --aot v5e:16x16 [--slices 2]   # compile for a pod
    here, train nothing

Prints one line starting with SUMMARY: a JSON summary (plan, restore report, losses, accuracy). Exits with
status 75 (EX_TEMPFAIL: run me again) when a SIGTERM (preemption, a scheduler's time limit) stopped it after
its save, so a batch script can requeue it; a hang past --step-timeout exits with 124.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default="tiny", help="tiny, tiny_tp, ti16, s16, b16, l16, h14; ',synthetic' for fake data"
    )
    ap.add_argument("--workdir", default=None, help="checkpoints and metrics (required unless --aot)")
    ap.add_argument(
        "--aot",
        default=None,
        metavar="TOPOLOGY",
        help="compile the train step for a TPU topology such as v5e:16x16 and print its report "
        "(needs libtpu)",
    )
    ap.add_argument("--slices", type=int, default=1, help="with --aot: slices of the topology over DCN")
    ap.add_argument(
        "--steps", type=int, default=None, help="stop at this step (default: the config's total_steps)"
    )
    ap.add_argument(
        "--total-steps", type=int, default=None, help="the run's length, for the learning-rate schedule"
    )
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument(
        "--mesh", default=None, help="override the config's mesh, e.g. 'fsdp:4' or 'fsdp:-1,tp:2'"
    )
    ap.add_argument("--resume", action="store_true", help="restore_and_reshard the latest checkpoint first")
    ap.add_argument(
        "--resume-auto",
        action="store_true",
        help="resume='auto': restore the newest checkpoint that verifies if there is one "
        "(restarts, requeues)",
    )
    ap.add_argument(
        "--step-timeout",
        type=float,
        default=0.0,
        help="end the process (status 124) if a step after the first or a save hangs this long (0: off)",
    )
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=0.0,
        help="the same for init, restore and the first step, its compile included (0: off)",
    )
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices per process")
    ap.add_argument("--real-devices", action="store_true", help="use the accelerators JAX finds (GPU/TPU)")
    ap.add_argument("--coordinator", default=None, help="host:port of process 0, for several local processes")
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument(
        "--distributed",
        action="store_true",
        help="jax.distributed.initialize() with no arguments (TPU pods, SLURM)",
    )
    ap.add_argument("--progress", default=None, choices=["auto", "bar", "lines", "on", "off"])
    ap.add_argument(
        "--data",
        default="batches",
        choices=["batches", "elastic"],
        help="batches: a step -> batch function; elastic: grain's ElasticIterator "
        "(each example once on any process count)",
    )
    ap.add_argument("--record-examples", action="store_true", help="write the example numbers each step fed")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--save-every", type=int, default=None)
    args = ap.parse_args(argv)
    if args.workdir is None and args.aot is None:
        ap.error("--workdir is required (unless --aot)")
    return args


def setup_jax(args: argparse.Namespace) -> None:
    import jax

    if not args.real_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    if args.coordinator:
        jax.distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            heartbeat_timeout_seconds=30,
            shutdown_timeout_seconds=30,
        )
    elif args.distributed:  # the scheduler's variables (SLURM, Kubernetes, Cloud TPU) name the processes
        jax.distributed.initialize(shutdown_timeout_seconds=30)


def run(argv: list[str] | None = None) -> dict:
    """Trains (or resumes and trains) and returns the summary; see the module docstring."""
    args = parse(argv)
    setup_jax(args)
    import jax

    import nnx_shard as ns
    from examples.vit import data as vit_data
    from examples.vit.config import get_config
    from examples.vit.trainer import ViTTrainer

    cfg = get_config(args.config)
    cfg.workdir = args.workdir or ""
    if args.aot:
        return compile_only(cfg, args)
    # total_steps is where train() stops (a resumed run too); the learning-rate schedule keeps its own length.
    cfg.schedule_steps = args.total_steps if args.total_steps is not None else cfg.total_steps
    cfg.total_steps = args.steps if args.steps is not None else cfg.schedule_steps
    if args.batch_size is not None:
        cfg.data.batch_size = args.batch_size
    if args.mesh:
        cfg.mesh = args.mesh
    if args.progress:
        cfg.progress = args.progress
    if args.resume_auto:
        cfg.resume = "auto"
    cfg.step_timeout = cfg.save_timeout = args.step_timeout
    cfg.startup_timeout = args.startup_timeout
    for key in ("log_every", "save_every"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg.record_examples = args.record_examples
    if cfg.data.name == "digits":
        data = vit_data.load_digits(seed=cfg.data.seed)
    else:
        data = vit_data.synthetic(
            4 * cfg.data.batch_size, cfg.data.image_size, cfg.data.channels, cfg.data.num_classes
        )

    trainer = ViTTrainer(cfg)
    print(
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of "
        f"{jax.device_count()} devices, mesh {ns.meshes.describe_mesh(trainer.mesh)}",
        flush=True,
    )
    summary: dict = {
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "mesh": ns.meshes.describe_mesh(trainer.mesh),
    }
    summary["plan"] = trainer.plan.summary()
    evaluate = lambda: (
        trainer.evaluate(vit_data.eval_batches(data, 40), use_ema=False) if len(data["test_labels"]) else {}
    )
    if args.resume:
        summary["restore"] = str(trainer.restore_and_reshard())
        summary["eval_after_restore"] = evaluate()
    summary["start_step"] = trainer.step
    if args.data == "elastic":
        batches = vit_data.elastic_batches(data, cfg.data.batch_size, cfg.data.seed)
    else:
        batches = vit_data.train_batches(data, cfg.data.batch_size, cfg.data.seed, cfg.data.augment)
    history = trainer.train(batches)  # up to total_steps, from wherever the run resumed
    summary["losses"] = [(h["step"], h["loss"]) for h in history]
    summary["final_step"] = trainer.step
    summary["stop_reason"] = trainer.stop_reason
    summary["eval"] = evaluate()
    if len(data["test_labels"]):
        summary["eval_ema"] = trainer.evaluate(vit_data.eval_batches(data, 40), use_ema=True)
    if jax.process_index() == 0:
        print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


def compile_only(cfg, args: argparse.Namespace) -> dict:
    """``--aot``: the compile report of this config's train step on a TPU topology; nothing is trained."""
    import dataclasses

    import jax
    import numpy as np

    import nnx_shard as ns
    from examples.vit.trainer import ViTTrainer

    if args.batch_size is not None:
        cfg.data.batch_size = args.batch_size
    if args.mesh:
        cfg.mesh = args.mesh
    cfg.progress = "off"
    n, size = cfg.data.batch_size, cfg.data.image_size
    batch = {
        "images": jax.ShapeDtypeStruct((n, size, size, cfg.data.channels), np.float32),
        "labels": jax.ShapeDtypeStruct((n,), np.int32),
    }
    report = ViTTrainer(cfg).compile_report(ns.cluster.tpu_devices(args.aot, slices=args.slices), batch)
    print(
        f"{args.config} on {args.aot}{f' x {args.slices} slices' if args.slices > 1 else ''}, "
        f"global batch {n}, mesh {cfg.mesh}"
    )
    print(report.table())
    summary = {
        "config": args.config,
        "topology": args.aot,
        "slices": args.slices,
        **dataclasses.asdict(report),
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped by a SIGTERM after saving; run again to go on


if __name__ == "__main__":
    sys.exit(EXIT_REQUEUE if run().get("stop_reason") == "preempted" else 0)
