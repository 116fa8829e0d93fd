"""The ``nnx-shard`` command line: ``plan`` prints a sharding plan from abstract shapes, ``suggest`` writes
the rules."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import sys
import time
import tomllib
from collections.abc import Sequence
from typing import Any

from nnx_shard._base import storage
from nnx_shard._cluster import launch
from nnx_shard.errors import CLIError, NnxShardError

DESCRIPTION = """\
Print the sharding plan of a model, its optimizer state and EMA on a mesh,
from abstract shapes only: nothing is allocated, so a 7B-parameter layout can
be checked on a laptop.

  nnx-shard plan examples.toy_models:llama --mesh fsdp:8 --devices 8 \\
      --strategy '[[".*embed.*", "replicate"], [".*", "fsdp(axis=\\"fsdp\\")"]]'
  nnx-shard plan --config plan.toml --png plan.png
  nnx-shard suggest examples.toy_models:llama --mesh fsdp:8 --devices 8 --budget 4GiB

A config file (.toml or .json) may give model, mesh, strategy, model_kwargs,
optimizer and ema; flags override it. Config files are data: nothing in them
is executed.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nnx-shard", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the sharding plan of a model + optimizer + EMA")
    _state_arguments(plan)
    plan.add_argument("--strategy", help='JSON list of [regex, tactic] pairs, e.g. \'[[".*", "replicate"]]\'')
    plan.add_argument("--rows", type=int, default=40, help="leaf rows to print (0: all)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--non-strict", action="store_true", help="replicate leaves no rule matches instead of failing"
    )
    plan.add_argument(
        "--trainer",
        default=None,
        help="package.module:Class of an ns.Trainer: print the compile report of its train step instead",
    )
    plan.add_argument(
        "--batch",
        default=None,
        help='with --trainer: the global batch as JSON, {"images": [4096, 224, 224, 3]} (float32) or '
        '{"labels": {"shape": [4096], "dtype": "int32"}}',
    )
    plan.add_argument("--png", default=None, help="also draw the plan into this PNG file (needs matplotlib)")
    suggest = sub.add_parser(
        "suggest", help="write the rules for a memory budget: the layout that fits and sends least per step"
    )
    _state_arguments(suggest)
    suggest.add_argument(
        "--budget", default=None, help="bytes per device, e.g. 16GiB (default: the chip's memory)"
    )
    suggest.add_argument(
        "--tokens-per-step", type=int, default=None, help="tokens per step: consider tensor axes"
    )
    suggest.add_argument("--png", default=None, help="also draw the suggested plan into this PNG file")
    _launch_parser(sub)
    return p


def _state_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that build the state and the mesh, the same for ``plan`` and ``suggest``."""
    parser.add_argument(
        "model",
        nargs="?",
        help="factory as package.module:function, or an nnx.Module class as package.module:Class (either is "
        "given rngs=... if it has that parameter); it may return "
        "the model, or the whole {'model', 'optimizer', 'ema'} state of your run",
    )
    parser.add_argument("--config", help="a .toml or .json file with model, mesh, strategy, ...")
    parser.add_argument("--mesh", help="mesh as 'fsdp:8' or 'dp:2,tp:4' (names from the string)")
    parser.add_argument(
        "--model-kwargs", default=None, help="JSON object of keyword arguments for the factory"
    )
    parser.add_argument(
        "--optimizer",
        default=None,
        help="adamw, adam, sgd, none, or package.module:factory returning your optax transform "
        "(default adamw)",
    )
    parser.add_argument(
        "--ema", type=float, default=None, help="EMA decay; 0 to leave the EMA out (default 0.999)"
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="simulate this many CPU devices (a laptop check of a pod layout)",
    )
    parser.add_argument(
        "--topology",
        default=None,
        help="a TPU topology such as v5e:16x16 (compile-only devices; needs libtpu: nnx-shard[tpu])",
    )
    parser.add_argument("--slices", type=int, default=1, help="slices of --topology over DCN (default 1)")


def _launch_parser(sub: Any) -> None:
    """``nnx-shard launch``'s arguments."""
    launch = sub.add_parser(
        "launch",
        help="run a command as N processes joined by jax.distributed; restart on the survivors if one dies",
        description="nnx-shard launch --processes 2 --devices-per-process 4 -- python train.py",
    )
    launch.add_argument("--processes", type=int, required=True, help="processes to start")
    launch.add_argument(
        "--devices-per-process", type=int, default=None, help="simulated CPU devices per process"
    )
    launch.add_argument(
        "--min-processes", type=int, default=1, help="restart only while at least this many are left"
    )
    launch.add_argument("--max-restarts", type=int, default=0, help="restarts before giving up (default 0)")
    launch.add_argument(
        "--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL when stopping"
    )
    launch.add_argument("job", nargs=argparse.REMAINDER, help="-- the command to run")


def _load_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    file = storage.location(path)  # a local file or a URI (gs://...)
    if not file.is_file():
        raise CLIError(f"config file {path!r} does not exist.")
    if file.suffix == ".toml":
        return tomllib.loads(file.read_text())
    if file.suffix == ".json":
        return json.loads(file.read_text())
    raise CLIError(
        f"config file {path!r}: expected .toml or .json (data only; Python configs would run code)."
    )


