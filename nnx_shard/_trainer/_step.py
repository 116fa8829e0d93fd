"""The compiled train step: one jitted program per batch signature, the state donated, non-finite steps not
applied."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._cluster import data_sharding
from nnx_shard._sharding import ShardingPlan, auto_axes_on, on_mesh
from nnx_shard._trainer import _data, _guard

TrainStep = Callable[[nnx.Module, nnx.Optimizer, "nnx.EMA | None", Any], dict[str, Any]]


_TRACING: contextvars.ContextVar[CompiledSteps | None] = contextvars.ContextVar(
    "nnx_shard_traced_steps", default=None
)


def traced_steps() -> CompiledSteps | None:
    """The steps whose program is being traced here (its mesh and plan), or None outside a trace."""
    return _TRACING.get()


@contextlib.contextmanager
def _tracing(steps: CompiledSteps) -> Iterator[None]:
    token = _TRACING.set(steps)
    try:
        yield
    finally:
        _TRACING.reset(token)


class CompiledSteps:
    """Jitted steps by batch signature over one mesh and plan, with the non-finite counters beside the state.

    A step takes and returns ``(states, counters, batch)`` / ``(states,
    counters, metrics)``. A step whose loss or gradient norm is not finite
    returns the state it was given (``mode`` ``"stop"`` also holds every later
    step); see :mod:`nnx_shard._trainer._guard`. The counters are not donated:
    the loop reads the previous step's after the next is dispatched. While a
    step traces, :func:`traced_steps` gives these steps (the gradient norm
    reads the mesh and plan there).
    """

    def __init__(
        self, mesh: Mesh, plan: ShardingPlan, train_step: TrainStep, mode: str, graphdefs: dict[str, Any]
    ):
        self.mesh, self.plan, self.train_step, self.mode = mesh, plan, train_step, mode
        self.graphdefs = dict(graphdefs)
        self._compiled: dict[Any, Any] = {}
        self._first_signature: Any = None
        self._counters: dict[str, Any] | None = None

    def moved(self, mesh: Mesh, plan: ShardingPlan) -> CompiledSteps:
        """The same steps for another mesh and plan (after a resize): compiled afresh, counters at zero."""
        return CompiledSteps(mesh, plan, self.train_step, self.mode, self.graphdefs)

    def reset_counters(self) -> None:
        """After a restore: the restored state is finite and applied; nothing is pending."""
        self._counters = None

    def is_compiled(self, signature: Any) -> bool:
        """Whether a step for this batch signature (:func:`_data.signature`) exists already."""
        return signature in self._compiled

    @property
    def counters(self) -> dict[str, Any]:
        """The non-finite step counters on the devices: ``bad`` (in a row) and ``skipped`` (in all)."""
        if self._counters is None:
            self._counters = _guard.new_guard(self.mesh)
        return self._counters

    def _fn(self) -> Callable[..., Any]:
        graphdefs, mode, train_step, steps = self.graphdefs, self.mode, self.train_step, self

        def step(
            states: dict[str, Any], counters: dict[str, Any], batch: Any
        ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
            old = jax.tree.map(lambda x: x, states)  # the values given: merged Variables are updated in place
            objects = {k: nnx.merge(graphdefs[k], states[k]) for k in states}
            with _guard.gate(counters, mode) as gate, _tracing(steps):
                metrics = train_step(objects["model"], objects["optimizer"], objects.get("ema"), batch)
            new = {k: nnx.state(v) for k, v in objects.items()}
            if gate.applied is not None:  # the update ran under a cond (Trainer.apply_gradients)
                counters = _guard.count(counters, gate.applied)
            else:  # the step updated by itself: select the state it was given where it is not finite
                new, counters = _guard.guarded(new, old, counters, metrics, gate.allow)
            return new, counters, {**metrics, "skipped_steps": counters["skipped"]}

        # On Explicit mesh axes the step runs with them Auto (a model written for Auto meshes
        # traces as it always has) and its outputs go back to the state's own shardings.
        specs = jax.tree.map(lambda s: s.spec, self.plan.shardings)
        return auto_axes_on(self.mesh, step, (specs, PartitionSpec(), PartitionSpec()))

    def program(self, batch: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The step function and its ``jax.jit`` arguments (shardings, donation) for this batch's
        structure."""
        shardings = self.plan.shardings
        replicated = NamedSharding(self.mesh, PartitionSpec())
        batch_shardings = jax.tree.map(lambda _: data_sharding(self.mesh), batch)
        return self._fn(), {
            "in_shardings": (shardings, replicated, batch_shardings),
            "out_shardings": (shardings, replicated, replicated),
            "donate_argnums": 0,
        }

    def get(self, batch: Any, sig: Any = None) -> Any:
        """The jitted step for this batch's signature (compiled on first use; a changed structure raises).

        ``sig`` is the batch's :func:`_data.signature` when the caller has it already (once per step).
        """
        sig = _data.signature(batch) if sig is None else sig
        _data.check_structure(self._first_signature, sig)
        self._first_signature = self._first_signature or sig
        if sig not in self._compiled:
            fn, kwargs = self.program(batch)
            self._compiled[sig] = jax.jit(fn, **kwargs)
        return self._compiled[sig]

    def run(self, states: dict[str, Any], batch: Any, sig: Any = None) -> tuple[dict[str, Any], Any]:
        """One step on a global batch: ``(new states, metrics)``; ``states`` are donated."""
        with on_mesh(self.mesh):
            states, self._counters, metrics = self.get(batch, sig)(states, self.counters, batch)
        return states, metrics


class CompiledEval:
    """Evaluation compiled once per batch signature: the model (or the EMA's parameters in it) in eval
    mode."""

    def __init__(self, steps: CompiledSteps, eval_metrics: Callable[[nnx.Module, Any], dict[str, Any]]):
        self.steps, self.eval_metrics = steps, eval_metrics
        self._fn: Any = None

    def run(
        self, states: dict[str, Any], batches: Any, *, use_ema: bool, to_global: Callable[[Any], Any]
    ) -> dict[str, float]:
        """Means of the metrics over ``batches``, weighted by their rows: ``{"eval_<name>": value}``."""
        if self._fn is None:
            graphdef, eval_metrics = self.steps.graphdefs["model"], self.eval_metrics

            def run(model_state: Any, ema_params: Any, batch: Any) -> dict[str, Any]:
                model = nnx.merge(graphdef, model_state)
                if ema_params is not None:
                    nnx.update(model, ema_params)
                model.eval()  # dropout off, batch norm on its running statistics
                return eval_metrics(model, batch)

            specs = PartitionSpec()  # metrics: replicated scalars
            self._fn = jax.jit(auto_axes_on(self.steps.mesh, run, specs))
        params = states["ema"]["params"] if use_ema and "ema" in states else None
        totals: dict[str, float] = {}
        rows = 0
        for batch in batches:
            batch = to_global(batch)
            n = max(_data.examples(batch), 1)
            with on_mesh(self.steps.mesh):
                metrics = self._fn(states["model"], params, batch)
            for k, v in _data.host_scalars(metrics).items():
                totals[k] = totals.get(k, 0.0) + v * n
            rows += n
        return {f"eval_{k}": v / max(rows, 1) for k, v in totals.items()}
