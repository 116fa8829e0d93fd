"""What the non-finite check costs a step: the Trainer's step with it against the same step without it.

Question: does not applying a NaN/Inf step (``config.on_nonfinite``) slow the step down? The
check reads the loss and the global gradient norm the step computes anyway. Three Trainers,
identical but for the check, run in alternating rounds in one process:

- ``cond``: the default step, its update under a ``cond`` (``Trainer.apply_gradients``);
- ``none``: no check at all (the update applied directly, nothing selected);
- ``select``: a ``train_step`` override that updates by itself, so the step selects between
  the new and the given state (the fallback for such overrides).

Target: cond / none <= 1.02. XLA's compiled ``memory_analysis()`` gives each one's temporaries.

    python benchmarks/bench_guard.py [--smoke]
"""

from __future__ import annotations

import statistics
import time

from common import machine, max_abs_diff, simulate_devices, step_args, write_json

simulate_devices(8)

import jax  # noqa: E402
from bench_step import Bench, quiet_trainer  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_shard._trainer import _guard  # noqa: E402


def unguarded(new, old, guard, metrics, allow):
    """The step without the check: the new state always, the counters unchanged."""
    return new, guard


class SelfUpdating(Bench):
    """A train_step override that updates by itself (no apply_gradients): the select fallback."""

    def train_step(self, model, optimizer, ema, batch):
        loss, grads = nnx.value_and_grad(lambda m: self.loss_fn(m, batch))(model)
        optimizer.update(model, grads)
        ema.update(model)
        return {"loss": loss, "grad_norm": self.grad_norm(grads)}


def build(width, depth, rows, *, variant: str):
    trainer, batch = quiet_trainer(width, depth, rows, Bench if variant == "cond" else SelfUpdating)
    original = _guard.guarded
    if variant == "none":
        _guard.guarded = unguarded
    try:
        trainer.train(lambda s: batch, steps=1)  # traces and compiles now
        lowered = trainer.compiled_step(batch).lower(trainer.states, trainer.guard, batch)
        memory = lowered.compile().memory_analysis()
    finally:
        _guard.guarded = original
    return trainer, batch, memory


def main() -> None:
    args, (width, depth, rows, steps, rounds) = step_args()
    built = {v: build(width, depth, rows, variant=v) for v in ("cond", "none", "select")}
    times = {v: [] for v in built}
    for _ in range(rounds):  # alternate, so machine noise hits all alike
        for name, (trainer, batch, _) in built.items():
            t = time.perf_counter()
            trainer.train(lambda s, b=batch: b, steps=steps)
            jax.block_until_ready(trainer.states)
            times[name].append((time.perf_counter() - t) / steps)
    ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    result = {
        "benchmark": "bench_guard",
        "machine": machine(),
        "params": sum(x.size for x in jax.tree.leaves(built["cond"][0].states["model"])),
        "step_ms_cond": round(ms["cond"], 3),
        "step_ms_no_check": round(ms["none"], 3),
        "step_ms_select": round(ms["select"], 3),
        "ratio": round(ms["cond"] / ms["none"], 3),
        "ratio_select": round(ms["select"] / ms["none"], 3),
        "target_ratio": 1.02,
        **{f"temp_bytes_{v}": getattr(m, "temp_size_in_bytes", None) for v, (_, _, m) in built.items()},
        # the same finite steps from the same state: the check changes no update
        **{
            f"max_param_diff_{v}_vs_no_check": max_abs_diff(
                built[v][0].states["model"], built["none"][0].states["model"]
            )
            for v in ("cond", "select")
        },
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
