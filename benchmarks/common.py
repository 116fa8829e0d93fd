"""Shared helpers for the benchmarks: simulated devices, peak RSS, machine description, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import sys
from pathlib import Path


def simulate_devices(n: int = 8) -> None:
    """Asks JAX for ``n`` CPU devices; call before anything touches a backend."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine() -> dict[str, object]:
    import jax

    return {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }


def write_json(result: dict[str, object], out: str | None) -> None:
    print(save_json(result, out))


def save_json(result: dict[str, object], out: str | None) -> str:
    """Writes ``result`` to ``out`` (when given) as JSON, its folder made; the JSON text."""
    text = json.dumps(result, indent=1, default=str)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text


def step_args(*flags: str):
    """``--smoke``/``--out`` (and each of ``flags`` as an on/off option) and the step benchmarks' sizes:
    ``(args, (width, depth, rows, steps, rounds))``."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    for flag in flags:
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    return args, ((64, 2, 16, 5, 2) if args.smoke else (1024, 4, 256, 30, 9))


def hand_written_step(trainer, batch, loss_fn, adds: str = ""):
    """What a user writes without nnx_shard, for comparison: the trainer's objects, split, jitted, donated.

    Same model, optimizer and EMA, same shardings as ``trainer``, the same ``loss_fn``;
    returns ``(jitted_step, states)``. ``adds`` puts in what the Trainer's step adds, to price each part:
    ``"norm"`` the global gradient norm in the metrics, ``"norm,cond"`` also the update under a ``cond`` on
    the loss and the norm being finite (the Trainer's non-finite guard), ``"norm,select"`` the update always
    and a select of the old state where they are not.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    objects = trainer._create()
    shardings = trainer.hooks.shardings
    graphdefs = {k: nnx.graphdef(v) for k, v in objects.items()}
    states = jax.device_put({k: nnx.state(v) for k, v in objects.items()}, shardings)

    def step(states, batch):
        model = nnx.merge(graphdefs["model"], states["model"])
        opt = nnx.merge(graphdefs["optimizer"], states["optimizer"])
        ema = nnx.merge(graphdefs["ema"], states["ema"])
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)
        metrics = {"loss": loss}
        if "norm" in adds:
            metrics["grad_norm"] = optax.global_norm(grads)

        def update(model, opt, ema, grads):
            opt.update(model, grads)
            ema.update(model)

        ok = jnp.isfinite(loss) & jnp.isfinite(metrics.get("grad_norm", loss))
        if "cond" in adds:
            nnx.cond(ok, update, lambda *_: None, model, opt, ema, grads)
        else:
            update(model, opt, ema, grads)
        new = {"model": nnx.state(model), "optimizer": nnx.state(opt), "ema": nnx.state(ema)}
        if "select" in adds:  # the other guard: the update always, then the old state where it is not finite
            new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, states)
        return new, metrics

    data = jax.tree.map(lambda x: x.sharding, batch)
    jitted = jax.jit(step, in_shardings=(shardings, data), out_shardings=(shardings, None), donate_argnums=0)
    return jitted, states


