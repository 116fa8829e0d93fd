"""The accelerator JAX finds (a GPU): the ViT example, a Trainer step against a hand-written jit step,
sharded creation against init-then-``jax.device_put``, and a restore against plain Orbax.

Question: do the CPU figures of RESULTS.md hold on a real accelerator, and does the compiler's own
memory report (``memory_analysis()``) say what the device's allocator then holds
(``device.memory_stats()["peak_bytes_in_use"]``)?

Each part runs in a fresh process of this script, so each allocator peak is its own part's:
- ``example``: ``examples/vit/train.py --config b16,synthetic --real-devices``, then a resume from its
  checkpoint (restore_and_reshard on the device);
- ``vit``: ``bench_vit.py --real-devices``: the example's Trainer against a hand-written jit step, and the
  compiles of each one's first call split into JAX's phases (tracing, lowering to MLIR, XLA's compile);
- ``step``: the MLP of ``bench_step.py`` (model + adamw + EMA, donated) at GPU sizes, the same
  comparison (per step of a ``train()`` call of ``steps`` steps, and the marginal step with the call's
  fixed cost apart), and the Trainer's ``compile_report`` peak against ``memory_stats`` while it trains;
- ``create_sharded`` / ``device_put``: a model + adamw + EMA stack created in its shardings, or built
  whole and then placed; seconds and the allocator's peak;
- ``save``, then ``restore_nnx_shard`` / ``restore_nnx_shard_unverified`` / ``restore_orbax``:
  ``ShardingHooks.restore_and_reshard`` (verified, and with ``Checkpointer(verify=False)``) against plain
  Orbax into the same shardings, each three times in its process (cold: the first; warm: the next two);
- ``saves``: ``ShardingHooks.save`` and the ``Checkpointer`` against plain Orbax's ``CheckpointManager``,
  sync and async (the call's return and the finished write), and the Trainer's step while an async save
  of it runs against the same steps without;
- ``snapshots``: the step's Trainer with ``snapshot_every`` 0, 10 and 100 in alternating rounds (taken
  and skipped counted), one snapshot's milliseconds on the step's path and in the background (timed
  around ``write`` and ``wait``), and XLA's bytes accessed by the devices' stage programs over one
  read and one write of the state (1.0: the fingerprint shares fused with the copies);
- ``vit_init`` / ``vit_init_inlined``: the compile of the ViT example's sharded init alone, as shipped (on
  a GPU with JAX's threefry kernel, scoped to the lowering) and with JAX's default lowering, the inlined
  hash (the code before: over 140 s on an H200, so capped at ``INLINED_CAP_S``); ``init_bits``: a tiny
  ViT's init both ways, every leaf compared bit for bit, and the user's flag after the call.

    python benchmarks/bench_gpu.py --out results/bench_gpu.json           # on a GPU host
    python benchmarks/bench_gpu.py --parts step,create_sharded,device_put  # some parts only
    python benchmarks/bench_gpu.py --smoke                                  # tiny, on 2 CPU devices
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PARTS = (  # the quick ones first
    "step",
    "create_sharded",
    "device_put",
    "save",
    "restore_nnx_shard",
    "restore_nnx_shard_unverified",
    "restore_orbax",
    "saves",
    "snapshots",
    "init_bits",
    "vit_init",
    "vit_init_inlined",
    "example",
    "vit",
)
PART_TIMEOUT_S = 300
QUICK = (
    "step,create_sharded,device_put,save,restore_nnx_shard,restore_nnx_shard_unverified,restore_orbax,saves,"
    "snapshots,init_bits,vit_init,vit_init_inlined"
)
# the inlined threefry's compile, enough to show it; the whole run stays within 8 minutes  # the example and
# bench_vit have their own tests
INLINED_CAP_S = 60
REPORTED = ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes", "state_bytes", "batch_bytes")
STRATEGY = [(".*bias", "replicate"), (".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]


def sizes(smoke: bool) -> dict[str, object]:
    if smoke:
        return dict(
            vit_config="tiny",
            vit_batch=16,
            vit_steps=3,
            vit_rounds=2,
            width=64,
            depth=2,
            rows=16,
            steps=3,
            rounds=2,
            layers=2,
            stack_width=256,
            example_steps=4,
            snapshot_steps=20,
            snapshot_rounds=2,
        )
    return dict(
        vit_config="b16",
        vit_batch=128,
        vit_steps=10,
        vit_rounds=5,
        width=4096,
        depth=8,
        rows=1024,
        steps=20,
        rounds=5,
        layers=8,
        stack_width=4096,
        example_steps=20,
        snapshot_steps=100,
        snapshot_rounds=3,
    )


def fingerprint(x) -> int:
    """The sum of ``x``'s bits as unsigned integers: exact, whatever order the device adds in.

    (A float sum is not: a GPU's reduction may add in another order from one program to the next.)
    """
    import jax
    import jax.numpy as jnp

    x = x.get_value() if hasattr(x, "get_value") else x  # an nnx.Variable
    return int(jnp.sum(jax.lax.bitcast_convert_type(x, jnp.uint32), dtype=jnp.uint32))


def allocator() -> dict[str, int] | None:
    """``memory_stats()`` of the first device, or None where the backend keeps none (the CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def part_example(s: dict, work: Path) -> dict:
    """The bundled example on the real devices, then resumed from its checkpoint (a restore on the device)."""
    config = s["vit_config"] if s["vit_config"] == "tiny" else f"{s['vit_config']},synthetic"
    out = {}
    for name, extra in (("train", []), ("resume", ["--resume"])):
        steps = s["example_steps"] * (1 if name == "train" else 2)
        cmd = [
            sys.executable,
            str(ROOT / "examples" / "vit" / "train.py"),
            "--config",
            config,
            "--real-devices",
            "--workdir",
            str(work / "vit"),
            "--steps",
            str(steps),
            "--progress",
            "off",
            *extra,
        ]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        seconds = time.perf_counter() - t
        if done.returncode:
            raise RuntimeError(f"example {name} failed:\n{done.stderr[-3000:]}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("SUMMARY "))
        summary = json.loads(line.removeprefix("SUMMARY "))
        out[name] = {
            "wall_s": round(seconds, 2),
            "devices": summary["devices"],
            "mesh": summary["mesh"],
            "start_step": summary["start_step"],
            "final_step": summary["final_step"],
            "first_loss": summary["losses"][0] if summary["losses"] else None,
            "last_loss": summary["losses"][-1] if summary["losses"] else None,
            "restore": summary.get("restore"),
        }
    return out


def part_vit(s: dict, work: Path) -> dict:
    out = work / "vit.json"
    cmd = [
        sys.executable,
        str(HERE / "bench_vit.py"),
        "--real-devices",
        "--config",
        s["vit_config"],
        "--batch",
        str(s["vit_batch"]),
        "--steps",
        str(s["vit_steps"]),
        "--rounds",
        str(s["vit_rounds"]),
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env=os.environ.copy())
    if done.returncode:
        raise RuntimeError(f"bench_vit failed:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result.pop("machine", None)
    return result


def timed(step, states, batch, steps: int, rounds: int) -> float:
    """Median seconds per step of a jitted ``step(states, batch) -> (states, metrics)``, warm."""
    import statistics

    from common import time_steps

    states, _ = time_steps(step, states, batch, 1)
    times = []
    for _ in range(rounds):
        states, seconds = time_steps(step, states, batch, steps)
        times.append(seconds)
    return statistics.median(times)


def part_step(s: dict, work: Path) -> dict:
    import jax
    import jax.numpy as jnp
    from bench_step import quiet_trainer
    from common import CompilePhases, call_fixed_cost, hand_written_step, marginal_timing, max_abs_diff

    n = jax.device_count()
    trainer, batch = quiet_trainer(
        s["width"], s["depth"], s["rows"], mesh=f"fsdp:{n}", workdir=str(work / "step")
    )
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    began = time.perf_counter()
    with CompilePhases() as phases:
        report = trainer.compile_report(jax.devices(), abstract)  # on abstract state: allocates nothing
    compile_s = time.perf_counter() - began  # the train step's lowering and compile (item 1)
    trainer.init()
    before = allocator()
    trainer.train(lambda step: batch, steps=3)
    jax.block_until_ready(trainer.states)
    during = allocator()  # before the hand-written step's copy of the state exists
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    jitted, states = hand_written_step(trainer, batch, loss)
    trainer.train(lambda step: batch, steps=1)  # compile both first: both then take the same steps
    states, _ = jitted(states, batch)
    n = s["steps"]
    timing = marginal_timing(trainer, batch, jitted, states, n, s["rounds"])
    diff = max_abs_diff(trainer.states["model"], timing["states"]["model"])
    del states, timing["states"]
    ours, theirs = timing["trainer_call"], timing["hand_call"]  # per step of an n-step train() call
    fixed = call_fixed_cost(trainer, batch, 20)
    adds = {}  # the hand-written step with what the Trainer's adds, part by part: where its extra time goes
    for what in ("norm", "norm,cond", "norm,select"):
        step, states = hand_written_step(trainer, batch, loss, adds=what)
        adds[what] = round(1e3 * timed(step, states, batch, s["steps"], s["rounds"]), 3)
        del step, states
    result = {
        "params": sum(x.size for x in jax.tree.leaves(trainer.states["model"])),
        "batch": s["rows"],
        "width_depth": [s["width"], s["depth"]],
        "trainer_step_ms": round(1e3 * ours, 3),
        "hand_jit_step_ms": round(1e3 * theirs, 3),
        "ratio": round(ours / theirs, 3),
        # one more step inside a train() call, and the fixed work of a call (files, lock, final flush):
        "trainer_step_marginal_ms": round(1e3 * timing["trainer_step"], 3),
        "hand_jit_step_marginal_ms": round(1e3 * timing["hand_step"], 3),
        "marginal_ratio": round(timing["trainer_step"] / timing["hand_step"], 3),
        "train_call_fixed_ms": round(1e3 * fixed, 3),
        "steps_per_call": [n, 3 * n],
        "hand_jit_with_grad_norm_ms": adds["norm"],
        "hand_jit_with_grad_norm_and_cond_ms": adds["norm,cond"],  # the Trainer's guard
        "hand_jit_with_grad_norm_and_select_ms": adds["norm,select"],  # the other way to guard
        "max_param_diff_vs_hand": diff,
        "compile_report": {k: getattr(report, k) for k in REPORTED},
        "step_compile_s": round(compile_s, 3),  # compile_report: the step lowered and compiled, once
        "step_compile_phases_s": phases.seconds,  # tracing, lowering to MLIR, XLA's compile
    }
    if during is not None:
        result["memory_stats_before_steps"] = before
        result["memory_stats_after_3_steps"] = during
        result["peak_over_compile_report"] = round(during["peak_bytes_in_use"] / report.peak_bytes, 3)
    return result


def _stack(s: dict):
    from common import stack_state_factory

    return stack_state_factory(s["layers"], s["stack_width"])


def part_create(s: dict, work: Path, variant: str) -> dict:
    import jax
    from common import create_state

    import nnx_shard as ns

    mesh = ns.create_mesh((jax.device_count(),), ("fsdp",))
    create = _stack(s)
    t = time.perf_counter()
    states, plan, memory = create_state(variant, create, STRATEGY, mesh)
    result: dict[str, object] = {"seconds": round(time.perf_counter() - t, 3)}
    if memory is not None:  # the peak XLA expects: arguments + outputs - donated aliases + temporaries
        result["compile_peak_bytes"] = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
    result["state_bytes"] = plan.total_bytes
    result["state_bytes_per_device"] = plan.bytes_per_device
    result["memory_stats"] = allocator()
    result["fingerprint"] = fingerprint(states["model"]["layers"][0]["kernel"])
    if variant == "device_put":  # the same init under a plain jax.jit (JAX's default threefry lowering):
        # on a GPU, eager initializers round differently from fused ones (FMA contraction)
        from flax import nnx

        jitted = jax.jit(lambda: {k: nnx.state(o) for k, o in create().items()})()
        result["fingerprint_plain_jit"] = fingerprint(jitted["model"]["layers"][0]["kernel"])
    return result


def part_save(s: dict, work: Path) -> dict:
    import jax

    import nnx_shard as ns

    mesh = ns.create_mesh((jax.device_count(),), ("fsdp",))
    hooks = ns.ShardingHooks(STRATEGY, mesh)
    hooks.on_init(_stack(s))
    with ns.Checkpointer(str(work / "ckpt"), async_save=False) as ckpt:
        t = time.perf_counter()
        hooks.save(ckpt, 1)
        seconds = time.perf_counter() - t
    kernel = hooks.states()["model"]["layers"][0]["kernel"]
    return {
        "seconds": round(seconds, 3),
        "state_bytes": hooks.plan.total_bytes,
        "fingerprint": fingerprint(kernel),
    }


class _Said:
    """The nnx_shard logger's messages while it is installed (where a verified read's time goes)."""

    def __enter__(self):
        import logging

        self.messages: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: self.messages.append(record.getMessage())
        self.logger, self.handler = logging.getLogger("nnx_shard"), handler
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)

    def seconds(self, start: str) -> list[float]:
        """The seconds ending each message that starts with ``start`` ("... in 0.123 s")."""
        return [float(m.rsplit(" in ", 1)[1].split()[0]) for m in self.messages if m.startswith(start)]


def part_restore(s: dict, work: Path, variant: str) -> dict:
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    import nnx_shard as ns

    mesh = ns.create_mesh((jax.device_count(),), ("fsdp",))
    abstract = nnx.eval_shape(_stack(s))
    shardings = ns.infer_sharding(abstract, STRATEGY, mesh)
    times, compile_after = [], None
    with _Said() as said:
        for _ in range(3):  # cold (the first in this process), then warm twice
            t = time.perf_counter()
            if variant.startswith("restore_nnx_shard"):
                hooks = ns.ShardingHooks(STRATEGY, mesh)
                hooks.adopt(abstract)  # nothing allocated before the read
                verify = not variant.endswith("unverified")
                report = str(hooks.restore_and_reshard(ns.Checkpointer(str(work / "ckpt"), verify=verify)))
                states = hooks.states()
            else:  # plain Orbax into the same shardings, the target built by hand
                report = ""
                wanted = {k: nnx.state(v) for k, v in abstract.items()}
                target = ns.placement.abstract_target(wanted, shardings)
                restore = ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                )
                with ocp.CheckpointManager(str(work / "ckpt")) as mgr:
                    states = mgr.restore(1, args=ocp.args.Composite(state=restore))["state"]
            jax.block_until_ready(states)
            times.append(time.perf_counter() - t)
            if compile_after is None:  # what the process's next compile costs (a train step's, say): the
                # compiler's first use in a process pays its start, inside a verified read, after the others
                t = time.perf_counter()
                jax.jit(lambda x: x * 3 + 1).lower(jax.ShapeDtypeStruct((8,), "float32")).compile()
                compile_after = time.perf_counter() - t
            kernel = states["model"]["layers"][0]["kernel"]
            kernel = kernel.get_value() if hasattr(kernel, "get_value") else kernel
            value = fingerprint(kernel)
            del states, kernel
    return {
        "verify_s": said.seconds("verified "),  # the fingerprints after each read (cold, warm, warm)
        "structure_s": said.seconds("checked the structure "),  # the saved tree's metadata against ours
        "orbax_read_s": said.seconds("read step "),  # Orbax's read inside ours
        "compile_wait_s": said.seconds("waited for the fingerprint programs "),  # after Orbax's read
        "compile_ahead_s": said.seconds("compiled "),  # in a thread while Orbax read (the cold read)
        "seconds": round(times[0], 3),
        "next_compile_s": round(compile_after, 3),  # a trivial program's, right after the cold read
        "seconds_warm": round(min(times[1:]), 3),
        "seconds_all": [round(t, 3) for t in times],
        "memory_stats": allocator(),
        "fingerprint": value,
        "report": report,
    }


def part_saves(s: dict, work: Path) -> dict:
    """Saves of the stack, sync and async, by ShardingHooks / the Checkpointer and by plain Orbax; then the
    step's Trainer stepping while an async save of its state runs (its own, or plain Orbax's), against the
    same steps without one."""
    import statistics

    import jax
    import orbax.checkpoint as ocp
    from bench_step import quiet_trainer

    import nnx_shard as ns

    mesh = ns.create_mesh((jax.device_count(),), ("fsdp",))
    hooks = ns.ShardingHooks(STRATEGY, mesh)
    hooks.on_init(_stack(s))
    states = hooks.states()
    jax.block_until_ready(states)
    out: dict[str, object] = {"state_bytes": hooks.plan.total_bytes}
    with _Said() as said:  # the fingerprints' seconds in each of our saves, from the log
        for k, kind in enumerate(("sync", "async") * 3):  # alternating, each into a new folder
            t = time.perf_counter()
            with ns.Checkpointer(str(work / f"ours{k}"), async_save=kind == "async") as ckpt:
                hooks.save(ckpt, 1)
                returned = time.perf_counter() - t
                ckpt.wait_until_finished()
            ours = (returned, time.perf_counter() - t)
            t = time.perf_counter()
            options = ocp.CheckpointManagerOptions(enable_async_checkpointing=kind == "async")
            with ocp.CheckpointManager(str(work / f"orbax{k}"), options=options) as mgr:
                mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(states)))
                returned = time.perf_counter() - t
                mgr.wait_until_finished()
            theirs = (returned, time.perf_counter() - t)
            for who, (r, done) in (("nnx_shard", ours), ("orbax", theirs)):
                out.setdefault(f"{who}_{kind}_returned_s", []).append(round(r, 3))
                out.setdefault(f"{who}_{kind}_finished_s", []).append(round(done, 3))
    out["fingerprint_s"] = said.seconds("fingerprinted ")
    for kind in ("sync", "async"):  # the first of each (cold: its compiles) aside, the medians
        a, b = (statistics.median(out[f"{w}_{kind}_finished_s"][1:]) for w in ("nnx_shard", "orbax"))
        out[f"ratio_{kind}"] = round(a / b, 3)
    del hooks, states
    n, steps = jax.device_count(), s["snapshot_steps"]
    trainer, batch = quiet_trainer(
        s["width"], s["depth"], s["rows"], mesh=f"fsdp:{n}", workdir=str(work / "t")
    )
    trainer.train(lambda step: batch, steps=steps)
    during: dict[str, list[float]] = {"none": [], "nnx_shard": [], "orbax": []}
    for k in range(2):  # the steps after a save starts, until the last is done (not the save's end)
        during["none"].append(steps_until_done(trainer, batch, steps))
        trainer.save(force=True)  # async (the Trainer's default): the steps run while it is written
        during["nnx_shard"].append(steps_until_done(trainer, batch, steps))
        trainer.checkpointer.wait_until_finished()
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
        with ocp.CheckpointManager(str(work / f"orbax_t{k}"), options=options) as mgr:
            mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(trainer.states)))
            during["orbax"].append(steps_until_done(trainer, batch, steps))
    ms = {k: 1e3 * statistics.median(v) for k, v in during.items()}
    out.update(
        step_ms=round(ms["none"], 3),
        step_ms_during_async_save=round(ms["nnx_shard"], 3),
        step_ms_during_orbax_async_save=round(ms["orbax"], 3),
        step_ratio_during_async_save=round(ms["nnx_shard"] / ms["none"], 3),
        step_ratio_during_async_save_over_orbax=round(ms["nnx_shard"] / ms["orbax"], 3),
    )
    return out


