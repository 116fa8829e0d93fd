"""Checkpoints over Orbax's CheckpointManager: save with metadata, read straight into target shardings."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from nnx_shard._checkpoint_format import (
    changed_files,
    describe_strategy,
    leaf_paths,
    mesh_metadata,
    restore_keys,
    storable,
    storage_target,
    structure_problems,
    tree_fingerprints,
    write_file_manifest,
)
from nnx_shard._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointWarning,
    NoCheckpointError,
)
from nnx_shard._multihost import barrier_sync
from nnx_shard._paths import as_state
from nnx_shard._specs import itemsize
from nnx_shard._storage_faults import describe, is_storage_error, named, os_error, quiet
from nnx_shard._version import __version__
from nnx_shard._workdir import set_aside_folder

logger = logging.getLogger("nnx_shard")
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
TMP_MARK = (
    ".orbax-checkpoint-tmp"  # Orbax writes a step under <step>.orbax-checkpoint-tmp-<n>, then renames it
)
# Host bytes a read holds per byte in flight (see Checkpointer._reader).
READ_AMPLIFICATION = 4


@atexit.register
def _close_open_checkpointers() -> None:
    """Lets background saves finish before the interpreter exits (one hook for all Checkpointers)."""
    for checkpointer in list(_OPEN):
        checkpointer.close()


def _registry(restore_bytes: int | None = None) -> Any:
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    impl = None
    if restore_bytes is not None:  # Orbax's byte limiter for reads, at byte (not GB) granularity
        impl = ocp.BasePyTreeCheckpointHandler(restore_concurrent_bytes=int(restore_bytes))
    state, meta = ocp.PyTreeCheckpointHandler(handler_impl=impl), ocp.JsonCheckpointHandler()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry


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
        # Local paths become absolute; URIs (gs://...) go to Orbax as they are.
        self.directory = (
            epath.Path(directory) if "://" in str(directory) else epath.Path(Path(directory).absolute())
        )
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.verify = verify
        self._unsealed: list[int] = []  # saved steps whose file manifest is not written yet
        self._budgeted: dict[int, ocp.CheckpointManager] = {}  # readers with a host-memory budget
        self._saved_items: dict[int, list[str]] = {}  # per step, its top-level items (from its metadata)
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
        _OPEN.add(self)

    @property
    def manager(self) -> ocp.CheckpointManager:
        """Orbax's CheckpointManager, opened on first use (a missing directory is never created by reading)."""
        if self._manager is None:
            if self._closed:
                raise CheckpointError(f"the Checkpointer of {self.directory} is closed; open a new one.")
            self._remove_leftovers()
            with self._storage(None, "opening"):
                self._manager = ocp.CheckpointManager(
                    self.directory, options=self._options, handler_registry=_registry()
                )
        return self._manager

    def _remove_leftovers(self) -> None:
        """Removes the temporary folders an interrupted save left (process 0), with a note."""
        if jax.process_index() != 0 or not self._exists():
            return
        with self._storage(None, "opening"):
            left = sorted(p for p in self.directory.iterdir() if TMP_MARK in p.name)
            for p in left:
                p.rmtree() if p.is_dir() else p.unlink()
        if left:
            logger.warning(
                "removed %d temporary folders of interrupted saves in %s: %s",
                len(left),
                self.directory,
                [p.name for p in left],
            )

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
        if self.verify:
            start = time.perf_counter()
            meta["fingerprints"] = tree_fingerprints(states)
            logger.info("fingerprinted step %d in %.3f s", step, time.perf_counter() - start)
        with self._storage(step, "saving"):
            if not self._exists():
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
        steps = self.all_steps()
        if step in steps:
            return f"step {step} is already saved there"
        if steps and step < steps[-1] and not force:
            return (
                f"it is older than the newest step {steps[-1]}, and Orbax only writes newer steps "
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
        with self._storage(step, "saving"):
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
        with contextlib.suppress(OSError):
            self._remove_leftovers()
            if step is not None and jax.process_index() == 0 and (self.directory / str(step)).exists():
                if step not in self._finished_steps():
                    (self.directory / str(step)).rmtree()
        cause = os_error(error)
        what = f"{type(cause).__name__}: {cause}" if cause is not None else describe(error)
        return CheckpointSaveError(
            f"step {step} could not be written to {self.directory} ({what}). The earlier steps are intact; "
            f"free space or fix the directory's permissions, and the next save writes."
        )

    def _finished_steps(self) -> list[int]:
        """Steps whose folder Orbax finalised (its commit marker is there)."""
        out = []
        for p in self.directory.iterdir():
            if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists():
                out.append(int(p.name))
        return out

    @contextlib.contextmanager
    def _storage(self, step: int | None, doing: str) -> Iterator[list[str]]:
        """Turns storage faults raised inside into our errors; anything else propagates as itself.

        Orbax raises a bare ``Exception`` for a failed read, wrapping
        TensorStore's error, so no narrower class catches it: the whole chain
        decides (:func:`is_storage_error`), and what is not a storage fault is
        re-raised unchanged.
        """
        with quiet() as hidden:
            try:
                yield hidden
            except CheckpointError:
                raise
            except Exception as e:  # filtered: only storage faults are converted
                if not is_storage_error(e):
                    raise
                if doing == "saving":
                    raise self._save_failed(step, e) from e
                if doing == "setting aside":
                    raise CheckpointError(
                        f"steps could not be moved out of {self.directory} ({describe(e)}); nothing was "
                        f"deleted. Fix the directory's permissions or free space, then start again."
                    ) from e
                raise self._unreadable(step, e, hidden) from e

    def _unreadable(self, step: int | None, error: BaseException, hidden: list[str]) -> CheckpointError:
        denied = os_error(error)
        if isinstance(denied, PermissionError):
            return CheckpointError(
                f"step {step} in {self.directory} cannot be read: permission denied on {denied.filename}. "
                f"Nothing live was changed; fix the file's permissions."
            )
        arrays, files = named(error)
        parts = [describe(error)]
        if arrays:
            parts.insert(0, f"arrays {arrays[:8]}")
        if files:
            parts.insert(0, f"files {files[:4]}")
        if hidden:
            parts.append(f"{len(hidden)} more reads failed")
        if step is None:
            return CheckpointCorruptError(f"{self.directory} could not be opened ({'; '.join(parts)}).")
        return self._corrupted(step, "; ".join(parts))

    def set_aside(self, steps: Sequence[int], *, kind: str, why: str) -> Any:
        """Moves ``steps`` out of the directory (never deleted) so that no restore picks them again.

        They go to ``<directory>.set_aside/<kind>-<time>/<step>``; process 0
        moves, every process then sees the new list of steps. Returns that folder.
        """
        steps = sorted(int(s) for s in steps)
        self.wait_until_finished()
        folder = set_aside_folder(self.directory, kind)
        if jax.process_index() == 0 and steps:
            with self._storage(None, "setting aside"):
                folder.mkdir(parents=True, exist_ok=True)
                for step in steps:
                    (self.directory / str(step)).rename(folder / str(step))
        barrier_sync(f"nnx_shard/set_aside/{kind}", timeout=self.barrier_timeout)
        self._saved_items = {k: v for k, v in self._saved_items.items() if k not in steps}
        for reader in self._budgeted.values():
            reader.reload()
        if steps:
            warnings.warn(
                f"set aside steps {steps} of {self.directory} in {folder}: {why}.",
                CheckpointWarning,
                stacklevel=3,
            )
        return folder

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
        with self._storage(step, "reading"):
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, Mapping):
            raise self._corrupted(step, f"its metadata is a {type(meta).__name__}, not a JSON object")
        return dict(meta)

    def items(self, step: int) -> list[str]:
        """The top-level items of ``step``'s state (``model``, ``optimizer``, ``ema``, ...)."""
        if step not in self._saved_items:
            self._saved_items[step] = sorted(self._saved_tree(step))
        return self._saved_items[step]

    def _saved_tree(self, step: int) -> Any:
        """The saved state's tree metadata (``state/_METADATA``), read as a storage fault would be reported."""
        with self._storage(step, "reading"):
            tree = self.manager.metadata(step).item_metadata["state"]
        if not tree:
            raise self._corrupted(
                step, "the state item has no metadata (state/_METADATA is missing or empty)"
            )
        return tree

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

    def check_structure(self, step: int, target: Any, *, items: Sequence[str] | None = None) -> None:
        """Raises CheckpointMismatchError naming the paths and shapes that differ.

        With ``items`` (a partial restore), only the saved leaves under those
        top-level keys are compared; within them the structure must match exactly.
        """
        with self._storage(step, "reading"):
            changed = changed_files(self.directory / str(step)) if self.verify else []
        if changed:
            raise self._corrupted(
                step, f"{len(changed)} of its files differ from when it was saved: {changed[:8]}"
            )
        saved_tree = self._saved_tree(step)
        self._saved_items[step] = sorted(saved_tree)
        saved = leaf_paths(saved_tree)
        wanted = {p: v for p, v in leaf_paths(storage_target(target)[0]).items() if hasattr(v, "shape")}
        parts = structure_problems(saved, wanted, items)
        if parts:
            raise CheckpointMismatchError(
                f"step {step} in {self.directory} holds another structure than the state restored into; "
                + "; ".join(parts)
                + ". Build the model, optimizer and EMA with the config they were saved with."
            )

    def validate(self, step: int | None, target: Any, *, items: Sequence[str] | None = None) -> int:
        """The step to read (default: the latest), once it exists and matches ``target``'s structure.

        Raises:
          NoCheckpointError, CheckpointMismatchError, CheckpointCorruptError.
        """
        step = self._check_step(step)
        self.check_structure(step, target, items=items)
        return step

    def _reader(self, max_host_bytes: int | None, target: Any) -> ocp.CheckpointManager:
        """Orbax's reader, with a byte limiter when the read's host memory is bounded.

        A shard in flight is held about four times over on the host (TensorStore's
        read buffer, the decoded array, the copy into device memory, and what the
        allocator keeps): measured peak RSS above the state was 1.5-2x Orbax's
        limit plus ~90 MB of fixed overhead. So Orbax gets a quarter of the
        budget, and never less than the largest shard, which must be read whole.
        """
        if max_host_bytes is None:
            return self.manager
        if max_host_bytes <= 0:
            raise CheckpointError(
                f"max_host_bytes must be a positive number of bytes; got {max_host_bytes!r}."
            )
        largest = max(
            (
                math.prod(x.sharding.shard_shape(x.shape)) * itemsize(x.dtype)
                for x in jax.tree.leaves(target)
                if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
            ),
            default=0,
        )
        limit = max(
            max_host_bytes // READ_AMPLIFICATION, largest + 2**20
        )  # Orbax needs room for a whole shard
        if largest * READ_AMPLIFICATION > max_host_bytes:
            logger.warning(
                "max_host_bytes=%d is below what reading the largest shard takes (about %d bytes); reading one shard at a time",
                max_host_bytes,
                largest * READ_AMPLIFICATION,
            )
        if limit not in self._budgeted:
            self._budgeted[limit] = ocp.CheckpointManager(
                self.directory, options=self._options, handler_registry=_registry(limit)
            )
        return self._budgeted[limit]

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
        stored, keys = storage_target(target)
        with self._storage(step, "reading"):
            out = self._reader(max_host_bytes, stored).restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        stored,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(stored),
                        partial_restore=partial,
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        states, meta = out["state"], out["meta"]
        if not isinstance(meta, Mapping):
            raise self._corrupted(step, f"its metadata is a {type(meta).__name__}, not a JSON object")
        meta = dict(meta)
        if self.verify and "fingerprints" in meta:
            self._verify(step, states, meta["fingerprints"])
        return restore_keys(states, meta.get("prng_keys", {}), keys), meta

    def _verify(self, step: int, states: Any, saved: dict[str, str]) -> None:
        start = time.perf_counter()
        got = tree_fingerprints(states)
        differ = sorted(p for p, fp in got.items() if p in saved and saved[p] != fp)
        logger.info("verified %d arrays of step %d in %.3f s", len(got), step, time.perf_counter() - start)
        if differ:
            for x in jax.tree.leaves(states):  # drop what was read; nothing live holds it
                if isinstance(x, jax.Array):
                    x.delete()
            listed = f"{differ[:8]}{' ...' if len(differ) > 8 else ''}"
            raise self._corrupted(
                step, f"the content of {len(differ)} arrays differs from what was saved: {listed}"
            )

    def _corrupted(self, step: int, what: str) -> CheckpointCorruptError:
        others = [s for s in self.all_steps() if s != step]
        return CheckpointCorruptError(
            f"step {step} in {self.directory} could not be read ({what}); it is incomplete or "
            f"corrupted. Nothing live was changed. Other steps: {others}."
        )

    def restore(
        self, step: int | None, target: Any, *, items: Sequence[str] | None = None
    ) -> tuple[int, Any, dict[str, Any]]:
        """Validates and reads ``step`` (default: the latest) straight into ``target``'s shardings.

        Args:
          step: the step, or None for the latest.
          target: :func:`abstract_target` output: abstract arrays with shardings.
          items: restore only these top-level items (``target`` holds just them).

        Returns:
          ``(step, states, metadata)``; nothing live is touched.

        Raises:
          NoCheckpointError, CheckpointMismatchError, CheckpointCorruptError.
        """
        step = self.validate(step, target, items=items)
        states, meta = self.read(step, target, partial=items is not None)
        return step, states, meta

    def close(self) -> None:
        """Waits for a background save and releases Orbax's resources (idempotent)."""
        for reader in self._budgeted.values():
            reader.close()
        self._budgeted.clear()
        self._closed = True
        _OPEN.discard(self)
        if self._manager is not None:
            try:
                self.wait_until_finished()
            finally:
                if self._manager is not None:
                    self._manager.close()
                    self._manager = None