def _json_arg(text: str | None, what: str) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CLIError(f"--{what} is not valid JSON ({e}); got {text!r}.") from None


def _import_factory(spec: str, what: str = "model") -> Any:
    if ":" not in spec:
        raise CLIError(f"{what} {spec!r}: expected package.module:factory, e.g. examples.toy_models:llama.")
    module_name, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CLIError(f"cannot import {module_name!r} for {what} {spec!r}: {e}.") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"{module_name!r} has no callable {attr!r}.")
    return factory


def _optimizer(name: str) -> Any:
    """The optax transform a ``--optimizer`` names: a built-in name or ``package.module:factory``."""
    import optax

    builtin = {
        "adamw": lambda: optax.adamw(1e-3),
        "adam": lambda: optax.adam(1e-3),
        "sgd": lambda: optax.sgd(1e-3, momentum=0.9),
    }
    if name == "none":
        return None
    if name in builtin:
        return builtin[name]()
    if ":" not in name:
        raise CLIError(f"--optimizer {name!r}: use adamw, adam, sgd, none, or package.module:factory.")
    factory = _import_factory(name, "optimizer")
    try:
        tx = factory()
    except TypeError as e:
        raise CLIError(
            f"--optimizer {name!r}: the factory must take no arguments and return an optax transform ({e})."
        ) from None
    if not hasattr(tx, "init") or not hasattr(tx, "update"):
        raise CLIError(
            f"--optimizer {name!r} returned {type(tx).__name__}, not an optax GradientTransformation."
        )
    return tx


def _topology_devices(args: argparse.Namespace) -> list[Any] | None:
    """The devices of ``--topology`` (compile-only), or None for this machine's."""
    if not args.topology:
        return None
    from nnx_shard._cluster import tpu_devices

    return tpu_devices(args.topology, slices=args.slices)


def _chip_line(plan: Any, mesh: Any) -> str:
    """Each chip's share of the state against its HBM."""
    from nnx_shard._base import format_bytes
    from nnx_shard._cluster import hbm_bytes

    device = mesh.devices.flat[0]
    hbm, state = hbm_bytes(device), plan.bytes_per_device
    share = f" ({100 * state / hbm:.1f}% of its HBM {format_bytes(hbm)})" if hbm else ""
    return f"each {device.device_kind} chip holds {format_bytes(state)} of state{share}"


def _batch(text: str) -> Any:
    """``--batch`` JSON: ``{name: [dims]}`` (float32) or ``{name: {"shape": [...], "dtype": ...}}``."""
    import jax
    import numpy as np

    spec = _json_arg(text, "batch")
    if not isinstance(spec, dict) or not spec:
        raise CLIError(
            f"--batch is a JSON object of arrays, e.g. '{{\"images\": [4096, 224, 224, 3]}}'; got {spec!r}."
        )
    out = {}
    for name, v in spec.items():
        shape, dtype = (v, "float32") if isinstance(v, list) else (v.get("shape"), v.get("dtype", "float32"))
        if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
            raise CLIError(f"--batch {name!r}: the shape is a list of positive integers; got {shape!r}.")
        try:
            out[name] = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
        except TypeError as e:
            raise CLIError(f"--batch {name!r}: unknown dtype {dtype!r}.") from e
    return out


def run_compile(args: argparse.Namespace) -> int:
    """``nnx-shard plan --trainer pkg.mod:Class --batch ...``: the compile report of that Trainer's step."""
    if not args.batch:
        raise CLIError(
            "--trainer needs --batch, the global batch's shapes: '{\"images\": [4096, 224, 224, 3]}'."
        )
    if args.devices:
        import jax

        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(args.devices))
    import jax

    from nnx_shard._trainer import Trainer

    cls = _import_factory(args.trainer, "trainer")
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise CLIError(f"--trainer {args.trainer!r} is not a subclass of nnx_shard.Trainer.")
    config: dict[str, Any] = {"progress": "off"}
    if args.mesh:
        config["mesh"] = args.mesh
    strategy = _json_arg(args.strategy, "strategy")
    if strategy is not None:
        config["sharding_strategy"] = strategy
    devices = _topology_devices(args) or jax.devices()
    report = cls(config).compile_report(devices, _batch(args.batch))
    print(json.dumps(dataclasses.asdict(report), indent=1) if args.json else report.table())
    return 0


def _print_suggestion(args: argparse.Namespace, objects: Any, mesh: Any) -> int:
    """``nnx-shard suggest``: the rules ready to paste, then the plan's summary (and its picture with
    --png)."""
    from nnx_shard._suggest import suggest

    suggestion = suggest(objects, mesh, args.budget, tokens_per_step=args.tokens_per_step)
    print(f"{suggestion}\n\n{suggestion.plan.summary()}")
    if args.png:
        print(f"plan drawn in {suggestion.plot(args.png)}")
    return 0


