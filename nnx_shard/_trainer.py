"""Trainer: a base class to subclass; the hooks, a jitted donated step, checkpoints, preemption and resume."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._checkpoint import Checkpointer
from nnx_shard._checkpoint_format import RestoreReport
from nnx_shard._errors import ConfigError
from nnx_shard._hooks import ShardingHooks
from nnx_shard._mesh import mesh_from_string
from nnx_shard._multihost import data_sharding, host_local_to_global

logger = logging.getLogger("nnx_shard")

DEFAULTS: dict[str, Any] = {
    "mesh": "fsdp:-1",
    "sharding_strategy": [(".*", "fsdp(axis='fsdp')")],
    "workdir": "",
    "seed": 0,
    "total_steps": 100,
    "ema_decay": 0.999,
    "save_every": 0,
    "keep": 3,
    "best_metric": "",
    "async_checkpoint": True,
    "log_every": 10,
    "eval_every": 0,
    "barrier_timeout": 200.0,
    "progress": "auto",
}


def default_config() -> ml_collections.ConfigDict:
    """The Trainer's settings; a subclass's config may override any of them.

    >>> default_config().mesh
    'fsdp:-1'
    """
    return ml_collections.ConfigDict(DEFAULTS)


class Trainer:
    """Subclass and give the model, the optax transform and the loss; the rest happens by itself.

    A subclass implements ``create_model(rngs)``, ``create_optimizer()`` and
    ``loss_fn(model, batch)`` (returning a scalar loss, or ``(loss, metrics)``),
    and may override ``train_step``, ``eval_metrics`` and ``on_log``. Metrics also go to
    TensorBoard (``workdir/tensorboard``) when tensorboardX is installed.
    The Trainer builds the mesh from ``config.mesh`` (``"fsdp:-1"``),
    creates the model, ``nnx.Optimizer`` and ``nnx.EMA`` already sharded by
    ``config.sharding_strategy``, runs one jitted step with the state donated,
    turns host-local batches into global ones, saves every
    ``config.save_every`` steps and on preemption (SIGTERM), resumes with
    :meth:`restore_and_reshard` onto whatever devices it has, shows progress
    and writes metrics as JSON lines to ``workdir/metrics.jsonl``.

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
    >>> len(history), history[-1]["loss"] < history[0]["loss"]
    (5, True)
    """

    def __init__(self, config: ml_collections.ConfigDict | Mapping[str, Any] | None = None):
        merged = default_config()
        for key, value in dict(config or {}).items():
            if key in merged:
                merged[key] = value
            else:
                with merged.unlocked():
                    merged[key] = value
        self.config = merged
        self.mesh = mesh_from_string(merged.mesh)
        self.hooks = ShardingHooks(
            list(merged.sharding_strategy), self.mesh, barrier_timeout=merged.barrier_timeout
        )
        workdir = str(merged.workdir or "")
        self.workdir = workdir or None
        # metrics.jsonl is appended to on every log: kept local when the workdir is a URI.
        self.metrics_path = (
            None
            if not workdir
            else Path("metrics.jsonl")
            if "://" in workdir
            else Path(workdir) / "metrics.jsonl"
        )
        self.checkpointer: Checkpointer | None = None
        if workdir:
            self.checkpointer = Checkpointer(
                workdir.rstrip("/") + "/checkpoints",
                max_to_keep=merged.keep,
                best_metric=merged.best_metric or None,
                async_save=merged.async_checkpoint,
            )
        self.step = 0
        self._graphdefs: dict[str, Any] = {}
        self._compiled_step: Any = None
        self._preempted = False
        self._tensorboard: Any = None

    # -- what a subclass gives ------------------------------------------------

    def create_model(self, rngs: nnx.Rngs) -> nnx.Module:
        raise NotImplementedError("a Trainer subclass must define create_model(self, rngs)")

    def create_optimizer(self) -> optax.GradientTransformation:
        raise NotImplementedError("a Trainer subclass must define create_optimizer(self)")

    def loss_fn(self, model: nnx.Module, batch: Any) -> Any:
        raise NotImplementedError("a Trainer subclass must define loss_fn(self, model, batch)")

    def train_step(
        self, model: nnx.Module, optimizer: nnx.Optimizer, ema: nnx.EMA, batch: Any
    ) -> dict[str, Any]:
        """One step, traced under jit: gradients, the optimizer update, the EMA update."""

        def loss(model: nnx.Module) -> tuple[Any, dict[str, Any]]:
            out = self.loss_fn(model, batch)
            return out if isinstance(out, tuple) else (out, {})

        (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        ema.update(model)
        return {"loss": value, **aux}

    def eval_metrics(self, model: nnx.Module, batch: Any) -> dict[str, Any]:
        """Metrics of one eval batch (traced under jit); default: the loss."""
        out = self.loss_fn(model, batch)
        value, aux = out if isinstance(out, tuple) else (out, {})
        return {"loss": value, **aux}

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        """Called with host metrics every ``log_every`` steps; override to add your own logging."""

    # -- setup ------------------------------------------------------------------

    def _create(self) -> dict[str, Any]:
        model = self.create_model(nnx.Rngs(self.config.seed))
        return {
            "model": model,
            "optimizer": nnx.Optimizer(model, self.create_optimizer(), wrt=nnx.Param),
            # The EMA tracks parameters only: RNG keys and counters, batch statistics are not averaged.
            "ema": nnx.EMA(model, decay=self.config.ema_decay, only=nnx.Param),
        }

    def init(self) -> None:
        """Creates model, optimizer and EMA already sharded (the hooks' on_init)."""
        if self.hooks.initialized:
            return
        objects = self.hooks.on_init(self._create)
        self._graphdefs = {k: nnx.graphdef(v) for k, v in objects.items()}

    @property
    def states(self) -> dict[str, Any]:
        """The training state of model, optimizer and EMA (``nnx.State``), owned by the hooks."""
        self.init()
        return self.hooks.states()

    @property
    def plan(self) -> Any:
        """The sharding plan of model, optimizer and EMA."""
        self.init()
        return self.hooks.plan

    def objects(self) -> dict[str, Any]:
        """The live model, optimizer and EMA, brought up to date with the training state."""
        self.init()
        return self.hooks.objects

    def _step_fn(self) -> Callable[..., Any]:
        graphdefs = self._graphdefs

        def step(states: dict[str, Any], batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
            model, optimizer, ema = (
                nnx.merge(graphdefs[k], states[k]) for k in ("model", "optimizer", "ema")
            )
            metrics = self.train_step(model, optimizer, ema, batch)
            return {
                "model": nnx.state(model),
                "optimizer": nnx.state(optimizer),
                "ema": nnx.state(ema),
            }, metrics

        return step

    def compiled_step(self, batch: Any) -> Any:
        """The jitted step: state shardings in and out, the state donated."""
        self.init()
        if self._compiled_step is None:
            shardings = self.hooks.shardings
            replicated = NamedSharding(self.mesh, PartitionSpec())
            self._compiled_step = jax.jit(
                self._step_fn(),
                in_shardings=(shardings, jax.tree.map(lambda _: data_sharding(self.mesh), batch)),
                out_shardings=(shardings, replicated),
                donate_argnums=0,
            )
        return self._compiled_step

    # -- the loop ---------------------------------------------------------------

    def global_batch(self, batch: Any) -> Any:
        """A host-local batch (numpy) as a global batch on the data axes; global arrays pass through."""
        target = data_sharding(self.mesh)
        leaves = jax.tree.leaves(batch)
        if leaves and all(isinstance(x, jax.Array) and x.sharding == target for x in leaves):
            return batch
        return host_local_to_global(batch, self.mesh)

    def _preemption_requested(self) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(self.step))
        return self._preempted

    def _install_sigterm(self) -> Any:
        if jax.process_count() > 1 or not _main_thread() or jax.distributed.is_initialized():
            return None  # JAX's preemption notifier owns SIGTERM after distributed init

        def handler(signum: int, frame: Any) -> None:
            self._preempted = True

        return signal.signal(signal.SIGTERM, handler)

    def train(
        self,
        data: Callable[[int], Any] | Iterable[Any],
        *,
        eval_data: Callable[[], Iterable[Any]] | None = None,
        steps: int | None = None,
    ) -> list[dict[str, float]]:
        """Trains up to ``config.total_steps`` (or ``steps`` more) and returns the logged metrics.

        Args:
          data: ``step -> host-local batch`` (resumable: the batch of a step is
            the same after a restore), or an iterable of batches.
          eval_data: returns an iterable of eval batches; run every ``eval_every`` steps.
          steps: train this many steps from the current one instead.

        Returns:
          One dict per logged step: ``step``, ``loss`` and the other metrics.
        """
        self.init()
        end = self.step + steps if steps is not None else self.config.total_steps
        batches: Iterator[Any] | None = None if callable(data) else iter(data)
        previous = self._install_sigterm()
        history: list[dict[str, float]] = []
        bar = self._progress(end)
        try:
            while self.step < end:
                batch = data(self.step) if batches is None else next(batches)
                batch = self.global_batch(batch)
                states, metrics = self.compiled_step(batch)(self.hooks.states(), batch)
                self.hooks.update(states)
                self.step += 1
                if self.step % max(1, self.config.log_every) == 0 or self.step == end:
                    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    history.append({"step": self.step, **host})
                    self._log(history[-1], bar)
                if (
                    eval_data is not None
                    and self.config.eval_every
                    and self.step % self.config.eval_every == 0
                ):
                    self._log({"step": self.step, **self.evaluate(eval_data())}, bar)
                if self.config.save_every and self.step % self.config.save_every == 0:
                    self.save()
                if self._preemption_requested():
                    logger.warning("preemption requested at step %d: saving and stopping", self.step)
                    self.save(force=True)
                    break
            else:  # finished: keep the final state too
                if self.checkpointer is not None and self.checkpointer.latest_step() != self.step:
                    self.save()
        finally:
            if bar is not None:
                bar.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if self.checkpointer is not None:
                self.checkpointer.wait_until_finished()
            if self._tensorboard:
                self._tensorboard.close()  # writes what is buffered; the next train() opens a new file
                self._tensorboard = None
        return history

    def evaluate(self, batches: Iterable[Any], *, use_ema: bool = True) -> dict[str, float]:
        """Mean of ``eval_metrics`` over the batches, on the EMA parameters by default."""
        self.init()
        graphdef = self._graphdefs["model"]
        params = self.states["ema"]["params"] if use_ema else None

        @jax.jit
        def run(model_state: Any, ema_params: Any, batch: Any) -> dict[str, Any]:
            model = nnx.merge(graphdef, model_state)
            if ema_params is not None:
                nnx.update(model, ema_params)
            model.eval()  # dropout off, batch norm on its running statistics
            return self.eval_metrics(model, batch)

        totals: dict[str, float] = {}
        count = 0
        for batch in batches:
            out = jax.device_get(run(self.states["model"], params, self.global_batch(batch)))
            for k, v in out.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            count += 1
        return {f"eval_{k}": v / max(count, 1) for k, v in totals.items()}

    # -- checkpoints --------------------------------------------------------------

    def save(self, *, metrics: Mapping[str, float] | None = None, force: bool = False) -> bool:
        """Saves model, optimizer, EMA and step (async unless ``async_checkpoint`` is False)."""
        if self.checkpointer is None:
            raise ConfigError("no workdir in the config: set config.workdir to save checkpoints.")
        self.init()
        return self.checkpointer.save(
            self.step,
            self.states,
            metrics=metrics,
            mesh=self.mesh,
            strategy=list(self.config.sharding_strategy),
            force=force,
        )

    def restore_and_reshard(
        self, step: int | None = None, *, items: Sequence[str] | None = None, free_live: bool = False
    ) -> RestoreReport:
        """Restores ``step`` (default: the latest) onto this Trainer's devices, whatever they were at save time.

        ``items`` restores only those objects and keeps the others as they are:
        ``items=("model", "ema")`` to fine-tune from a checkpoint with a new
        optimizer.
        """
        if self.checkpointer is None:
            raise ConfigError("no workdir in the config: set config.workdir to restore checkpoints.")
        self.init()
        report = self.hooks.restore_and_reshard(
            self.checkpointer, step=step, items=items, free_live=free_live
        )
        self.step = report.step
        return report

    # -- progress and metrics -----------------------------------------------------

    def _progress(self, end: int) -> Any:
        mode = self.config.progress
        if mode == "off" or (mode == "auto" and not sys.stderr.isatty()) or jax.process_index() != 0:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency
            return None
        return tqdm(total=end, initial=self.step, desc="train", dynamic_ncols=True)

    def _log(self, record: dict[str, float], bar: Any) -> None:
        shown = {k: round(v, 4) for k, v in record.items() if k != "step"}
        if bar is not None:
            bar.update(int(record["step"]) - bar.n)
            bar.set_postfix(shown)
        elif jax.process_index() == 0 and self.config.progress != "off":
            logger.info("step %d: %s", int(record["step"]), shown)
        if self.metrics_path is not None and jax.process_index() == 0:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")
        writer = self._tensorboard_writer()
        if writer is not None:
            for key, value in record.items():
                if key != "step":
                    writer.add_scalar(key, value, int(record["step"]))
            writer.flush()
        self.on_log(int(record["step"]), {k: v for k, v in record.items() if k != "step"})

    def _tensorboard_writer(self) -> Any:
        """A TensorBoard writer in ``<workdir>/tensorboard`` when tensorboardX is installed (process 0)."""
        if self._tensorboard is None:
            self._tensorboard = False
            if self.metrics_path is not None and jax.process_index() == 0:
                try:
                    from tensorboardX import SummaryWriter
                except ImportError:
                    return None
                self._tensorboard = SummaryWriter(str(self.metrics_path.parent / "tensorboard"))
        return self._tensorboard or None


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
