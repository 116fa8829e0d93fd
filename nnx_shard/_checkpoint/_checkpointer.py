"""Checkpoints over Orbax's CheckpointManager: save with metadata, read straight into target shardings."""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from nnx_shard._base import as_state, storage
from nnx_shard._checkpoint._directory import (
    checkpoint_directory,
    move_failed,
    move_steps,
    remove_leftovers,
    remove_unfinished,
    save_failed,
)
from nnx_shard._checkpoint._faults import StorageAction, is_storage_error, storage_faults
from nnx_shard._checkpoint._fingerprint import compile_ahead
from nnx_shard._checkpoint._format import (
    describe_strategy,
    mesh_metadata,
    saved_structure,
    storable,
    tree_fingerprints,
)
from nnx_shard._checkpoint._manifest import write_file_manifest
from nnx_shard._checkpoint._reads import CheckpointReader, registry
from nnx_shard._checkpoint._workdir import set_aside_folder
from nnx_shard._cluster import agree, barrier_sync
from nnx_shard._version import __version__
from nnx_shard.errors import CheckpointError, CheckpointSaveError, CheckpointWarning

logger = logging.getLogger("nnx_shard")
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


@atexit.register
def _close_open_checkpointers() -> None:
    """Lets background saves finish before the interpreter exits (one hook for all Checkpointers)."""
    for checkpointer in list(_OPEN):
        checkpointer.close()


