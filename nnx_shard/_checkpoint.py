"""Checkpoints over Orbax's CheckpointManager: save with metadata, read straight into target shardings."""

from __future__ import annotations

import atexit
import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from nnx_shard._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    NoCheckpointError,
)
from nnx_shard._mesh import describe_mesh
from nnx_shard._paths import as_state, flatten_with_paths, is_variable
from nnx_shard._version import __version__

_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _close_open_checkpointers() -> None:
    """Lets background saves finish before the interpreter exits (one hook for all Checkpointers)."""
    for checkpointer in list(_OPEN):
        checkpointer.close()


def describe_strategy(strategy: Sequence[tuple[str, Any]] | None) -> list[list[str]] | None:
    """A JSON-ready copy of a strategy: ``[[regex, tactic text], ...]``."""
    if strategy is None:
        return None
    return [[str(p), t if isinstance(t, str) else str(t)] for p, t in strategy]


def mesh_metadata(mesh: Mesh | None) -> dict[str, Any]:
    """What a checkpoint records about where it was saved."""
    out: dict[str, Any] = {"devices": jax.device_count(), "processes": jax.process_count()}
    if mesh is not None:
        out["mesh_axis_names"] = list(mesh.axis_names)
        out["mesh_shape"] = [int(s) for s in mesh.devices.shape]
        out["mesh"] = describe_mesh(mesh)
    return out


def abstract_target(state: Any, shardings: Any) -> Any:
    """Abstract arrays carrying the target shardings, for Orbax to restore straight into.

    ``state`` may be live or abstract (``nnx.eval_shape``) Modules, States or
    pytrees; ``shardings`` is :func:`nnx_shard.infer_sharding`'s output for it.
    Nothing is allocated.

    >>> from nnx_shard import create_mesh, infer_sharding
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> model = nnx.eval_shape(lambda: nnx.Linear(4, 16, rngs=nnx.Rngs(0)))
    >>> target = abstract_target(model, infer_sharding(model, [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh))
    >>> target["kernel"].get_value().sharding.spec
    P(None, 'fsdp')
    """
    states, _ = as_state(state)

    def one(sharding: Any, leaf: Any) -> Any:
        value = leaf.get_value() if is_variable(leaf) else leaf
        if sharding is None or not hasattr(value, "shape"):
            return leaf
        sds = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        return leaf.replace(sds) if is_variable(leaf) else sds

    return jax.tree.map(one, shardings, states, is_leaf=lambda x: x is None)


def leaf_paths(tree: Any) -> dict[str, Any]:
    """``path -> value`` for every leaf, in the layout Orbax saves (a Variable's ``/value`` dropped)."""
    out = {}
    for path, leaf in flatten_with_paths(tree)[0]:
        out[path.removesuffix("/value")] = leaf.get_value() if is_variable(leaf) else leaf
    return out


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """What a restore did: which step, from where, onto what.

    >>> print(RestoreReport(300, {"devices": 8, "mesh": "fsdp=8", "processes": 1}, 4, 1, "fsdp=4"))
    restored step 300, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)"""

    step: int
    saved: dict[str, Any]
    devices: int
    processes: int
    mesh: str

    def __str__(self) -> str:
        show = self.saved.get("processes", 1) != 1 or self.processes != 1
        saved = _where(
            self.saved.get("devices", 0), self.saved.get("mesh", "?"), self.saved.get("processes", 1), show
        )
        onto = _where(self.devices, self.mesh, self.processes, show)
        return f"restored step {self.step}, saved on {saved}, onto {onto}"


def _where(devices: int, mesh: str, processes: int, show_processes: bool) -> str:
    """``8 devices (fsdp=8)``, ``1 device``, ``4 devices (fsdp=4) in 2 processes``."""
    text = f"{devices} device{'s' if devices != 1 else ''}" + (f" ({mesh})" if devices != 1 else "")
    if show_processes:
        text += f" in {processes} process{'es' if processes != 1 else ''}"
    return text


def _registry() -> Any:
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state, meta = ocp.PyTreeCheckpointHandler(), ocp.JsonCheckpointHandler()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry


def _policy(max_to_keep: int | None, best_metric: str | None, best_mode: str) -> Any:
    policies = ocp.checkpoint_managers
    if best_metric is None:
        return policies.LatestN(n=max_to_keep) if max_to_keep is not None else policies.PreserveAll()
    best = policies.BestN(
        get_metric_fn=lambda m: float(m[best_metric]),
        reverse=best_mode == "min",
        n=max_to_keep,
        keep_checkpoints_without_metrics=False,
    )
    # The latest checkpoint is kept too, whatever its metric, so a run can always resume.
    return policies.AnyPreservationPolicy([best, policies.LatestN(n=1)])


class Checkpointer:
    """Saves and restores a model + optimizer + EMA with Orbax, resharding on restore.

    Async by default; keeps the last ``max_to_keep`` steps, or the best
    ``max_to_keep`` by ``best_metric`` plus the latest one. Each checkpoint
    records the mesh axis names and shape, device and process counts, the
    strategy and the package version. Orbax writes to a temporary directory
    and renames it when complete, so an interrupted save never replaces the
    last good checkpoint. Opening a directory writes nothing; the first save
    creates it. Close it (or use it as a context manager) to wait for the last
    background save; any still open at exit are closed then.

    Args:
      directory: where checkpoints go: a local path or a URI Orbax
        understands, such as ``gs://bucket/run``.
      max_to_keep: how many to keep (None: all).
      best_metric: keep the best ``max_to_keep`` by this key of ``metrics``.
      best_mode: ``"min"`` or ``"max"`` for ``best_metric``.
      async_save: write in the background (``wait_until_finished`` to block).

    >>> import tempfile
    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> with Checkpointer(tempfile.mkdtemp(), async_save=False) as ckpt:
    ...     ckpt.save(1, {"model": nnx.Linear(4, 8, rngs=nnx.Rngs(0))}, mesh=mesh)
    ...     ckpt.latest_step(), ckpt.metadata(1)["devices"]
    True
    (1, 8)
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int | None = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
    ):
        if best_mode not in ("min", "max"):
            raise CheckpointError(f"best_mode must be 'min' or 'max'; got {best_mode!r}.")
        # Local paths become absolute; URIs (gs://...) go to Orbax as they are.
        self.directory = (
            epath.Path(directory) if "://" in str(directory) else epath.Path(Path(directory).absolute())
        )
        self.best_metric = best_metric
        self.best_mode = best_mode
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_policy(max_to_keep, best_metric, best_mode),
            # best_fn makes Orbax record each step's metrics (it ranks nothing here: the policy does).
            best_fn=(lambda m: float(m[best_metric])) if best_metric else None,
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=False,
        )
        self._options = options
        self._manager: Any = None
        self._closed = False
        _OPEN.add(self)

    @property
    def manager(self) -> ocp.CheckpointManager:
        """Orbax's CheckpointManager, opened on first use (a missing directory is never created by reading)."""
        if self._manager is None:
            if self._closed:
                raise CheckpointError(f"the Checkpointer of {self.directory} is closed; open a new one.")
            self._manager = ocp.CheckpointManager(
                self.directory, options=self._options, handler_registry=_registry()
            )
        return self._manager

    def _exists(self) -> bool:
        return self.directory.exists()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def save(
        self,
        step: int,
        objects: Mapping[str, Any],
        *,
        metrics: Mapping[str, float] | None = None,
        mesh: Mesh | None = None,
        strategy: Sequence[tuple[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves ``{"model": ..., "optimizer": ..., "ema": ...}`` (objects or States) at ``step``.

        Returns whether a save was started (Orbax may skip a step it already has).
        """
        states, _ = as_state(dict(objects))
        meta = {
            "step": int(step),
            "nnx_shard_version": __version__,
            "strategy": describe_strategy(strategy),
            **mesh_metadata(mesh),
            **(dict(extra) if extra else {}),
        }
        if not self._exists():
            self.directory.mkdir(parents=True, exist_ok=True)
        return self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(states), meta=ocp.args.JsonSave(meta)),
            metrics=dict(metrics) if metrics is not None else None,
            force=force,
        )

    def wait_until_finished(self) -> None:
        """Blocks until a background save is on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        """The steps on disk, oldest first (empty when the directory does not exist)."""
        if not self._exists():
            return []
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step with the best ``best_metric`` among those kept (None without a metric)."""
        if self.best_metric is None:
            return None
        scored = []
        for step in self.all_steps():
            value = (self.manager.metadata(step).metrics or {}).get(self.best_metric)
            if value is not None:
                scored.append((float(value) if self.best_mode == "min" else -float(value), step))
        return min(scored)[1] if scored else None

    def metadata(self, step: int) -> dict[str, Any]:
        """The metadata saved with ``step`` (mesh, devices, processes, strategy, version)."""
        self._check_step(step)
        try:
            return dict(
                self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            )
        except Exception as e:
            raise self._corrupt(step, e) from None

    def _check_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            where = "" if self._exists() else " (the directory does not exist)"
            raise NoCheckpointError(
                f"no checkpoint in {self.directory}{where}; save one first, or check the path."
            )
        if step is None:
            return max(steps)
        if step not in steps:
            raise NoCheckpointError(
                f"no checkpoint for step {step} in {self.directory}; the steps there are {steps}."
            )
        return step

    def check_structure(self, step: int, target: Any) -> None:
        """Raises CheckpointMismatchError naming the paths and shapes that differ."""
        try:
            saved_tree = self.manager.metadata(step).item_metadata["state"]
        except Exception as e:
            raise self._corrupt(step, e) from None
        saved = leaf_paths(saved_tree)
        wanted = {p: v for p, v in leaf_paths(target).items() if hasattr(v, "shape")}
        missing = sorted(set(wanted) - set(saved))
        extra = sorted(set(saved) - set(wanted))
        shapes = [
            f"{p}: saved {tuple(saved[p].shape)}, expected {tuple(wanted[p].shape)}"
            for p in sorted(set(saved) & set(wanted))
            if tuple(getattr(saved[p], "shape", ())) != tuple(wanted[p].shape)
        ]
        if missing or extra or shapes:
            parts = []
            if missing:
                parts.append(f"not in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
            if extra:
                parts.append(f"only in the checkpoint: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
            if shapes:
                parts.append(
                    f"shapes differ in {len(shapes)} leaves: {shapes[:8]}{' ...' if len(shapes) > 8 else ''}"
                )
            raise CheckpointMismatchError(
                f"step {step} in {self.directory} holds another structure than the state restored into; "
                + "; ".join(parts)
                + ". Build the model, optimizer and EMA with the config they were saved with."
            )

    def validate(self, step: int | None, target: Any) -> int:
        """The step to read (default: the latest), once it exists and matches ``target``'s structure.

        Raises:
          NoCheckpointError, CheckpointMismatchError, CheckpointCorruptError.
        """
        step = self._check_step(step)
        self.check_structure(step, target)
        return step

    def read(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Reads a :meth:`validate`-d step straight into ``target``'s shardings: ``(states, metadata)``.

        Raises:
          CheckpointCorruptError: the data cannot be read; nothing live is touched.
        """
        try:
            out = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            raise self._corrupt(step, e) from None
        return out["state"], dict(out["meta"])

    def restore(self, step: int | None, target: Any) -> tuple[int, Any, dict[str, Any]]:
        """Validates and reads ``step`` (default: the latest) straight into ``target``'s shardings.

        Args:
          step: the step, or None for the latest.
          target: :func:`abstract_target` output: abstract arrays with shardings.

        Returns:
          ``(step, states, metadata)``; nothing live is touched.

        Raises:
          NoCheckpointError, CheckpointMismatchError, CheckpointCorruptError.
        """
        step = self.validate(step, target)
        states, meta = self.read(step, target)
        return step, states, meta

    def _corrupt(self, step: int, error: Exception) -> CheckpointCorruptError:
        others = [s for s in self.all_steps() if s != step]
        detail = str(error).splitlines()[0][:300] if str(error) else ""
        return CheckpointCorruptError(
            f"step {step} in {self.directory} could not be read ({type(error).__name__}: {detail}); "
            f"it is incomplete or corrupted. Nothing live was changed. Other steps: {others}."
        )

    def close(self) -> None:
        """Waits for a background save and releases Orbax's resources (idempotent)."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
        self._closed = True
        _OPEN.discard(self)
