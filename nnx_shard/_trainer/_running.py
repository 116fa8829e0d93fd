"""A Trainer's compiled steps on the live state: train and eval steps per batch signature, and a resize."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from jax.sharding import Mesh

from nnx_shard._base import COMPILE_CLOCK
from nnx_shard._cluster import data_shard
from nnx_shard._live import ResizeReport, ShardingHooks
from nnx_shard._trainer import _data
from nnx_shard._trainer._observe import Observer
from nnx_shard._trainer._recovery import Progress
from nnx_shard._trainer._resize_job import Resizing
from nnx_shard._trainer._step import CompiledEval, CompiledSteps


class Running:
    """Runs the compiled train and eval steps on the state the hooks own, one program per batch signature
    for the live mesh and plan, a new signature's compile reported as an event; moves it all on a resize.
    Holds the hooks, the observer, the progress and the resize state; the programs are its own."""

    def __init__(self, hooks: ShardingHooks, observer: Observer, progress: Progress, resizing: Resizing):
        self.hooks, self.observer, self.progress, self.resizing = hooks, observer, progress, resizing
        self.steps: CompiledSteps | None = (
            None  # compiled for the live mesh and plan, from the Trainer's init()
        )
        self.eval: CompiledEval | None = None

    def compile_for(self, steps: CompiledSteps, eval_metrics: Callable[..., Any]) -> None:
        self.steps, self.eval = steps, CompiledEval(steps, eval_metrics)

    def run_step(self, batch: Any) -> Any:
        """One step on a global batch, the new state given to the hooks; returns the metrics."""
        mesh = self.hooks.mesh
        self.resizing.refuse("run a step", mesh)
        sig = _data.signature(batch)  # once a step: the host's work per step is what small steps wait on
        self.resizing.check_rows(_data.signature_rows(sig), mesh)
        fresh, before = not self.steps.is_compiled(sig), COMPILE_CLOCK.seconds
        states, metrics = self.steps.run(self.hooks.states(), batch, sig)
        self.hooks.update(states)
        if fresh:
            shapes = str([s for s, _ in sig[1]])
            self.observer.event("compile", COMPILE_CLOCK.seconds - before, self.progress.step, shapes=shapes)
        return metrics

    def evaluate(self, batches: Iterable[Any], use_ema: bool, to_global: Callable[[Any], Any]) -> Any:
        self.resizing.refuse("evaluate", self.hooks.mesh)
        return self.eval.run(self.hooks.states(), batches, use_ema=use_ema, to_global=to_global)

    def resize(self, new: Mesh, donate: bool) -> ResizeReport:
        """Moves the live state onto ``new``, the steps compiled again for it, the processes told."""
        old, before = self.hooks.mesh, data_shard(self.hooks.mesh)
        report = self.hooks.on_mesh_change(new, donate=donate)
        # the programs were compiled for the old shardings
        self.compile_for(self.steps.moved(new, self.hooks.plan), self.eval.eval_metrics)
        moved_data = data_shard(new) != before
        processes = self.resizing.moved(old, new, moved_data, self.observer)
        step = self.progress.step
        self.observer.event("resize", report.seconds, step, report=str(report), processes=processes)
        return report
