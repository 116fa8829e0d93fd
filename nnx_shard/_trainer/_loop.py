"""The training loop: steps, logging a step late, eval, saves, callbacks, preemption and why the run ended.

The loop is a :class:`TrainingLoop` the Trainer holds, built from the parts it needs (the config, the
:class:`Progress` it advances, the observer, the watchdog, the lineage, the checkpointer and
:class:`Recovery`); each ``train()`` hands it the Trainer's own step functions as :class:`StepFunctions`. Why
a run stopped, the stop request and the user's callbacks are the loop's own state.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from nnx_shard._base import COMPILE_CLOCK
from nnx_shard._checkpoint import Checkpointer
from nnx_shard._snapshots import SnapshotWriter
from nnx_shard._trainer import _data, _guard
from nnx_shard._trainer._lineage import Lineage
from nnx_shard._trainer._observe import Observer
from nnx_shard._trainer._recovery import Progress, Recovery, failed_at, is_restart, recovery_fields
from nnx_shard._trainer._resize_job import Resizing
from nnx_shard._trainer._watchdog import Watchdog

logger = logging.getLogger("nnx_shard")
Callback = Callable[[int, dict[str, float], Any], Any]  # (step, metrics, trainer)


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """What a ``train()`` call runs: the Trainer's (overridable) step, batch, eval, save and log functions.

    Attributes:
      run_step: runs one step on a global batch, returns its metrics.
      global_batch: a host-local batch as a global one.
      evaluate: ``(batches, use_ema=...) -> metrics``.
      save: ``(metrics=..., force=...) -> bool``.
      on_log: called with each logged step's host metrics.
      guard: the non-finite step counters on the devices.
      owner: what the user's callbacks receive as their third argument (the Trainer).
      schedule: ``count -> learning rate`` to report, or None.
      shards: how many processes read different rows (their token counts add up).
    """

    run_step: Callable[[Any], Any]
    global_batch: Callable[[Any], Any]
    evaluate: Callable[..., dict[str, float]]
    save: Callable[..., bool]
    on_log: Callable[[int, dict[str, float]], None]
    guard: Callable[[], Any]
    owner: Any
    schedule: Callable[[int], Any] | None
    shards: int


class TrainingLoop:
    """The body of ``Trainer.train``: runs :class:`StepFunctions` from the progress's step to an end step.

    Holds what a run decides by itself: ``stop_reason``, a stop requested by
    :meth:`request_stop`, a SIGTERM seen, the user's callbacks, and the batches
    being read (their position is saved with each checkpoint).
    """

    def __init__(
        self,
        config: Any,
        progress: Progress,
        observer: Observer,
        watchdog: Watchdog,
        lineage: Lineage,
        recovery: Recovery,
    ) -> None:
        self.config, self.progress, self.observer = config, progress, observer
        self.watchdog, self.lineage, self.recovery = watchdog, lineage, recovery
        self.stop_reason: str | None = None
        self.callbacks: list[tuple[Callback, int]] = []
        self.batches: _data.Batches | None = None
        self._stop_request: str | None = None
        self._preempted = False
        self._recovered = False  # this call ran a restarted job's first step
        self._recovery_done = False  # a restarted job's first step ran (in this call or an earlier one)
        self._prepared_mesh: Any = None  # the mesh whose save programs the checkpointer was asked to compile

    @property
    def checkpointer(self) -> Checkpointer | None:
        return self.lineage.checkpointer

    def add_callback(self, fn: Callback, every: int) -> None:
        self.callbacks.append((fn, every))

    def request_stop(self, reason: str) -> None:
        self._stop_request = reason

    def run(
        self,
        fns: StepFunctions,
        batches: _data.Batches,
        eval_data: Any,
        end: int,
        resizing: Resizing | None = None,
    ) -> list[dict[str, float]]:
        """Runs ``fns`` from the progress's step to ``end`` on ``batches``; returns the logged records. With
        ``resizing`` whose mesh leaves processes out, their standby ``train()`` is told how this one ends
        (:meth:`follow`)."""
        if resizing is not None and resizing.leader:
            return resizing.lead(
                lambda: self.run(fns, batches, eval_data, end), self, lambda: self.progress.step
            )
        self.batches, self._recovered = batches, False
        snapshots = self.recovery.start_snapshots()  # refuses to start without the memory they need
        hooks = self.recovery.hooks
        if self.checkpointer is not None and self._prepared_mesh is not hooks.mesh:  # once per mesh
            self.checkpointer.prepare(hooks.states())  # a verified save's programs, compiled beside the steps
            self._prepared_mesh = hooks.mesh
        self.stop_reason, self._stop_request = None, None
        previous = self._install_sigterm()
        history: list[dict[str, float]] = []
        self.observer.start(self.progress.step, end)
        run = StepLog(self.progress, self.config, self.observer, fns, history)
        start, spent = time.perf_counter(), dict(self.observer.timings)
        failed = True  # until the call returns: an exception may be this process's alone
        try:
            self._steps(fns, batches, run, snapshots, eval_data, end)
            if not run.nonfinite:
                self._nonfinite_stop(fns, run, fns.guard(), self.progress.step)
            self.stop_reason = self.stop_reason or "finished"
            run.flush()
            self._save_at_end(fns, run)
            failed = False
        finally:
            self._finish(snapshots, run, previous, (start, spent, history), failed)
        return history

    def follow(self, fns: StepFunctions, resizing: Resizing) -> Any:
        """A standby process's ``train()`` (see :class:`Resizing`): joins the leader's saves, each with the
        leader's step and data position, until its call ends; takes its step and stop reason. Returns the
        data position to set on the next ``train()`` (None unless an elastic iterator's, which is global).

        Raises:
          StandbyError: the leader's call raised, or the coordination service stopped answering.
        """

        def save(step: int, batches: Any, metrics: Any, force: bool) -> None:
            self.progress.step, self.batches = step, batches
            fns.save(metrics=metrics, force=force)

        end = resizing.follow(save)
        self.progress.step, self.stop_reason = int(end["step"]), end["stop_reason"]
        if self.checkpointer is not None:
            self.checkpointer.wait_until_finished()
        resizing.raise_if_failed(end)
        return end["data"]

    def _steps(
        self,
        fns: StepFunctions,
        batches: _data.Batches,
        run: StepLog,
        snapshots: SnapshotWriter | None,
        eval_data: Any,
        end: int,
    ) -> None:
        cfg = self.config
        first, recovering = True, is_restart() and not self._recovery_done
        while self.progress.step < end:
            if not first:  # the first step, its compile included, is the startup's (config.startup_timeout)
                self.watchdog.arm(f"step {self.progress.step + 1}", cfg.step_timeout, "step_timeout")
            first = False
            try:
                host_batch = batches.next(self.progress.step)
            except StopIteration:
                self.stop_reason = "data exhausted"
                return
            batch = fns.global_batch(host_batch)
            if (
                snapshots is not None
            ):  # the last snapshot's copy goes to its peer before this step (processes)
                snapshots.poll(self.progress.step)
            # the counters after the step before: ready by the time this one is queued
            counters = fns.guard()
            if recovering:  # the first step of a restarted job: timed to the end, then reported
                metrics = self._first_step_recovered(fns, batch)
                recovering, self._recovered = False, True
                self._recovery_done = True
            else:
                metrics = fns.run_step(batch)
            self.progress.step += 1
            run.after_dispatch(metrics, _data.examples(batch), _data.tokens(host_batch), end)
            if self._nonfinite_stop(fns, run, counters, self.progress.step - 1) or self._after_step(
                fns, run, eval_data
            ):
                return
            if snapshots is not None and self.progress.step % cfg.snapshot_every == 0:
                self.recovery.snapshot(snapshots, self.progress.step, batches)

    def _save_at_end(self, fns: StepFunctions, run: StepLog) -> None:
        cfg = self.config
        preempted = self.stop_reason == "preempted"
        stopped_on_nan = run.nonfinite and cfg.on_nonfinite == "stop"  # nothing of it is saved
        if self.checkpointer is None or not (preempted or cfg.save_at_end) or stopped_on_nan:
            return
        if self.lineage.last_saved != self.progress.step:
            self.watchdog.arm(f"the save of step {self.progress.step}", cfg.save_timeout, "save_timeout")
            fns.save(force=preempted)

    def _install_sigterm(self) -> Any:
        if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
            return None
        if jax.distributed.is_initialized():
            return None  # JAX's preemption notifier owns SIGTERM after distributed init
        self._preempted = False

        def handler(signum: int, frame: Any) -> None:
            self._preempted = True

        return signal.signal(signal.SIGTERM, handler)

    def _preemption_requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._preempted

    def _finish(
        self,
        snapshots: SnapshotWriter | None,
        run: StepLog,
        previous: Any,
        started: tuple[float, Any, list],
        failed: bool = False,
    ) -> None:
        """After a ``train()`` call, however it ended: flush, wait for writes, restore SIGTERM, log the
        run."""
        start, spent, history = started
        self.watchdog.disarm()
        if (
            snapshots is not None
        ):  # a job at its end frees their memory; a failed one keeps them for its restart
            done = self.stop_reason == "finished" and self.progress.step >= self.config.total_steps
            snapshots.close(remove=done, failed=failed)  # after an exception: no collective
        run.flush()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if self.checkpointer is not None:
            self.checkpointer.wait_until_finished()
        wall = time.perf_counter() - start
        # this call's time outside steps: its compiles, saves, snapshots, evals (the ``recovered`` event is
        # the first step, its compile already counted; what happened before the call is not this call's)
        overhead = sum(
            v - spent.get(k, 0.0) for k, v in self.observer.timings.items() if k not in ("train", "recovered")
        )
        last = int(history[-1]["step"]) if history else self.progress.step
        fields = {"last_step": last, "stop_reason": self.stop_reason, "goodput": _share(overhead, wall)}
        if self._recovered and (failed := failed_at()) is not None:  # the restart's cost, from the death on
            before = time.time() - wall - failed  # detection, relaunch, start, restore: all before this call
            fields["recovery_s"] = round(before, 3)
            fields["goodput_since_failure"] = _share(overhead + before, wall + before)
        self.observer.event("train", wall, self.progress.step, **fields)
        self.observer.finish()

    def _nonfinite_stop(self, fns: StepFunctions, run: StepLog, guard: Any, step: int) -> bool:
        """Ends the run when the counters after ``step`` say so (``config.on_nonfinite``); True ends the
        loop."""
        cfg = self.config
        verdict = _guard.read(guard, step, cfg.on_nonfinite, cfg.max_consecutive_nonfinite)
        if not verdict.stop:
            return False
        self.stop_reason, run.nonfinite = verdict.reason, True
        if verdict.resume_step is not None:
            self.progress.step = verdict.resume_step  # the live state is the one before the first bad step
        logger.error("%s: stopping (config.on_nonfinite=%r)", verdict.reason, cfg.on_nonfinite)
        return True

    def _first_step_recovered(self, fns: StepFunctions, batch: Any) -> Any:
        """Runs the first step of a restarted job to completion and logs the ``recovered`` event."""
        began, before = time.time(), COMPILE_CLOCK.seconds
        metrics = jax.block_until_ready(fns.run_step(batch))
        seconds = time.time() - began
        read = self.observer.timings.get("restore", 0.0)
        fields = recovery_fields(self.lineage, read, began, seconds, COMPILE_CLOCK.seconds - before)
        if fields is not None:
            self.observer.event("recovered", seconds, self.progress.step, **fields)
        return metrics

    def _after_step(self, fns: StepFunctions, run: StepLog, eval_data: Any) -> bool:
        """Eval, saves, callbacks and stop checks after a step; True ends the loop."""
        step, cfg = self.progress.step, self.config
        evaluate = eval_data is not None and cfg.eval_every and step % cfg.eval_every == 0
        save = cfg.save_every and step % cfg.save_every == 0
        callbacks = [fn for fn, every in self.callbacks if step % every == 0]
        metrics = run.flush(current=True) if evaluate or save or callbacks else None
        if evaluate:
            started = time.perf_counter()
            self.progress.last_eval = fns.evaluate(eval_data(), use_ema=cfg.eval_weights == "ema")
            self.observer.event("eval", time.perf_counter() - started, step)
            weights = "ema" if cfg.eval_weights == "ema" and cfg.ema_decay is not None else "model"
            self.observer.record({"step": step, **self.progress.last_eval, "eval_weights": weights})
            fns.on_log(
                step, dict(self.progress.last_eval)
            )  # the eval metrics (eval_...) of this step, as logged
            metrics = {**(metrics or {}), **self.progress.last_eval}
        if save:
            if self._nonfinite_stop(fns, run, fns.guard(), step):  # never save a step that was not applied
                return True
            self.watchdog.arm(f"the save of step {step}", cfg.save_timeout, "save_timeout")
            fns.save(metrics=self.progress.last_eval if evaluate else None)
        for fn in callbacks:
            fn(step, dict(metrics or {}), fns.owner)
        if self._preemption_requested(step):
            logger.warning("preemption requested at step %d: saving and stopping", step)
            self.stop_reason = "preempted"
            return True
        if self._stop_request is not None:
            self.stop_reason = f"stopped: {self._stop_request}"
            return True
        return False


def _share(overhead: float, wall: float) -> float:
    """Goodput: the share of ``wall`` seconds not spent on ``overhead``."""
    return round(min(1.0, max(0.0, 1 - overhead / max(wall, 1e-9))), 3)


class StepLog:
    """One ``train()`` call's records: metrics fetched a step late, so the host never waits on the step in
    flight."""

    def __init__(
        self,
        progress: Progress,
        config: Any,
        observer: Observer,
        fns: StepFunctions,
        history: list[dict[str, float]],
    ):
        self.progress, self.config, self.observer, self.on_log = progress, config, observer, fns.on_log
        self.history = history
        self.pending: tuple[int, Any] | None = None
        self.current: tuple[int, Any] | None = None
        self.nonfinite = False  # the run stopped on a non-finite step (config.on_nonfinite)
        self.examples = self.tokens = 0  # dispatched so far in this call
        self.has_tokens = False
        self.counts: dict[
            int, tuple[int, int]
        ] = {}  # examples and tokens dispatched up to each unlogged step
        self.since = (time.perf_counter(), progress.step, 0, 0)  # the last log: time, step, examples, tokens
        self.schedule, self.shards = fns.schedule, fns.shards

    def after_dispatch(self, metrics: Any, examples: int, tokens: int | None, end: int) -> None:
        step = self.progress.step
        self.examples += examples
        if tokens is not None:
            self.tokens, self.has_tokens = self.tokens + tokens * self.shards, True
        previous, self.pending = self.pending, None
        if previous is not None:
            self._log(*previous)
        self.current = (step, metrics)
        self.counts[step] = (self.examples, self.tokens)
        if step % max(1, self.config.log_every) == 0 or step == end:
            self.pending = self.current

    def flush(self, current: bool = False) -> dict[str, float] | None:
        """Logs the step waiting to be logged (with ``current``, the latest step in any case).

        Returns its host metrics (None when none waits).
        """
        if (
            current
            and self.pending is None
            and self.current is not None
            and (not self.history or self.history[-1]["step"] != self.current[0])
        ):
            self.pending = self.current
        previous, self.pending = self.pending, None
        return self._log(*previous) if previous is not None else None

    def _log(self, step: int, metrics: Any) -> dict[str, float]:
        host = _data.host_scalars(metrics)
        now = time.perf_counter()
        examples, tokens = self.counts.get(step, (self.examples, self.tokens))
        seconds, steps = now - self.since[0], step - self.since[1]
        record: dict[str, float] = {"step": step, **host}
        if "learning_rate" not in record and self.schedule is not None:
            record["learning_rate"] = float(self.schedule(step - 1))
        if steps > 0 and seconds > 0:  # the steps up to this one, whatever was dispatched after it
            record["steps_per_s"] = steps / seconds
            record["examples_per_s"] = (examples - self.since[2]) / seconds
            if self.has_tokens:
                record["tokens_per_s"] = (tokens - self.since[3]) / seconds
        self.since = (now, step, examples, tokens)
        self.counts = {k: v for k, v in self.counts.items() if k > step}
        self.history.append(record)
        self.observer.record(record)
        self.on_log(step, {k: v for k, v in record.items() if k != "step"})
        return host