def _plan_inputs(args: argparse.Namespace, *, strategy_needed: bool = True) -> dict[str, Any]:
    """The plan's inputs: the flags, falling back to ``--config``; CLIError for what is missing or
    malformed."""
    cfg = _load_config(args.config)
    strategy = _json_arg(getattr(args, "strategy", None), "strategy")
    kwargs = _json_arg(args.model_kwargs, "model-kwargs") or cfg.get("model_kwargs", {})
    if not isinstance(kwargs, dict):
        raise CLIError(
            '--model-kwargs is a JSON object of keyword arguments, e.g. \'{{"size": "tiny"}}\'; got '
            f"{kwargs!r}."
        )
    inputs = {
        "model": args.model or cfg.get("model"),
        "mesh": args.mesh or cfg.get("mesh"),
        "strategy": cfg.get("strategy") if strategy is None else strategy,
        "kwargs": kwargs,
        "optimizer": args.optimizer or cfg.get("optimizer", "adamw"),
        "ema": args.ema if args.ema is not None else cfg.get("ema", 0.999),
        "devices": args.devices or cfg.get("devices"),
    }
    missing = [
        n
        for n, k in (("model", "model"), ("--mesh", "mesh"), ("--strategy", "strategy"))
        if inputs[k] is None and (k != "strategy" or strategy_needed)
    ]
    if missing:
        raise CLIError(f"missing {', '.join(missing)}: give them as arguments or in --config.")
    return inputs


def _builder(spec: str, kwargs: dict[str, Any], optimizer: str, ema: float) -> Any:
    """``build() -> {"model", "optimizer", "ema"}`` from the factory ``spec`` names, its kwargs checked."""
    from flax import nnx

    factory = _import_factory(spec)
    # a Module class: its __init__'s parameters (nnx's metaclass shows only *args, **kwargs), self left out
    signature = inspect.signature(factory.__init__ if isinstance(factory, type) else factory)
    parameters = {
        k: p for k, p in signature.parameters.items() if not (isinstance(factory, type) and k == "self")
    }
    takes_rngs = "rngs" in parameters
    open_kwargs = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    unknown = [k for k in kwargs if k not in parameters and not open_kwargs]
    if unknown:
        raise CLIError(
            f"--model-kwargs {unknown} are not parameters of {spec}; it takes "
            f"{sorted(p for p in parameters if p != 'rngs')}."
        )
    tx = _optimizer(optimizer)

    def build() -> dict[str, Any]:
        made = factory(rngs=nnx.Rngs(0), **kwargs) if takes_rngs else factory(**kwargs)
        if isinstance(made, dict):  # the whole state of the user's run, as it builds it
            return made
        out: dict[str, Any] = {"model": made}
        if tx is not None:
            out["optimizer"] = nnx.Optimizer(made, tx, wrt=nnx.Param)
        if ema:
            out["ema"] = nnx.EMA(made, decay=ema, only=nnx.Param)
        return out

    return build


def run_plan(args: argparse.Namespace) -> int:
    if getattr(args, "trainer", None):
        return run_compile(args)
    inputs = _plan_inputs(args, strategy_needed=args.command == "plan")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    import jax

    if inputs["devices"]:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(inputs["devices"]))
    from flax import nnx

    from nnx_shard._base import abstract_construction, mesh_from_string
    from nnx_shard._sharding import plan_sharding

    mesh = mesh_from_string(inputs["mesh"], devices=_topology_devices(args))
    build = _builder(inputs["model"], inputs["kwargs"], inputs["optimizer"], inputs["ema"])
    timings["import and mesh"] = time.perf_counter() - t0
    t = time.perf_counter()
    try:
        with abstract_construction():
            objects = nnx.eval_shape(build)
    except (TypeError, ValueError) as e:
        if isinstance(e, NnxShardError):
            raise
        raise CLIError(
            f"building {inputs['model']} with --model-kwargs {inputs['kwargs']} failed: {type(e).__name__}: "
            f"{e}"
        ) from None
    timings["abstract state (nnx.eval_shape)"] = time.perf_counter() - t
    if args.command == "suggest":
        return _print_suggestion(args, objects, mesh)
    t = time.perf_counter()
    plan = plan_sharding(objects, inputs["strategy"], mesh, strict=not args.non_strict)
    timings["infer_sharding"] = time.perf_counter() - t
    if args.json:
        print(json.dumps({**plan.to_dict(), "timings_s": timings}, indent=1))
        return 0
    print(f"{plan.summary()}\n\n{plan.table(max_rows=args.rows or None)}\n")
    if args.png:
        print(f"plan drawn in {plan.plot(args.png)}")
    if args.topology:
        print(_chip_line(plan, mesh))
    total = sum(timings.values())
    print(f"time {total:.2f}s: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nnx-shard`` and ``python -m nnx_shard``."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "launch":
            job = args.job[1:] if args.job[:1] == ["--"] else args.job
            return launch(
                job,
                args.processes,
                devices_per_process=args.devices_per_process,
                min_processes=args.min_processes,
                max_restarts=args.max_restarts,
                grace_s=args.grace,
            )
        return run_plan(args)
    except NnxShardError as e:
        print(f"nnx-shard: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