def steps_until_done(trainer, batch, steps: int) -> float:
    """Seconds per step of ``trainer.train(steps=steps)`` until its last step is done: a callback on that
    step reads the clock, so what ``train()`` waits for after its steps (a save or snapshot still being
    written) is not counted."""
    import math

    import jax

    done = {}
    end = trainer.step + steps
    trainer.loop.callbacks = [c for c in trainer.loop.callbacks if c[0].__name__ != "_clock"]

    def _clock(step, metrics, trainer):
        if step == end:
            done["t"] = time.perf_counter()

    trainer.add_callback(_clock, every=math.gcd(end, steps))  # on the last step (and some before it)
    jax.block_until_ready(trainer.states)
    t = time.perf_counter()
    trainer.train(lambda step, b=batch: b, steps=steps)
    return (done["t"] - t) / steps


def part_snapshots(s: dict, work: Path) -> dict:
    """The step's Trainer with snapshot_every 0, 10 and 100, alternating rounds; where one snapshot's time
    goes."""
    import statistics

    import jax
    from bench_snapshot import snapshot_events, stage_traffic, where_the_time_goes
    from bench_step import quiet_trainer

    n, shm = jax.device_count(), "/dev/shm" if os.path.isdir("/dev/shm") else str(work)
    built = {}
    for every in (0, 10, 100):
        trainer, batch = quiet_trainer(
            s["width"],
            s["depth"],
            s["rows"],
            mesh=f"fsdp:{n}",
            workdir=str(work / f"snap{every}"),
            snapshot_every=every,
            snapshot_dir=tempfile.mkdtemp(prefix="bench_gpu_", dir=shm),
        )
        # half a round first: each round's snapshot at a multiple of 100 falls in its middle
        trainer.train(lambda step, b=batch: b, steps=s["snapshot_steps"] // 2)
        built[every] = (trainer, batch)
    times = {every: [] for every in built}
    for _ in range(s["snapshot_rounds"]):
        for every, (trainer, batch) in built.items():
            times[every].append(steps_until_done(trainer, batch, s["snapshot_steps"]))
    out: dict[str, object] = {}
    for every in (10, 100):
        ratios = [t / t0 for t, t0 in zip(times[every], times[0], strict=True)]
        taken, skipped = snapshot_events(built[every][0])
        out[f"every_{every}"] = {
            "ratio": round(statistics.median(ratios), 4),
            "ratios": [round(r, 4) for r in ratios],
            "step_ms": round(1e3 * statistics.median(times[every]), 3),
            "taken": taken,
            "skipped": skipped,
        }
    out["step_ms_no_snapshot"] = round(1e3 * statistics.median(times[0]), 3)
    states = built[0][0].hooks.states()
    where = where_the_time_goes(states)
    out.update(
        snapshot_ms_on_the_steps_path=round(where["on_path_ms"], 2),
        snapshot_ms_in_the_background=round(where["background_ms"], 2),
        stage_bytes_over_one_read_and_write=round(stage_traffic(states), 3),
    )
    for trainer, _ in built.values():  # the snapshots in host memory go with the part
        shutil.rmtree(trainer.config.snapshot_dir, ignore_errors=True)
    return out


def _vit_init(config: str):
    import nnx_shard as ns

    sys.path.insert(0, str(ROOT))
    from examples.vit.config import get_config
    from examples.vit.trainer import ViTTrainer

    cfg = get_config(config)
    trainer = ViTTrainer({**cfg.to_dict(), "workdir": "", "progress": "off"})
    return ns.placement.sharded_init_fn(trainer._create, cfg.sharding_strategy, trainer.mesh)


def part_vit_init(s: dict, work: Path, variant: str) -> dict:
    """Lowering and compiling the ViT example's sharded init (model, adamw, EMA), nothing run: as shipped,
    or (``inlined``) through the plain ``jax.jit`` with JAX's default threefry lowering."""
    import jax

    t = time.perf_counter()
    init, _, plan = _vit_init(s["vit_config"])
    lowered = init.jitted.lower() if variant.endswith("inlined") else init.lower()
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {
        "config": s["vit_config"],
        "arrays": len(plan.leaves),
        "lower_s": round(t1 - t, 3),
        "compile_s": round(t2 - t1, 3),
        "platform": jax.devices()[0].platform,
        "user_flag_after": bool(jax.config.jax_threefry_gpu_kernel_lowering),
    }


def part_init_bits(s: dict, work: Path) -> dict:
    """A tiny ViT's init as shipped and with JAX's default lowering: every leaf's bits, and the user's
    flag."""
    import jax

    from nnx_shard.sharding import flatten_state

    def bits(v):
        x = v.get_value() if hasattr(v, "get_value") else v
        return fingerprint(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )

    init, _, _ = _vit_init("tiny")
    ours = [bits(v) for _, v in flatten_state(init())]
    flag_after = bool(jax.config.jax_threefry_gpu_kernel_lowering)
    plain = [bits(v) for _, v in flatten_state(init.jitted())]
    return {"arrays": len(ours), "same_bits": ours == plain, "user_flag_after": flag_after}


def run_part(part: str, s: dict, work: Path) -> dict:
    if part == "example":
        return part_example(s, work)
    if part == "vit":
        return part_vit(s, work)
    if part == "step":
        return part_step(s, work)
    if part in ("create_sharded", "device_put"):
        return part_create(s, work, part)
    if part == "save":
        return part_save(s, work)
    if part == "saves":
        return part_saves(s, work)
    if part == "snapshots":
        return part_snapshots(s, work)
    if part.startswith("vit_init"):
        return part_vit_init(s, work, part)
    if part == "init_bits":
        return part_init_bits(s, work)
    return part_restore(s, work, part)


def summarize(parts: dict) -> dict:
    """The ratios RESULTS.md records, from whichever parts ran."""
    out: dict[str, object] = {}
    ok = lambda k: k in parts and "error" not in parts[k]
    if ok("step"):
        out["trainer_over_hand_jit"] = parts["step"]["ratio"]
        out["trainer_over_hand_jit_marginal_step"] = parts["step"].get("marginal_ratio")
        out["train_call_fixed_ms"] = parts["step"].get("train_call_fixed_ms")
        out["step_compile_s"] = parts["step"].get("step_compile_s")
        out["allocator_peak_over_compile_report"] = parts["step"].get("peak_over_compile_report")
    if ok("vit"):
        out["vit_trainer_over_hand_jit"] = parts["vit"]["ratio_trainer_time_over_hand"]
        out["vit_compile_phases_s"] = parts["vit"].get("compile_phases_s")
    if ok("create_sharded") and ok("device_put"):
        a, b = parts["create_sharded"], parts["device_put"]
        out["create_sharded_over_device_put_s"] = round(a["seconds"] / b["seconds"], 3)
        if a["memory_stats"] and b["memory_stats"]:
            peak = lambda r: r["memory_stats"]["peak_bytes_in_use"]
            out["create_sharded_over_device_put_peak"] = round(peak(a) / peak(b), 3)
            out["create_sharded_peak_over_compile_report"] = round(peak(a) / a["compile_peak_bytes"], 3)
        out["same_values_as_eager_init"] = a["fingerprint"] == b["fingerprint"]
        out["same_values_as_plain_jit_init"] = a["fingerprint"] == b.get("fingerprint_plain_jit")
    if ok("vit_init"):
        inlined = parts.get("vit_init_inlined", {})
        out["vit_init_compile_s"] = [
            parts["vit_init"]["compile_s"],
            inlined.get("compile_s", f"> {INLINED_CAP_S}"),
        ]
    if ok("init_bits"):
        out["init_same_bits"] = parts["init_bits"]["same_bits"]
        out["init_user_flag_unchanged"] = not parts["init_bits"]["user_flag_after"]
    if ok("restore_nnx_shard") and ok("restore_orbax"):
        a, b = parts["restore_nnx_shard"], parts["restore_orbax"]
        out["restore_over_orbax_s"] = round(a["seconds"] / b["seconds"], 3)
        out["restore_over_orbax_warm_s"] = round(a["seconds_warm"] / b["seconds_warm"], 3)
        # the cold read and the process's next compile, which a training process pays either way
        both = [r["seconds"] + r["next_compile_s"] for r in (a, b)]
        out["restore_and_next_compile_over_orbax_s"] = round(both[0] / both[1], 3)
        out["restore_same_values"] = (
            a["fingerprint"] == b["fingerprint"] == parts.get("save", {}).get("fingerprint")
        )
        if ok("restore_nnx_shard_unverified"):
            c = parts["restore_nnx_shard_unverified"]
            out["unverified_restore_over_orbax_s"] = [
                round(c["seconds"] / b["seconds"], 3),
                round(c["seconds_warm"] / b["seconds_warm"], 3),
            ]
    if ok("saves"):
        saves = parts["saves"]
        out["save_over_orbax"] = {k: saves[f"ratio_{k}"] for k in ("sync", "async")}
        out["step_ratio_during_async_save"] = saves["step_ratio_during_async_save"]
        out["step_during_async_save_over_orbax"] = saves["step_ratio_during_async_save_over_orbax"]
    if ok("snapshots"):
        snaps = parts["snapshots"]
        out["snapshot_ratio"] = {k: snaps[f"every_{k}"]["ratio"] for k in (10, 100)}
        out["snapshots_skipped_every_10"] = snaps["every_10"]["skipped"]
        out["snapshot_stage_bytes_over_one_read_and_write"] = snaps["stage_bytes_over_one_read_and_write"]
        out["snapshot_ms"] = [snaps["snapshot_ms_on_the_steps_path"], snaps["snapshot_ms_in_the_background"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on 2 simulated CPU devices")
    ap.add_argument(
        "--parts",
        default=None,
        help=f"comma-separated, of {', '.join(PARTS)} (default: all; --smoke: {QUICK})",
    )
    ap.add_argument("--part-timeout", type=float, default=PART_TIMEOUT_S, help="seconds a part may take")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    else:  # whatever JAX finds, also where a module imported here would ask for the CPU (bench_step)
        os.environ.setdefault("JAX_PLATFORMS", "")
    s = sizes(args.smoke)
    if args.part:  # one part, in this fresh process: its JSON on the last line
        print(json.dumps(run_part(args.part, s, Path(args.work)), default=str))
        return
    from common import machine, write_json

    parts: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as work:
        for part in (args.parts or (QUICK if args.smoke else ",".join(PARTS))).split(","):
            cmd = [sys.executable, __file__, "--part", part, "--work", work] + (
                ["--smoke"] if args.smoke else []
            )
            cap = min(args.part_timeout, INLINED_CAP_S) if part.endswith("inlined") else args.part_timeout
            t = time.perf_counter()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=cap)
            except subprocess.TimeoutExpired as e:
                if part.endswith("inlined"):  # the point of the part: it takes longer than its cap
                    parts[part] = {"compile_s": f"> {cap}", "capped": True}
                else:
                    parts[part] = {"error": f"timed out after {cap} s:\n{(e.stderr or b'')[-3000:]!r}"}
            else:  # the others still run: one part's failure is reported, not fatal
                ok = done.returncode == 0
                parts[part] = (
                    json.loads(done.stdout.strip().splitlines()[-1]) if ok else {"error": done.stderr[-4000:]}
                )
            parts[part]["part_wall_s"] = round(time.perf_counter() - t, 1)
            print(f"{part}: {json.dumps(parts[part], default=str)[:600]}", file=sys.stderr, flush=True)
            if args.out:  # what has run so far, should a later part outlast the caller's patience
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"sizes": s, "parts": parts}, indent=1, default=str))
    result = {
        "benchmark": "bench_gpu",
        "machine": machine(),
        "sizes": s,
        "summary": summarize(parts),
        "parts": parts,
    }
    write_json(result, args.out)
    if any("error" in p for p in parts.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