def _policy(max_to_keep: int | None, best_metric: str | None, best_mode: str) -> Any:
    policies = ocp.checkpoint_managers
    if best_metric is None:
        return policies.LatestN(n=max_to_keep)  # n=None keeps every step
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
      verify: record a fingerprint of every array at save (computed on the
        devices, independent of the sharding) and check it on restore, raising
        :class:`CheckpointCorruptError` naming the arrays that differ.

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
        verify: bool = True,
    ):
        if best_mode not in ("min", "max"):
            raise CheckpointError(f"best_mode must be 'min' or 'max'; got {best_mode!r}.")
        # Local paths become absolute; a URI is checked (its scheme served, its bucket there) before use.
        where = storage.location(directory)
        storage.check_bucket(where)
        self.directory = checkpoint_directory(where)  # a Trainer's workdir too
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.verify = verify
        self._unsealed: list[int] = []  # saved steps whose file manifest is not written yet
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
        self._pending: int | None = None  # the step of a save not yet known to be on disk
        self.last_skip_reason: str | None = None
        self.barrier_timeout = 200.0
        self._closed = False
        self._reads = CheckpointReader(self.directory, verify, options, lambda: self.manager)
        self._ahead: threading.Thread | None = None  # a save's fingerprint programs compiling (prepare)
        _OPEN.add(self)

    @property
    def manager(self) -> ocp.CheckpointManager:
        """Orbax's CheckpointManager, opened on first use (reading never creates a missing directory)."""
        if self._manager is None:
            if self._closed:
                raise CheckpointError(f"the Checkpointer of {self.directory} is closed; open a new one.")
            with self._reads.reading(None):  # a fault opening is reported as a read's
                remove_leftovers(self.directory)  # of interrupted saves, with a note
                self._manager = ocp.CheckpointManager(
                    self.directory, options=self._options, handler_registry=registry()
                )
        return self._manager

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def prepare(self, objects: Mapping[str, Any]) -> None:
        """Starts compiling, in a background thread, what a verified save of ``objects`` runs on GPUs and
        TPUs (each large array's fingerprint program), so that the first save compiles nothing: the Trainer
        calls it as a run starts. Nothing to compile on CPU devices, or with ``verify=False``.

        >>> import tempfile
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), async_save=False)
        >>> model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        >>> ckpt.prepare({"model": model})  # returns at once; a save waits for what it started
        >>> ckpt.save(1, {"model": model}), ckpt.close()
        (True, None)
        """
        if self.verify:  # the leaves as they are (a save's storable form differs in keys only: small arrays)
            self._ahead = compile_ahead(jax.tree.leaves(as_state(dict(objects))[0]))

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

        Returns True when the save was started, False when it was not written:
        the step is already saved, or is older than the newest step (which
        Orbax never writes over; ``force`` writes an older step). A skip is
        never silent: a :class:`CheckpointWarning` says why, and
        ``last_skip_reason`` holds it.

        Raises:
          CheckpointSaveError: the step could not be written (a full disk, an
            unwritable directory), naming the step, the path and the OS error;
            with async saves, raised by the next ``save``,
            ``wait_until_finished`` or ``close``. Earlier steps stay intact and
            the next save, once the cause is gone, writes.
        """
        step = int(step)
        self.last_skip_reason = None
        self.wait_until_finished()  # a failed earlier save is reported before this one starts
        reason = self._skip_reason(step, force)
        if reason is not None:
            return self._skipped(step, reason)
        states, keys = storable(as_state(dict(objects))[0])
        meta = {
            "step": step,
            "nnx_shard_version": __version__,
            "strategy": describe_strategy(strategy),
            **mesh_metadata(mesh),
            "prng_keys": keys,
            **(dict(extra) if extra else {}),
        }
        meta["structure"] = saved_structure(states)
        if self.verify:
            start = time.perf_counter()
            if self._ahead is not None:  # the programs prepare() is compiling: waited for, not compiled again
                self._ahead.join()
                self._ahead = None
            meta["fingerprints"] = tree_fingerprints(states)
            logger.info("fingerprinted step %d in %.3f s", step, time.perf_counter() - start)
        with self._storage(step, StorageAction.SAVING):
            if not self.directory.exists():
                self.directory.mkdir(parents=True, exist_ok=True)
            self._pending = step
            started = self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(states), meta=ocp.args.JsonSave(meta)),
                metrics=dict(metrics) if metrics is not None else None,
                force=force,
            )
        if not started:
            self._pending = None
            return self._skipped(step, "Orbax's save policy declined it")
        self._unsealed.append(step)
        if not self._options.enable_async_checkpointing:
            self.wait_until_finished()
        return True

    def _skip_reason(self, step: int, force: bool) -> str | None:
        """Why ``step`` is not saved, or None. A skip skips collectives (the fingerprints, Orbax's barrier),
        so with several processes it is decided from every process's listing alike."""
        steps = self.all_steps()
        newest = max(steps, default=-1)
        code = 1 if step in steps else 2 if step < newest and not force else 0
        if jax.process_count() > 1:  # the processes' views, agreed: every process skips, or none
            code, newest = (int(x) for x in agree("checkpoint.skip", [code, newest + 1], step=step).max(0))
            newest -= 1
        if code == 1:
            return f"step {step} is already saved there"
        if code == 2:
            return (
                f"it is older than the newest step {newest}, and Orbax only writes newer steps "
                f"(a run that restored an older step sets the newer ones aside first; Trainer.train does)"
            )
        return None

    def _skipped(self, step: int, reason: str) -> bool:
        self.last_skip_reason = reason
        warnings.warn(
            f"step {step} was not saved in {self.directory}: {reason}.", CheckpointWarning, stacklevel=3
        )
        return False

    def wait_until_finished(self) -> None:
        """Blocks until a background save is on disk (and records its files' checksums).

        Raises:
          CheckpointSaveError: that save failed; its partial files are removed.
        """
        step = self._pending
        with self._storage(step, StorageAction.SAVING):
            if self._manager is not None:
                self._manager.wait_until_finished()
            if self.verify:
                for s in self._unsealed:
                    write_file_manifest(self.directory / str(s))
        self._unsealed.clear()
        self._pending = None

    def _save_failed(self, step: int | None, error: BaseException) -> CheckpointSaveError:
        """Forgets the failed save (Orbax's manager, its partial files) so that the next save writes."""
        self._pending, self._unsealed = None, []
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                manager.close()
            except Exception as e:  # the failed save's own error again, being reported now
                if not is_storage_error(e):
                    raise
        if step is not None:  # its temporaries go when the next manager opens the directory
            with contextlib.suppress(OSError):
                remove_unfinished(self.directory, step)
        return save_failed(self.directory, step, error)

    @contextlib.contextmanager
    def _storage(self, step: int | None, action: StorageAction) -> Iterator[list[str]]:
        """Turns storage faults raised inside into the error of ``action`` (see :func:`storage_faults`)."""

        def convert(e: BaseException, hidden: list[str]) -> BaseException:
            if action is StorageAction.SAVING:
                return self._save_failed(step, e)
            return move_failed(self.directory, e)  # StorageAction.SETTING_ASIDE

        with storage_faults(convert) as hidden:
            yield hidden

    def set_aside(self, steps: Sequence[int], *, kind: str, why: str) -> Any:
        """Moves ``steps`` out of the directory (never deleted) so that no restore picks them again.

        They go to ``<directory>.set_aside/<kind>-<time>/<step>``; process 0
        moves, every process then sees the new list of steps. Returns that folder.
        """
        steps = sorted(int(s) for s in steps)
        self.wait_until_finished()
        folder = set_aside_folder(self.directory, kind)
        if jax.process_index() == 0 and steps:
            with self._storage(None, StorageAction.SETTING_ASIDE):
                move_steps(self.directory, steps, folder)
        barrier_sync(f"nnx_shard/set_aside/{kind}", timeout=self.barrier_timeout)
        storage.refresh(self.directory)  # every process lists what process 0 moved
        self._reads.forget(steps)
        if steps:
            warnings.warn(
                f"set aside steps {steps} of {self.directory} in {folder}: {why}.",
                CheckpointWarning,
                stacklevel=3,
            )
        return folder

    # -- reads (a CheckpointReader does them) ------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps on disk, oldest first (empty when the directory does not exist)."""
        return self._reads.all_steps()

    def metadata(self, step: int) -> dict[str, Any]:
        """The metadata saved with ``step`` (mesh, devices, processes, strategy, version; the state's
        structure, its items and leaf shapes, that restores check without opening every array). With several
        processes every process calls it: Orbax's read of it ends in a barrier of all of them."""
        return self._reads.metadata(step)

    def items(self, step: int) -> list[str]:
        """The top-level items of ``step``'s state (``model``, ``optimizer``, ``ema``, ...)."""
        return self._reads.items(step)

    def check_structure(self, step: int, target: Any, *, items: Sequence[str] | None = None) -> None:
        """Raises CheckpointMismatchError naming the paths and shapes that differ from ``target``'s.

        With ``items`` (a partial restore), only the saved leaves under those
        top-level keys are compared; within them the structure must match exactly.
        The saved structure is the one the save recorded in the step's metadata
        (one small file); for a step saved before nnx_shard recorded it, Orbax's
        tree metadata, which opens every array.
        """
        self._reads.check_structure(step, target, items=items)

    def validate(self, step: int | None, target: Any, *, items: Sequence[str] | None = None) -> int:
        """The step to read (default: the latest), once it exists and matches ``target``'s structure.

        Raises:
          NoCheckpointError, CheckpointMismatchError, CheckpointCorruptError.
        """
        return self._reads.validate(step, target, items=items)

    def read(
        self, step: int, target: Any, *, partial: bool = False, max_host_bytes: int | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reads a :meth:`validate`-d step straight into ``target``'s shardings: ``(states, metadata)``.

        With ``partial``, only the leaves in ``target`` are read. Typed PRNG keys
        come back as keys. When the checkpoint carries fingerprints (and
        ``verify`` is on), the restored arrays are checked against them.
        ``max_host_bytes`` bounds the bytes Orbax holds in host memory for
        reads in flight at once (its restore byte limiter).

        Raises:
          CheckpointCorruptError: the data cannot be read, or differs from what
            was saved (the arrays are named); nothing live is touched.
        """
        return self._reads.read(step, target, partial=partial, max_host_bytes=max_host_bytes)

    def restore(
        self, step: int | None, target: Any, *, items: Sequence[str] | None = None
    ) -> tuple[int, Any, dict[str, Any]]:
        """Validates and reads ``step`` (default: the latest) straight into ``target``'s shardings.

        Args:
          step: the step, or None for the latest.
          target: :func:`nnx_shard.abstract_target` output: abstract arrays with shardings.
          items: restore only these top-level items (``target`` holds just them).

        Returns:
          ``(step, states, metadata)``; nothing live is touched.

        Raises:
          NoCheckpointError, CheckpointMismatchError, CheckpointCorruptError.
        """
        return self._reads.restore(step, target, items=items)

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

    def close(self) -> None:
        """Waits for a background save and releases Orbax's resources (idempotent)."""
        self._reads.close()
        self._closed = True
        _OPEN.discard(self)
        if self._manager is not None:
            try:
                self.wait_until_finished()
            finally:
                if self._manager is not None:
                    self._manager.close()
                    self._manager = None
