"""The newest idioms' costs: a Trainer step on an Explicit mesh, and a plain Orbax checkpoint restored by
nnx_shard.

Questions:

- Does keeping the user's Explicit mesh (the step traced under ``jax.sharding.auto_axes``)
  cost anything against the same Trainer on an Auto mesh of the same devices? Both run in
  alternating rounds in one process. Target: explicit / auto <= 1.03.
- Does ``restore_and_reshard`` on a checkpoint written by Orbax's own ``CheckpointManager``
  cost more than restoring it with Orbax directly into the same shardings
  (``StandardRestore`` of ``ns.placement.abstract_target``)? Saved on 8 devices, restored on 4,
  alternating. Target: ours / Orbax <= 1.10 (ours also reads the tree metadata to choose the item).

    python benchmarks/bench_idioms.py [--smoke]
"""

from __future__ import annotations

import statistics
import tempfile
import time

from common import machine, max_abs_diff, simulate_devices, stack_state_factory, step_args, write_json

simulate_devices(8)

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from bench_step import quiet_trainer  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import nnx_shard as ns  # noqa: E402


def trainer_on(axis_type, width, depth, rows):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))
    trainer, batch = quiet_trainer(width, depth, rows, mesh=mesh)
    trainer.train(lambda s: batch, steps=1)  # compiles now
    return trainer, batch


def step_times(width, depth, rows, steps, rounds):
    built = {
        name: trainer_on(t, width, depth, rows)
        for name, t in (("explicit", AxisType.Explicit), ("auto", AxisType.Auto))
    }
    times = {name: [] for name in built}
    for _ in range(rounds):
        for name, (trainer, batch) in built.items():
            t = time.perf_counter()
            trainer.train(lambda s, b=batch: b, steps=steps)
            jax.block_until_ready(trainer.states)
            times[name].append((time.perf_counter() - t) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def restore_times(layers, width, rounds):
    create = stack_state_factory(layers, width)
    strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
    mesh8 = ns.create_mesh((8,), ("fsdp",))
    mesh4 = ns.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    objects, _ = ns.create_sharded(create, strategy, mesh8)
    model = nnx.state(objects["model"])
    folder = tempfile.mkdtemp()
    with ocp.CheckpointManager(folder) as manager:
        manager.save(1, args=ocp.args.StandardSave(model))
        manager.wait_until_finished()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(model))
    del objects, model
    fresh = nnx.eval_shape(lambda: create()["model"])
    shardings = ns.infer_sharding(fresh, strategy, mesh4)
    ours, theirs, equal = [], [], []
    for _ in range(rounds):
        live = {"model": create()["model"]}
        t = time.perf_counter()
        ns.restore_and_reshard(folder, live, strategy, mesh4)
        jax.block_until_ready(nnx.state(live["model"]))
        ours.append(time.perf_counter() - t)
        mine = nnx.state(live["model"])
        del live
        t = time.perf_counter()
        with ocp.CheckpointManager(folder) as manager:
            got = manager.restore(
                1, args=ocp.args.StandardRestore(ns.placement.abstract_target(fresh, shardings))
            )
        jax.block_until_ready(got)
        theirs.append(time.perf_counter() - t)
        equal.append(max_abs_diff(mine, got) == 0.0 and jax.tree.leaves(mine)[0].sharding.mesh == mesh4)
        del got, mine
    return statistics.median(ours), statistics.median(theirs), nbytes, all(equal)


def main() -> None:
    args, (width, depth, rows, steps, rounds) = step_args()
    step = step_times(width, depth, rows, steps, rounds)
    layers, rwidth = (2, 256) if args.smoke else (8, 2048)
    ours, orbax, nbytes, equal = restore_times(layers, rwidth, 2 if args.smoke else 5)
    result = {
        "benchmark": "bench_idioms",
        "machine": machine(),
        "step_ms_explicit": round(step["explicit"] * 1e3, 3),
        "step_ms_auto": round(step["auto"] * 1e3, 3),
        "step_ratio": round(step["explicit"] / step["auto"], 3),
        "step_target_ratio": 1.03,
        "restore_bytes": nbytes,
        "restored_equal_to_orbax": equal,  # bitwise, on the 4-device mesh
        "restore_s_ours": round(ours, 4),
        "restore_s_orbax": round(orbax, 4),
        "restore_ratio": round(ours / orbax, 3),
        "restore_target_ratio": 1.10,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
