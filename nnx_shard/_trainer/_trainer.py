"""Trainer: a base class to subclass; hooks, one compiled donated step, checkpoints, observability, resume."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._base import COMPILE_CLOCK, TrainingState, mesh_from_string
from nnx_shard._checkpoint import Checkpointer, RestoreOptions, RestoreReport
from nnx_shard._cluster import CompileReport, DataShard, data_shard, initialize_distributed
from nnx_shard._live import ResizeReport, ShardingHooks
from nnx_shard._suggest import Suggestion
from nnx_shard._trainer import _data, _guard
from nnx_shard._trainer._aot import compile_step, suggest_layout
from nnx_shard._trainer._config import config_checkpointer, config_mesh, default_config, merge_config
from nnx_shard._trainer._finetune import labels, load_weights, resolve_wrt, training_state
from nnx_shard._trainer._lineage import Lineage
from nnx_shard._trainer._loop import Callback, StepFunctions, TrainingLoop
from nnx_shard._trainer._norm import global_norm, model_shardings
from nnx_shard._trainer._observe import Observer, injected_learning_rate
from nnx_shard._trainer._recovery import Progress, Recovery
from nnx_shard._trainer._resize_job import Resizing
from nnx_shard._trainer._running import Running
from nnx_shard._trainer._saving import Checkpoints
from nnx_shard._trainer._step import CompiledSteps, traced_steps
from nnx_shard._trainer._views import LiveObject, ObjectsView, ProgressField, RenamedMethod
from nnx_shard._trainer._watchdog import Watchdog
from nnx_shard.errors import ConfigError

logger = logging.getLogger("nnx_shard")


class Trainer:
    """Subclass and give the model, the optax transform and the loss; the rest happens by itself.

    A subclass implements ``create_model(rngs)``, ``create_optimizer()`` and ``loss_fn(model, batch)`` (a
    scalar loss, or ``(loss, metrics)``); it may override ``train_step``, ``eval_metrics``, ``on_log`` and
    ``learning_rate_schedule``, extend ``default_config()`` and add callbacks. The Trainer creates the
    :class:`TrainingState` (model, ``nnx.Optimizer``, ``nnx.EMA`` of :attr:`wrt`) already sharded by
    ``config.sharding_strategy`` on ``config.mesh``, compiles one donated step per batch signature, saves on
    schedule, at the end and on preemption, resumes onto whatever devices it has, and reports to the
    terminal, ``workdir/metrics.jsonl`` and TensorBoard. Its parts: :attr:`hooks` (the state's owner),
    ``loop``, ``checkpoints``, ``recovery`` and ``running`` (the compiled steps).

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
        self.lineage = Lineage(self.checkpointer, self.workdir, lock_stale_after=self.config.lock_stale_after)
        self.progress = Progress()  # the step and the last eval: the loop's and the restores' to change
        self.recovery = Recovery(cfg, self.workdir, self.hooks, self.lineage, self.observer, self.progress)
        parts = (cfg, self.progress, self.observer, self.watchdog, self.lineage, self.recovery)
        self.loop = TrainingLoop(*parts)  # steps, logs, evals, saves, callbacks, preemption
        parts = (cfg, self.checkpointer, self.hooks, self.lineage, self.observer, self.progress)
        self.checkpoints = Checkpoints(*parts)  # saves, restores, and the data position between them
        self._wrt: Any = None  # the trained subset, resolved against the model when it is created
        self._resizing = Resizing()  # which processes hold the mesh, across resizes
        self.running = Running(self.hooks, self.observer, self.progress, self._resizing)  # the compiled steps
        COMPILE_CLOCK.start()  # the compile events: how long each new batch signature took

    @property
    def mesh(self) -> Mesh:
        """The mesh the state lives on (the hooks'; :meth:`resize` changes it)."""
        return self.hooks.mesh

    @property
    def data_shard(self) -> DataShard | None:
        """This process's rows of every global batch (None on a process the mesh leaves out): a ``step ->
        batch`` callable that slices by it feeds the same global batch after a :meth:`resize`."""
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
        """Called once on the new sharded model, before any restore: e.g. ``return ns.load_safetensors(model,
        ...)``."""

    def train_step(
        self, model: nnx.Module, optimizer: Any, ema: nnx.EMA | None, batch: Any
    ) -> dict[str, Any]:
        """One step, traced under jit: gradients, the update, the EMA; metrics with the global gradient
        norm."""

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
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        ema: nnx.EMA | None,
        grads: Any,
        *,
        loss: Any,
        grad_norm: Any,
    ) -> Any:
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
        steps = traced_steps() or self.running.steps
        return global_norm(grads, model_shardings(steps.plan), steps.mesh)

    def eval_metrics(self, model: nnx.Module, batch: Any) -> dict[str, Any]:
        """Metrics of one eval batch (traced under jit, the model in eval mode); default: the loss."""
        out = self.loss_fn(model, batch)
        value, aux = out if isinstance(out, tuple) else (out, {})
        return {"loss": value, **aux}

    def learning_rate_schedule(self) -> Callable[[int], Any] | None:
        """A schedule ``count -> lr`` to report when the transform does not expose the rate: by default
        ``config.learning_rate`` when it is callable (``optax.inject_hyperparams`` reports its own rate)."""
        # (`in` first: ConfigDict.get of a missing key builds a did-you-mean message, 0.25 ms a train() call)
        lr = self.config["learning_rate"] if "learning_rate" in self.config else None
        return lr if callable(lr) else None

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        """Called with host metrics every ``log_every`` steps, and with the eval metrics (``eval_...``) of an
        eval step."""

    def add_callback(self, fn: Callback, *, every: int = 1) -> None:
        """Runs ``fn(step, metrics, trainer)`` on the host every ``every`` steps (custom logging,
        samples, early stopping with :meth:`request_stop`)."""
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"add_callback(every=...) takes a whole number of steps >= 1; got {every!r}.")
        self.loop.add_callback(fn, every)

    add_hook = RenamedMethod("add_callback")  # deprecated: ``hooks`` names the state's owner, :attr:`hooks`
    step = ProgressField()  # the current step: the loop advances it, a restore sets it
    last_eval = ProgressField()  # the metrics of the last eval
    model = LiveObject("model")  # the live model, read-only (``training_state.model``)
    objects = ObjectsView()  # deprecated: ``training_state``, as a dict
    ema = LiveObject("ema")  # the live EMA (None with ``ema_decay=None``), read-only

    def request_stop(self, reason: str = "requested") -> None:
        """Ends ``train()`` after the current step, with a save; ``stop_reason`` says ``stopped:
        <reason>``."""
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

    def _create(self) -> TrainingState:
        model = self.create_model(nnx.Rngs(self.config.seed))
        self._wrt = wrt = resolve_wrt(self.wrt, model)
        return training_state(model, self.create_optimizer(), wrt, self.config.ema_decay)

    def init(self) -> None:
        """Creates model, optimizer and EMA already sharded (the hooks' on_init)."""
        if self.hooks.initialized:
            return
        objects = self.hooks.on_init(self._create)
        load_weights(self.load_pretrained, objects, self._wrt, self.wrt is not None, self.observer.announce)
        graphdefs = {k: nnx.graphdef(v) for k, v in objects.items()}
        mode = self.config.on_nonfinite
        steps = CompiledSteps(self.mesh, self.hooks.plan, self.train_step, mode, graphdefs)
        self.running.compile_for(steps, self.eval_metrics)

    @property
    def states(self) -> dict[str, Any]:
        """The training state of model, optimizer and EMA (``nnx.State``), owned by the hooks."""
        self.init()
        return self.hooks.states()

    @property
    def plan(self) -> Any:
        """The sharding plan of model, optimizer and EMA; the model's parameters labelled trainable or
        frozen."""
        self.init()
        return self.hooks.plan.with_labels(labels(self.states["model"], self._wrt))

    @property
    def training_state(self) -> TrainingState:
        """The live model, optimizer and EMA (``.model``, ``.optimizer``, ``.ema``), up to date with the
        state."""
        self.init()
        return self.hooks.training_state

    def compiled_step(self, batch: Any) -> Any:
        """The jitted step of this batch's signature, ``(states, counters, batch) -> (states, counters,
        metrics)``: the state donated, ``counters`` the non-finite step counters (:attr:`guard`)."""
        self.init()
        return self.running.steps.get(batch)

    @property
    def guard(self) -> dict[str, Any]:
        """The non-finite step counters on the devices: ``bad`` (in a row) and ``skipped`` (in all)."""
        self.init()
        return self.running.steps.counters

    def run_step(self, batch: Any) -> Any:
        """Runs one step on a global batch, updating the state the hooks own; returns the metrics. The first
        step of a batch signature compiles; JAX's compile-time events say how long (a ``compile`` event)."""
        self.init()
        return self.running.run_step(batch)

    def global_batch(self, batch: Any) -> Any:
        """A host-local batch (numpy) as a global batch on the data axes; global arrays pass through."""
        return _data.global_batch(batch, self.hooks.mesh)

    # -- the loop -----------------------------------------------------------------

    def _maybe_resume(self) -> None:
        if self.checkpoints.resume_auto(self.recovery, self.restore_and_reshard):  # from snapshots:
            self.running.steps.reset_counters()  # a checkpoint's restore resets them itself

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
            position = self.loop.follow(
                self._functions(), self._resizing
            )  # joins their saves until their call ends
            self.checkpoints.data_states = None if position is None else [position] * jax.process_count()
            return []
        with self.lineage.lock():
            self._maybe_resume()
            self.lineage.check_fresh(overwrite=self.config.overwrite)
            end = self.step + steps if steps is not None else self.config.total_steps
            batches = _data.Batches(data, self.checkpoints.data_states, shard=self.data_shard)
            if batches.resumable:  # its saved position is used, or the warning said why not
                self.checkpoints.data_states = None
            return self.loop.run(self._functions(), batches, eval_data, end, self._resizing)

    def _functions(self) -> StepFunctions:
        """This Trainer's own functions, a subclass's overrides included, as the loop runs them."""
        shard, guard = self.data_shard, lambda: self.guard
        shards = shard.count if shard is not None else jax.process_count()
        functions = (self.run_step, self.global_batch, self.evaluate, self.save, self.on_log, guard, self)
        return StepFunctions(*functions, self.learning_rate_schedule(), shards)

    def evaluate(self, batches: Iterable[Any], *, use_ema: bool = True) -> dict[str, float]:
        """Means of ``eval_metrics`` over the batches, weighted by their rows, on the EMA parameters by
        default (compiled once per batch signature, like the train step)."""
        self.init()
        return self.running.evaluate(batches, use_ema, self.global_batch)

    # -- checkpoints --------------------------------------------------------------

    def save(self, *, metrics: dict[str, float] | None = None, force: bool = False) -> bool:
        """Saves model, optimizer, EMA, step and the data iterator's position (async unless configured).

        Returns False, with a :class:`nnx_shard.CheckpointWarning` and a ``save_skipped`` event, when the step
        was not written (it is already saved). The first save after restoring an older step than the newest
        sets the newer steps aside (moved, not deleted): they belong to the run this one branched from.

        Raises:
          CheckpointSaveError: this save, or an earlier async one, could not be written.
        """
        self.checkpoints.require("save")
        self.init()
        batches = self.loop.batches  # processes on standby (the mesh leaves them out) join: every one writes
        self._resizing.announce_save(self.step, batches, metrics, force)
        states, mesh = self._resizing.writable(self.hooks, self.mesh)
        return self.checkpoints.save(
            states, mesh, wrt=self._wrt, batches=batches, metrics=metrics, force=force
        )

    def restore_and_reshard(
        self,
        source: Any = None,
        *,
        step: int | None = None,
        options: RestoreOptions | None = None,
        **keywords: Any,
    ) -> RestoreReport:
        """Restores ``step`` (default: the latest) of its checkpoints, or ``source``, onto the devices.

        The arguments are :meth:`ShardingHooks.restore_and_reshard`'s; ``source`` defaults to the Trainer's
        own checkpoints (an int there is the step), ``free_live`` and ``max_host_bytes`` to the config's. A
        checkpoint saved without the frozen base (``save_frozen=False``) goes on top of the live base, which
        must be the same weights. The saved data position is set on the next ``train(iterable)``."""
        source, step = (None, source) if isinstance(source, int) else (source, step)
        if source is None:
            self.checkpoints.require("restore")
        self.init()
        report = self.checkpoints.restore(source, step, options, keywords, wrt=self._wrt)
        self.running.steps.reset_counters()
        return report

    def best_step(self) -> int | None:
        """The kept step with the best ``config.best_metric`` (None without one)."""
        return self.checkpointer.best_step() if self.checkpointer is not None else None

    # -- devices --------------------------------------------------------------------

    def resize(
        self, mesh: Mesh | str, *, devices: Sequence[Any] | None = None, donate: bool = True
    ) -> ResizeReport:
        """Moves the live training state onto another mesh and goes on training there.

        ``mesh`` is a Mesh, or a mesh string with the ``devices`` to use (default all); every process calls
        it. The state moves with :meth:`ShardingHooks.on_mesh_change` (each piece sent once, nothing through
        the host); the global batch stays as it was. A process the mesh leaves out is on standby: its
        ``train()`` runs no step, joins the saves and returns with the others. :attr:`data_shard` says which
        rows a process reads; grain's ``ElasticIterator`` moves onto the new shards at its global position.
        """
        self.init()
        return self.running.resize(
            mesh if isinstance(mesh, Mesh) else mesh_from_string(mesh, devices=devices), donate
        )

    def compile_report(self, devices: Sequence[Any], batch: Any) -> CompileReport:
        """Compiles this Trainer's own train step for ``devices`` and reports what each holds and sends.

        On abstract state, so the devices may be a TPU pod's (:func:`nnx_shard.tpu_devices`) on a laptop;
        ``batch`` is a global batch of ``jax.ShapeDtypeStruct``. ``fits`` is False when XLA refuses it for
        memory. An example is in :func:`nnx_shard._trainer._aot.compile_step`."""
        return compile_step(self.config, self._create, self.train_step, devices, batch)

    def suggest(
        self,
        batch: Any = None,
        *,
        budget: int | str | None = None,
        devices: Sequence[Any] | None = None,
        tokens_per_step: int | None = None,
    ) -> Suggestion:
        """:func:`nnx_shard.suggest` for this Trainer's state, each fitting layout's step compiled (given a
        global ``batch`` of ``jax.ShapeDtypeStruct``) with :meth:`compile_report` on ``devices`` (default:
        this machine's); the one whose compiled step sends least is kept (see
        :func:`nnx_shard._trainer._aot.suggest_layout`)."""
        devices = list(devices) if devices is not None else jax.devices()
        options = {"budget": budget, "devices": devices, "tokens_per_step": tokens_per_step}
        return suggest_layout(self.config, self._create, self.train_step, batch, **options)
