"""A Trainer's own train step compiled ahead of time for other devices (a TPU pod from a laptop), on abstract
state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import abstract_construction, format_bytes, mesh_from_string
from nnx_shard._checkpoint import abstract_target
from nnx_shard._cluster import CompileReport, compile_program, data_sharding, hbm_bytes
from nnx_shard._sharding import ShardingPlan, on_mesh, plan_sharding
from nnx_shard._suggest import Suggestion, choose, default_budget, layouts, parse_bytes, suggest
from nnx_shard._trainer._step import CompiledSteps, TrainStep
from nnx_shard.errors import NoLayoutFitsError


def mesh_over(mesh: Any, devices: Sequence[Any]) -> Mesh:
    """The config's mesh (a string, or a Mesh whose axis names and sizes are reused) over ``devices``."""
    if isinstance(mesh, Mesh):
        sizes = [-1 if k == 0 else v for k, v in enumerate(mesh.shape.values())]
        return mesh_from_string(
            ",".join(f"{n}:{s}" for n, s in zip(mesh.axis_names, sizes, strict=True)), devices=list(devices)
        )
    return mesh_from_string(str(mesh), devices=list(devices))


def compile_step(
    config: ml_collections.ConfigDict,
    create: Callable[[], dict[str, Any]],
    train_step: TrainStep,
    devices: Sequence[Any],
    batch: Any,
) -> CompileReport:
    """A Trainer's step compiled for ``devices`` on abstract state: see
    :meth:`nnx_shard.Trainer.compile_report`.

    ``create`` builds the model, optimizer and EMA (run abstractly, nothing
    allocated); ``config.mesh`` is laid over ``devices`` and
    ``config.sharding_strategy`` planned there.

    >>> import numpy as np, optax, nnx_shard as ns
    >>> class Tiny(ns.Trainer):
    ...     def create_model(self, rngs): return nnx.Linear(16, 16, rngs=rngs)
    ...     def create_optimizer(self): return optax.adam(1e-3)
    ...     def loss_fn(self, model, batch): return (model(batch["x"]) ** 2).mean()
    >>> batch = {"x": jax.ShapeDtypeStruct((64, 16), np.float32)}
    >>> report = Tiny({"mesh": "fsdp:-1"}).compile_report(jax.devices(), batch)
    >>> report.devices, report.state_bytes > 0, "all-reduce" in report.collectives
    (8, True, True)
    """
    mesh = mesh_over(config.mesh, devices)
    objects = _abstract(create)
    plan = plan_sharding(_states(objects), list(config.sharding_strategy), mesh)
    return _compile(objects, plan, train_step, config.on_nonfinite, devices, batch)


def _abstract(create: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The model, optimizer and EMA ``create`` builds, as shapes: nothing allocated."""
    with abstract_construction():
        return nnx.eval_shape(create)


def _states(objects: dict[str, Any]) -> dict[str, Any]:
    return {k: nnx.state(v) for k, v in objects.items()}


def _compile(
    objects: dict[str, Any],
    plan: ShardingPlan,
    train_step: TrainStep,
    mode: str,
    devices: Sequence[Any],
    batch: Any,
) -> CompileReport:
    """The step over ``objects`` placed as ``plan`` says, compiled for ``devices``."""
    mesh, states = plan.mesh, _states(objects)
    graphdefs = {k: nnx.graphdef(v) for k, v in objects.items()}
    target = {k: abstract_target(states[k], plan.shardings[k]) for k in states}
    rows = data_sharding(mesh)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=rows), batch)
    replicated = NamedSharding(mesh, PartitionSpec())
    counters = {k: jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated) for k in ("bad", "skipped")}
    steps = CompiledSteps(mesh, plan, train_step, mode, graphdefs)
    with on_mesh(mesh):
        fn, kwargs = steps.program(batch)
        report = compile_program(fn, (target, counters, batch), list(devices), plan=plan, **kwargs)
    report.batch_bytes = sum(
        int(np.prod(rows.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch)
    )
    return report


def suggest_layout(
    config: ml_collections.ConfigDict,
    create: Callable[[], dict[str, Any]],
    train_step: TrainStep,
    batch: Any,
    *,
    budget: int | str | None,
    devices: Sequence[Any],
    tokens_per_step: int | None,
) -> Suggestion:
    """:meth:`nnx_shard.Trainer.suggest`: the candidates that fit, compiled; the one that sends least kept.

    A compiled peak over the chip's memory tightens the budget by the excess and
    tries again (at most 4 rounds); each compile is reported in ``attempts``.
    """
    mesh = mesh_over(config.mesh, devices)
    objects = _abstract(create)  # once: each layout's compile places these same shapes by its own plan
    if batch is None:
        suggestion = suggest(_states(objects), mesh, budget, tokens_per_step=tokens_per_step)
        suggestion.attempts.append("not compiled: no batch given")
        return suggestion
    limit = parse_bytes(budget) if budget is not None else default_budget(mesh)
    candidates = layouts(_states(objects), mesh, tokens_per_step=tokens_per_step)
    hbm, attempts = hbm_bytes(mesh.devices.flat[0]), []
    reports: dict[str, CompileReport] = {}  # a layout is compiled once, however many rounds it stays in
    choose(candidates, limit)  # NoLayoutFitsError when nothing fits the budget given
    for _ in range(4):
        compiled = []
        for layout in (c for c in candidates if limit is None or c.state_bytes <= limit):
            if layout.name not in reports:
                reports[layout.name] = _compile(
                    objects, layout.plan, train_step, config.on_nonfinite, devices, batch
                )
            report = reports[layout.name]
            sent = {k: v["bytes"] for k, v in report.collectives.items()}
            over = hbm is not None and (report.fits is False or (report.peak_bytes or 0) > hbm)
            attempts.append(
                f"{layout.name}: sends {format_bytes(sum(sent.values()))} per step, peak "
                f"{format_bytes(report.peak_bytes or 0)}{' (over the chip memory)' if over else ''}"
            )
            compiled.append((layout, report, sent, over))
        fitting = [(layout, sent) for layout, _, sent, over in compiled if not over]
        if fitting:
            best, sent = min(fitting, key=lambda f: sum(f[1].values()))
            return Suggestion.of(best, limit, candidates, attempts=attempts, compiled=True, traffic=sent)
        excess = min((r.peak_bytes or 0) - hbm for _, r, _, _ in compiled)
        limit = max(c.state_bytes for c, *_ in compiled) - excess
        attempts.append(
            f"every compiled peak is over the chip memory: budget tightened to {format_bytes(max(limit, 0))}"
        )
        if not any(c.state_bytes <= limit for c in candidates):
            break
    raise NoLayoutFitsError(
        f"no layout's compiled step fits the chip's memory ({format_bytes(hbm)}); the compiles:\n"
        + "\n".join(attempts)
    )