def max_abs_diff(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays with the same structure."""
    import jax
    import jax.numpy as jnp

    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max((float(jnp.max(jnp.abs(x - y))) for x, y in pairs if x.size), default=0.0)


class CompilePhases:
    """Seconds by JAX's compile events while installed, summed per phase: ``jaxpr_trace`` (tracing),
    ``jaxpr_to_mlir_module`` (lowering) and ``backend_compile`` (XLA's own compile): which one a compile's
    time goes to."""

    def __enter__(self):
        import jax

        self.seconds: dict[str, float] = {}

        def listen(name: str, seconds: float, **kwargs) -> None:
            if name.startswith("/jax/core/compile/"):
                key = name.rsplit("/", 1)[1].removesuffix("_duration")
                self.seconds[key] = round(self.seconds.get(key, 0.0) + seconds, 3)

        self.listen = listen
        jax.monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        import jax

        jax.monitoring.unregister_event_duration_listener(self.listen)


def interleaved_timing(trainer, batch, jitted, states, steps, rounds):
    """Median seconds per step of the Trainer and of the hand-written step, in alternating rounds.

    Returns ``(trainer_s, hand_s, max_param_diff)``: both took the same steps from
    the same initial state, so their parameters must agree to float tolerance.
    """
    import statistics

    import jax

    trainer.train(lambda s: batch, steps=1)  # compile both first
    states, metrics = jitted(states, batch)
    jax.block_until_ready(metrics)
    ours, theirs = [], []
    for _ in range(rounds):  # alternate, so machine noise hits both alike
        ours.append(train_seconds(trainer, batch, steps) / steps)
        states, seconds = time_steps(jitted, states, batch, steps)
        theirs.append(seconds)
    diff = max_abs_diff(trainer.states["model"], states["model"])
    return statistics.median(ours), statistics.median(theirs), diff


def marginal_timing(trainer, batch, jitted, states, steps, rounds):
    """The Trainer and the hand-written step: per step of a ``train()`` call of ``steps`` steps, and per step
    more.

    Alternating rounds of ``steps`` and ``3 * steps`` steps in one call each. ``"trainer_call"`` /
    ``"hand_call"``: seconds per step of the short call, as a user who calls ``train(steps=n)`` sees it.
    ``"trainer_step"`` / ``"hand_step"``: ``(T(3n) - T(n)) / 2n``, one more step inside a call, without the
    call's fixed work (log files, lock, final flush). Medians; also the final hand-written ``"states"``.
    """
    import statistics

    ours, theirs = {"call": [], "step": []}, {"call": [], "step": []}
    for _ in range(rounds):
        short, long = train_seconds(trainer, batch, steps), train_seconds(trainer, batch, 3 * steps)
        ours["call"].append(short / steps)
        ours["step"].append((long - short) / (2 * steps))
        states, short = time_steps(jitted, states, batch, steps)  # seconds per step
        states, long = time_steps(jitted, states, batch, 3 * steps)
        theirs["call"].append(short)
        theirs["step"].append((3 * long - short) / 2)
    median = statistics.median
    return {
        "trainer_call": median(ours["call"]),
        "hand_call": median(theirs["call"]),
        "trainer_step": median(ours["step"]),
        "hand_step": median(theirs["step"]),
        "states": states,
    }


def call_fixed_cost(trainer, batch, pairs: int) -> float:
    """Seconds a ``train()`` call costs beyond its steps: the median of ``2 T(1) - T(2)`` over ``pairs`` pairs
    of calls of 1 and 2 steps (each call's steps waited for)."""
    import statistics

    return statistics.median(
        2 * train_seconds(trainer, batch, 1) - train_seconds(trainer, batch, 2) for _ in range(pairs)
    )


def train_seconds(trainer, batch, steps: int) -> float:
    """Seconds of one ``trainer.train(steps=steps)`` call on ``batch``, its steps waited for."""
    import time

    import jax

    t = time.perf_counter()
    trainer.train(lambda s: batch, steps=steps)
    jax.block_until_ready(trainer.states)
    return time.perf_counter() - t


def time_steps(step, states, batch, steps: int):
    """``steps`` calls of a jitted ``step(states, batch) -> (states, metrics)``: ``(states, seconds per
    step)``."""
    import time

    import jax

    t = time.perf_counter()
    for _ in range(steps):
        states, _ = step(states, batch)
    jax.block_until_ready(states)
    return states, (time.perf_counter() - t) / steps


def median_warm(rounds: list[dict]) -> dict:
    """The round of median ``round_trip_s`` among the warm ones (all but the first, cold, round)."""
    warm = sorted(rounds[1:], key=lambda r: r["round_trip_s"])
    return warm[(len(warm) - 1) // 2]


def stack_state_factory(layers: int, width: int):
    """The benchmarks' big state: ``layers`` square Linear layers + adamw + EMA (1.125 GiB at 8 x 3072)."""
    import optax
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])

    def create():
        model = Stack(nnx.Rngs(0))
        return {
            "model": model,
            "optimizer": nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
            "ema": nnx.EMA(model, decay=0.999),
        }

    return create


def variant_args(description: str):
    """The command line shared by the benchmarks that run each variant in a fresh subprocess."""
    import argparse

    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--repeat", type=int, default=1, help="run the main variants this many times; report medians"
    )
    args = ap.parse_args()
    args.layers, args.width = (2, 256) if args.smoke else (args.layers, args.width)
    return args


def run_variants(script: str, variants, args) -> dict:
    """Runs ``script --variant V`` for each variant in a fresh process (peak RSS is per process)."""
    import json
    import subprocess
    import sys

    runs = {}
    for variant in variants:
        cmd = [
            sys.executable,
            script,
            "--variant",
            variant,
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
        runs[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    return runs


def live_bytes_per_device(jax) -> dict:
    """Bytes of ``jax.live_arrays()`` on each device, each buffer counted once."""
    seen, out = set(), {}
    for x in jax.live_arrays():
        for s in x.addressable_shards:
            key = (s.device, s.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


class DeviceMemory:
    """Live bytes per device at each step of a reshard (the executor waits for every step).

    ``peak`` is the most any device held above what it held at the start; ``fullest`` the
    most any device held at all (``jax.live_arrays()``, each buffer counted once).
    """

    def __init__(self, jax):
        self.jax, self.peak, self.fullest = jax, {}, 0
        self.base = self.sample()
        original = jax.block_until_ready

        def wrapped(x):
            out = original(x)
            for d, n in self.sample().items():
                self.peak[d] = max(self.peak.get(d, 0), n - self.base.get(d, 0))
                self.fullest = max(self.fullest, n)
            return out

        self.original, jax.block_until_ready = original, wrapped

    def sample(self):
        return live_bytes_per_device(self.jax)

    def close(self):
        self.jax.block_until_ready = self.original
        return max(self.peak.values(), default=0)


def no_host_transfers(jax):
    """A context in which any transfer between host and device raises, explicit ones included.

    (On the CPU backend, ``jax.device_get`` of an array passes even the strictest
    device-to-host guard, as nothing is copied; the host-to-device guard catches
    the ``device_put`` of host data that any round trip through the host needs.)
    """
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    return stack


def create_state(variant: str, create, strategy, mesh):
    """The two ways to a sharded state that bench_init and bench_gpu compare: ``"create_sharded"`` (one jitted
    init straight into the shardings) or anything else: build whole on the default device, then
    ``jax.device_put``, what a user writes without nnx_shard. Returns ``(states, plan, memory_analysis)``, the
    last None for the second way; the states are ready."""
    import jax
    from flax import nnx

    import nnx_shard as ns

    if variant == "create_sharded":
        init, _abstract, plan = ns.placement.sharded_init_fn(create, strategy, mesh)
        memory = init.lower().compile().memory_analysis()
        return jax.block_until_ready(init()), plan, memory
    objects = create()  # unsharded, on the default device
    plan = ns.plan_sharding(objects, strategy, mesh)
    states = jax.device_put({k: nnx.state(o) for k, o in objects.items()}, plan.shardings)
    del objects
    return jax.block_until_ready(states), plan, None
