"""Trainer: a base class to subclass; hooks, one compiled donated step, checkpoints, observability, resume."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._base import COMPILE_CLOCK, mesh_from_string
from nnx_shard._checkpoint import Checkpointer, RestoreOptions, RestoreReport
from nnx_shard._cluster import CompileReport, DataShard, data_shard, initialize_distributed
from nnx_shard._live import ResizeReport, ShardingHooks
from nnx_shard._suggest import Suggestion
from nnx_shard._trainer import _data, _guard
from nnx_shard._trainer._aot import compile_step, suggest_layout
from nnx_shard._trainer._config import config_checkpointer, config_mesh, default_config, merge_config
from nnx_shard._trainer._finetune import labels, load_weights, resolve_wrt
from nnx_shard._trainer._lineage import Lineage
from nnx_shard._trainer._loop import Callback, TrainingLoop
from nnx_shard._trainer._norm import global_norm, model_shardings
from nnx_shard._trainer._observe import Observer, injected_learning_rate
from nnx_shard._trainer._recovery import resume_auto
from nnx_shard._trainer._resize_job import Resizing
from nnx_shard._trainer._saving import save_step, trainer_options
from nnx_shard._trainer._step import CompiledEval, CompiledSteps, traced_steps
from nnx_shard._trainer._views import LiveObject, RenamedMethod
from nnx_shard._trainer._watchdog import Watchdog
from nnx_shard.errors import ConfigError

logger = logging.getLogger("nnx_shard")


class Trainer:
    """Subclass and give the model, the optax transform and the loss; the rest happens by itself.

    A subclass implements ``create_model(rngs)``, ``create_optimizer()`` and ``loss_fn(model, batch)`` (a
    scalar loss, or ``(loss, metrics)``), and may override ``train_step``, ``eval_metrics``, ``on_log`` and
    ``learning_rate_schedule``, declare its own settings in ``default_config()``, and register callbacks with
    :meth:`add_callback`. The Trainer builds the mesh from ``config.mesh``, creates the model,
    ``nnx.Optimizer`` and ``nnx.EMA`` (of the parameters in :attr:`wrt`; ``ema_decay=None`` for none) already
    sharded by ``config.sharding_strategy``, calls :meth:`load_pretrained`, compiles one step per batch
    signature with the state donated, turns host-local batches into global ones, saves every
    ``config.save_every`` steps, at the end and on preemption, resumes with :meth:`restore_and_reshard` onto
    whatever devices it has, and reports: a progress bar on a terminal, plain lines on stdout otherwise,
    ``workdir/metrics.jsonl`` and TensorBoard, with compile, save, restore and eval times as events.
    Accumulate gradients with ``optax.MultiSteps`` in ``create_optimizer`` (its accumulators are sharded like
    their parameters).

    >>> import jax.numpy as jnp, numpy as np
    >>> class Regression(Trainer):
    ...     def create_model(self, rngs):
    ...         return nnx.Linear(4, 1, rngs=rngs)
    ...     def create_optimizer(self):
    ...         return optax.sgd(0.1)
    ...     def loss_fn(self, model, batch):
    ...         return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    >>> trainer = Regression({"total_steps": 5, "progress": "off", "log_every": 1,
    ...                       "sharding_strategy": [(".*", "replicate")]})
    >>> x = np.ones((8, 4), np.float32)
    >>> history = trainer.train(lambda step: {"x": x, "y": x.sum(1, keepdims=True)})
    >>> len(history), history[-1]["loss"] < history[0]["loss"], trainer.stop_reason
    (5, True, 'finished')
    """

    @classmethod
    def default_config(cls) -> ml_collections.ConfigDict:
        """The settings and their defaults; a subclass extends them and any other key is refused.

        >>> class Mine(Trainer):
        ...     @classmethod
        ...     def default_config(cls):
        ...         c = super().default_config()
        ...         c.hidden = 32
        ...         return c
        >>> Mine.default_config().hidden, Mine.default_config().save_every
        (32, 0)
        """
        return default_config()

    def __init__(self, config: ml_collections.ConfigDict | dict[str, Any] | None = None):
        self.config = merge_config(type(self).default_config(), config)
        cfg = self.config  # under nnx-shard launch: join the job before anything starts a backend
        initialize_distributed(heartbeat_timeout=cfg.heartbeat_timeout, shutdown_timeout=cfg.shutdown_timeout)
        self.watchdog = Watchdog()
        strategy = list(cfg.sharding_strategy)
        self.hooks = ShardingHooks(strategy, config_mesh(cfg.mesh), barrier_timeout=cfg.barrier_timeout)
        self.workdir = str(cfg.workdir) if cfg.workdir else None
        self.checkpointer: Checkpointer | None = config_checkpointer(cfg)
        self.observer = Observer(self.workdir, self.config.progress, self.config.tensorboard)
        self.step = 0
        self.last_eval: dict[str, float] = {}
        self.loop = TrainingLoop()
        self._steps: CompiledSteps | None = None  # compiled for the live mesh and plan, from init()
        self._eval: CompiledEval | None = None
        self._wrt: Any = None  # the trained subset, resolved against the model when it is created
        self._data_states: list[Any] | None = None
        self._resumed = False
        self._resizing = Resizing()  # which processes hold the mesh, across resizes
        self.lineage = Lineage(self.checkpointer, self.workdir, lock_stale_after=self.config.lock_stale_after)
        COMPILE_CLOCK.start()  # the compile events: how long each new batch signature took

    @property
    def mesh(self) -> Mesh:
        """The mesh the state lives on (the hooks'; :meth:`resize` changes it)."""
        return self.hooks.mesh

    @property
    def data_shard(self) -> DataShard | None:
        """This process's rows of every global batch (:func:`nnx_shard.data_shard`), None on a process the mesh
        leaves out. A ``step -> batch`` callable that slices by it (not by ``jax.process_index()``) feeds the same
        global batch after a :meth:`resize` that changes the processes."""
        return data_shard(self.hooks.mesh)

    # -- what a subclass gives ------------------------------------------------

    def create_model(self, rngs: nnx.Rngs) -> nnx.Module:
        raise NotImplementedError("a Trainer subclass must define create_model(self, rngs)")

    def create_optimizer(self) -> optax.GradientTransformation:
        raise NotImplementedError("a Trainer subclass must define create_optimizer(self)")

    def loss_fn(self, model: nnx.Module, batch: Any) -> Any:
        raise NotImplementedError("a Trainer subclass must define loss_fn(self, model, batch)")

    # the trained subset (an nnx filter); None: nnx.LoRAParam when the model has any, else nnx.Param
    wrt: Any = None

    def load_pretrained(self, model: nnx.Module) -> Any:
        """Called once on the new sharded model, before any restore: e.g. ``return ns.load_safetensors(model, ...)``."""

    def train_step(
        self, model: nnx.Module, optimizer: Any, ema: nnx.EMA | None, batch: Any
    ) -> dict[str, Any]:
        """One step, traced under jit: gradients, the update, the EMA; metrics with the global gradient norm."""

        def loss(model: nnx.Module) -> tuple[Any, dict[str, Any]]:
            out = self.loss_fn(model, batch)
            return out if isinstance(out, tuple) else (out, {})

        grad = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, self._wrt), has_aux=True)
        (value, aux), grads = grad(model)
        norm = self.grad_norm(grads)
        self.apply_gradients(model, optimizer, ema, grads, loss=value, grad_norm=norm)
        metrics = {"loss": value, "grad_norm": norm, **aux}
        lr = injected_learning_rate(optimizer)
        if lr is not None:
            metrics["learning_rate"] = lr
        return metrics

    def apply_gradients(
        self, model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.EMA | None, grads: Any, *, loss: Any, grad_norm: Any
    ) -> Any:  # fmt: skip
        """(traced) The optimizer and EMA update, applied only when ``loss`` and ``grad_norm`` are finite.

        The update runs under a ``cond``, so a non-finite step changes nothing and a finite one costs
        what the update costs. Returns whether it was applied. A ``train_step`` override that calls it
        keeps this; one that updates by itself gets a select over the state instead.
        """
        return _guard.apply_if_finite(model, optimizer, ema, grads, loss=loss, grad_norm=grad_norm)

    def grad_norm(self, grads: Any) -> Any:
        """The global norm of the model's gradients (traced), with one collective for all leaves.

        The shardings are those of the step being traced (the live ones, or a
        :meth:`compile_report`'s for other devices).
        """
        steps = traced_steps() or self._steps
        return global_norm(grads, model_shardings(steps.plan), steps.mesh)

    def eval_metrics(self, model: nnx.Module, batch: Any) -> dict[str, Any]:
        """Metrics of one eval batch (traced under jit, the model in eval mode); default: the loss."""
        out = self.loss_fn(model, batch)
        value, aux = out if isinstance(out, tuple) else (out, {})
        return {"loss": value, **aux}

    def learning_rate_schedule(self) -> Callable[[int], Any] | None:
        """A schedule ``count -> lr`` to report when the transform does not expose the rate: by default
        ``config.learning_rate`` when it is callable (``optax.inject_hyperparams`` reports its own rate)."""
        lr = self.config.get("learning_rate")
        return lr if callable(lr) else None

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        """Called with host metrics every ``log_every`` steps, and with the eval metrics (``eval_...``) of an eval step."""

    def add_callback(self, fn: Callback, *, every: int = 1) -> None:
        """Runs ``fn(step, metrics, trainer)`` on the host every ``every`` steps (custom logging,
        samples, early stopping with :meth:`request_stop`)."""
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"add_callback(every=...) takes a whole number of steps >= 1; got {every!r}.")
        self.loop.add_callback(fn, every)

    add_hook = RenamedMethod("add_callback")  # deprecated: ``hooks`` names the state's owner, :attr:`hooks`
    model = LiveObject("model")  # the live model, read-only (``objects()["model"]``)
    ema = LiveObject("ema")  # the live EMA (None with ``ema_decay=None``), read-only

    def request_stop(self, reason: str = "requested") -> None:
        """Ends ``train()`` after the current step, with a save; ``stop_reason`` says ``stopped: <reason>``."""
        self.loop.request_stop(reason)

    @property
    def stop_reason(self) -> str | None:
        """Why the last ``train()`` returned (None before any): see :meth:`train`."""
        return self.loop.stop_reason

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent per event (compile, save, restore, eval, ...) in this Trainer's life."""
        return self.observer.timings

    # -- setup ------------------------------------------------------------------

    def _create(self) -> dict[str, Any]:
        model = self.create_model(nnx.Rngs(self.config.seed))
        self._wrt = wrt = resolve_wrt(self.wrt, model)
        objects = {"model": model, "optimizer": nnx.Optimizer(model, self.create_optimizer(), wrt=wrt)}
        if self.config.ema_decay is not None:  # of the trained parameters only
            objects["ema"] = nnx.EMA(model, decay=self.config.ema_decay, only=wrt)
        return objects

    def init(self) -> None:
        """Creates model, optimizer and EMA already sharded (the hooks' on_init)."""
        if self.hooks.initialized:
            return
        objects = self.hooks.on_init(self._create)
        load_weights(self.load_pretrained, objects, self._wrt, self.wrt is not None, self.observer.announce)
        graphdefs = {k: nnx.graphdef(v) for k, v in objects.items()}
        mode = self.config.on_nonfinite
        self._compile_for(CompiledSteps(self.mesh, self.hooks.plan, self.train_step, mode, graphdefs))

    def _compile_for(self, steps: CompiledSteps) -> None:
        self._steps, self._eval = steps, CompiledEval(steps, self.eval_metrics)

    @property
    def states(self) -> dict[str, Any]:
        """The training state of model, optimizer and EMA (``nnx.State``), owned by the hooks."""
        self.init()
        return self.hooks.states()

    @property
    def plan(self) -> Any:
        """The sharding plan of model, optimizer and EMA; the model's parameters labelled trainable or frozen."""
        self.init()
        return self.hooks.plan.with_labels(labels(self.states["model"], self._wrt))

    def objects(self) -> dict[str, Any]:
        """The live model, optimizer and EMA, brought up to date with the training state."""
        self.init()
        return self.hooks.objects

    def compiled_step(self, batch: Any) -> Any:
        """The jitted step for this batch's signature: ``(states, counters, batch) -> (states, counters, metrics)``;
        the state is donated, ``counters`` are the non-finite step counters (``config.on_nonfinite``, :attr:`guard`)."""
        self.init()
        return self._steps.get(batch)

    @property
    def guard(self) -> dict[str, Any]:
        """The non-finite step counters on the devices: ``bad`` (in a row) and ``skipped`` (in all)."""
        self.init()
        return self._steps.counters

    def run_step(self, batch: Any) -> Any:
        """Runs one step on a global batch, updating the state the hooks own; returns the metrics. The first
        step of a batch signature compiles; JAX's compile-time events say how long (a ``compile`` event)."""
        self.init()
        self._resizing.refuse("run a step", self.mesh)
        sig = _data.signature(batch)  # once a step: the host's work per step is what small steps wait on
        self._resizing.check_rows(_data.signature_rows(sig), self.mesh)
        fresh, before = not self._steps.is_compiled(sig), COMPILE_CLOCK.seconds
        states, metrics = self._steps.run(self.hooks.states(), batch, sig)
        self.hooks.update(states)
        if fresh:
            shapes = str([s for s, _ in sig[1]])
            self.observer.event("compile", COMPILE_CLOCK.seconds - before, self.step, shapes=shapes)
        return metrics

    def global_batch(self, batch: Any) -> Any:
        """A host-local batch (numpy) as a global batch on the data axes; global arrays pass through."""
        return _data.global_batch(batch, self.hooks.mesh)

    # -- the loop -----------------------------------------------------------------

    def _maybe_resume(self) -> None:
        if self.config.resume == "auto" and not self._resumed and self.checkpointer is not None:
            self._resumed, got = True, resume_auto(self)
            if got is not None:  # from snapshots
                self._data_states = got.data_states
                self._steps.reset_counters()

    @property
    def restored_step(self) -> int | None:
        """The step this run resumed from (None when it started afresh)."""
        return self.lineage.restored_step

    def train(
        self,
        data: Callable[[int], Any] | Iterable[Any],
        *,
        eval_data: Callable[[], Iterable[Any]] | None = None,
        steps: int | None = None,
    ) -> list[dict[str, float]]:
        """Trains up to ``config.total_steps`` (or ``steps`` more) and returns the logged records.

        Args:
          data: ``step -> host-local batch`` (resumable: the batch of a step is
            the same after a restore), or an iterable of batches (resumable when
            its iterator has ``get_state``/``set_state``, as grain's do). A finite
            iterable that runs out ends the run with a save.
          eval_data: returns an iterable of eval batches; run every ``eval_every``
            steps, its metrics logged and passed to that step's checkpoint.
          steps: train this many steps from the current one instead.

        Returns:
          One dict per logged step: ``step``, ``loss``, ``grad_norm``, the
          learning rate when known, the loss's other metrics, and throughput.
          ``stop_reason`` then says why it returned: ``finished``,
          ``preempted``, ``data exhausted`` or ``stopped: <reason>``. None on a
          process :meth:`resize` left without devices (it runs no step).
        """
        self.watchdog.arm(
            "startup (init, restore, the first step)", self.config.startup_timeout, "startup_timeout"
        )
        self.init()
        if self._resizing.standby:
            self.watchdog.disarm()  # waiting is this process's part: the processes training have their own
            position = self.loop.follow(self, self._resizing)  # joins their saves until their call ends
            self._data_states = None if position is None else [position] * jax.process_count()
            return []
        with self.lineage.lock():
            self._maybe_resume()
            self.lineage.check_fresh(overwrite=self.config.overwrite)
            end = self.step + steps if steps is not None else self.config.total_steps
            batches = _data.Batches(data, self._data_states, shard=self.data_shard)
            if batches.resumable:  # its saved position is used, or the warning said why not
                self._data_states = None
            return self.loop.run(self, batches, eval_data, end, self._resizing)

    def evaluate(self, batches: Iterable[Any], *, use_ema: bool = True) -> dict[str, float]:
        """Means of ``eval_metrics`` over the batches, weighted by their rows, on the EMA parameters by default
        (compiled once per batch signature, like the train step)."""
        self.init()
        self._resizing.refuse("evaluate", self.mesh)
        return self._eval.run(self.hooks.states(), batches, use_ema=use_ema, to_global=self.global_batch)

    # -- checkpoints --------------------------------------------------------------

    def save(self, *, metrics: dict[str, float] | None = None, force: bool = False) -> bool:
        """Saves model, optimizer, EMA, step and the data iterator's position (async unless configured).

        Returns False, with a :class:`nnx_shard.CheckpointWarning` and a ``save_skipped`` event saying why,
        when the step was not written (it is already saved). The first save after restoring an older step than
        the newest sets the newer steps aside (moved, not deleted): they belong to the run this one branched
        from.

        Raises:
          CheckpointSaveError: this save, or an earlier async one, could not be written.
        """
        if self.checkpointer is None:
            raise ConfigError("no workdir in the config: set config.workdir to save checkpoints.")
        self.init()
        # processes on standby (a mesh that leaves them out) join it: every process writes
        self._resizing.announce_save(self.step, self.loop.batches, metrics, force)
        states, mesh = self._resizing.writable(self.hooks, self.mesh)
        return save_step(
            self.checkpointer, self.lineage, self.observer, self.step, states, mesh,
            config=self.config, wrt=self._wrt, batches=self.loop.batches, metrics=metrics, force=force,
        )  # fmt: skip

    def resize(
        self, mesh: Mesh | str, *, devices: Sequence[Any] | None = None, donate: bool = True
    ) -> ResizeReport:
        """Moves the live training state onto another mesh and goes on training there.

        ``mesh`` is a Mesh, or a mesh string with the ``devices`` to use (default all); every process calls it.
        The state moves with :meth:`ShardingHooks.on_mesh_change` (each piece sent once, nothing through the
        host) and the global batch stays as it was. The mesh may leave processes out and take them back: a
        process without devices is on standby (its ``train()`` runs no step, joins the saves and returns with
        the others; snapshots pause). :attr:`data_shard` says which rows a process reads, and grain's
        ``ElasticIterator`` moves onto the new shards at its global position: no example read twice or skipped.
        """
        self.init()
        new = mesh if isinstance(mesh, Mesh) else mesh_from_string(mesh, devices=devices)
        old, before = self.mesh, self.data_shard
        report = self.hooks.on_mesh_change(new, donate=donate)
        self._compile_for(self._steps.moved(new, self.hooks.plan))  # compiled for the old shardings
        processes = self._resizing.moved(old, new, self.data_shard != before, self.observer)
        self.observer.event("resize", report.seconds, self.step, report=str(report), processes=processes)
        return report

    def compile_report(self, devices: Sequence[Any], batch: Any) -> CompileReport:
        """Compiles this Trainer's own train step for ``devices`` and reports what each holds and sends.

        On abstract state, so the devices may be a TPU pod's (:func:`nnx_shard.tpu_devices`) on a laptop;
        ``batch`` is a global batch of ``jax.ShapeDtypeStruct``. ``fits`` is False when XLA refuses it for
        memory. An example is in :func:`nnx_shard._trainer._aot.compile_step`."""
        return compile_step(self.config, self._create, self.train_step, devices, batch)

    def suggest(
        self, batch: Any = None, *, budget: int | str | None = None, devices: Sequence[Any] | None = None,
        tokens_per_step: int | None = None,
    ) -> Suggestion:  # fmt: skip
        """:func:`nnx_shard.suggest` for this Trainer's state, each fitting layout's step compiled (given a global
        ``batch`` of ``jax.ShapeDtypeStruct``) with :meth:`compile_report` on ``devices`` (default: this
        machine's): the one whose compiled step sends least is kept. See :func:`nnx_shard._trainer._aot.suggest_layout`.
        """
        devices = list(devices) if devices is not None else jax.devices()
        create, step, tokens = self._create, self.train_step, tokens_per_step
        return suggest_layout(
            self.config, create, step, batch, budget=budget, devices=devices, tokens_per_step=tokens
        )

    def best_step(self) -> int | None:
        """The kept step with the best ``config.best_metric`` (None without one)."""
        return self.checkpointer.best_step() if self.checkpointer is not None else None

    def restore_and_reshard(
        self,
        source: Any = None,
        *,
        step: int | None = None,
        options: RestoreOptions | None = None,
        **keywords: Any,
    ) -> RestoreReport:
        """Restores ``step`` (default: the latest) of this Trainer's checkpoints, or ``source``, onto its devices.

        The arguments are :meth:`ShardingHooks.restore_and_reshard`'s; ``source`` defaults to the Trainer's own
        checkpoints (an int there is the step), ``free_live`` and ``max_host_bytes`` to the config's. A
        checkpoint saved without the frozen base (``save_frozen=False``) goes on top of the live base, which must
        be the same weights. The saved data position is set on the next ``train(iterable)``."""
        source, step = (None, source) if isinstance(source, int) else (source, step)
        if source is None and self.checkpointer is None:
            raise ConfigError("no workdir in the config: set config.workdir to restore checkpoints.")
        self.init()
        start, own = time.perf_counter(), source is None
        ckpt = self.checkpointer if own else None
        opts = trainer_options(self.config, ckpt, step, self.states["model"], self._wrt, options, keywords)
        report = self.hooks.restore_and_reshard(ckpt if own else source, step=step, options=opts)
        if own:
            self.step, self._data_states, self._resumed = report.step, report.saved.get("data_state"), True
            self.lineage.restored(report.step)
        self._steps.reset_counters()
        self.observer.event("restore", time.perf_counter() - start, self.step, report=str(report))
        return report
