"""Reading a checkpoint: its steps' metadata and structure checked, then read into target shardings."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from nnx_shard._base import storage
from nnx_shard._checkpoint._directory import checkpoints_below, corrupted, read_limit, unreadable
from nnx_shard._checkpoint._faults import storage_faults
from nnx_shard._checkpoint._fingerprint import compile_ahead
from nnx_shard._checkpoint._format import (
    leaf_paths,
    recorded_structure,
    restore_keys,
    storage_target,
    structure_problems,
    tree_fingerprints,
)
from nnx_shard._checkpoint._manifest import TREE_METADATA, checked_files
from nnx_shard.errors import CheckpointCorruptError, CheckpointMismatchError, NoCheckpointError

logger = logging.getLogger("nnx_shard")


def registry(restore_bytes: int | None = None) -> Any:
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


class CheckpointReader:
    """A checkpoint directory's reads: steps, metadata, structure checks and reads into target shardings.

    The :class:`nnx_shard.Checkpointer` holds one and opens Orbax's manager for
    it (``manager`` is called on each read, so a manager reopened after a
    failed save is the one read through).
    """

    def __init__(self, directory: epath.Path, verify: bool, options: Any, manager: Callable[[], Any]):
        self.directory, self.verify = directory, verify
        self._options, self._manager = options, manager
        self._names = ocp.step.standard_name_format(  # finished: a final name (and commit_success.txt)
            step_prefix=options.step_prefix, step_format_fixed_length=options.step_format_fixed_length
        )
        self._saved_items: dict[int, list[str]] = {}  # per step, its top-level items (from its metadata)
        self._checked: dict[int, dict[str, bytes]] = {}  # a step's small files, as its structure check read
        self._meta: dict[int, Any] = {}  # the last checked step's metadata, read by its structure check
        self._budgeted: dict[int, ocp.CheckpointManager] = {}  # readers with a host-memory budget

    @property
    def manager(self) -> ocp.CheckpointManager:
        return self._manager()

    def _exists(self) -> bool:
        return self.directory.exists()

    def reading(self, step: int | None) -> contextlib.AbstractContextManager[list[str]]:
        """A storage fault inside a read becomes the error that names the step and what was unreadable."""

        def convert(e: BaseException, hidden: list[str]) -> BaseException:
            others = [s for s in self.all_steps() if s != step] if step is not None else []
            return unreadable(self.directory, step, e, hidden, others)

        return storage_faults(convert)

    def forget(self, steps: Sequence[int]) -> None:
        """``steps`` left the directory: their cached items go, and the budgeted readers list the rest."""
        self._saved_items = {k: v for k, v in self._saved_items.items() if k not in steps}
        for reader in self._budgeted.values():
            reader.reload()

    def close(self) -> None:
        for reader in self._budgeted.values():
            reader.close()
        self._budgeted.clear()

    def all_steps(self) -> list[int]:
        """See :meth:`nnx_shard.Checkpointer.all_steps`. Orbax's view (each step's metrics, a read each) is
        read again only when the finished steps listed differ from it: another writer's saves, set-asides."""
        storage.refresh(self.directory)  # in a bucket, another process's saves and moves are seen
        if not self._exists():
            return []
        listed = sorted(found.step for found in self._names.find_all(self.directory))
        if sorted(self.manager.all_steps()) == listed:
            return listed
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def metadata(self, step: int) -> dict[str, Any]:
        """See :meth:`nnx_shard.Checkpointer.metadata`."""
        self._check_step(step)
        with self.reading(step):
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, Mapping):
            raise self._corrupted(step, f"its metadata is a {type(meta).__name__}, not a JSON object")
        return dict(meta)

    def items(self, step: int) -> list[str]:
        """See :meth:`nnx_shard.Checkpointer.items`."""
        if step not in self._saved_items:
            self._saved_items[step] = sorted(self._saved_tree(step))
        return self._saved_items[step]

    def _saved_tree(self, step: int) -> Any:
        """The saved state's tree metadata (``state/_METADATA``), its faults reported as a read's."""
        with self.reading(step):
            items = self.manager.metadata(step).item_metadata
            tree = items.get("state") if items is not None else None
        if not tree:
            raise self._corrupted(
                step, "the state item has no metadata (state/_METADATA is missing or empty)"
            )
        return tree

    def _finished(self, step: int) -> bool:
        """Whether ``step`` is a finished step there, asked of its folder alone (a listing asks each one)."""
        storage.refresh(self.directory)
        try:
            self._names.find_step(self.directory, step)
        except ValueError:  # not there, or not finished: the listing below says which steps are
            return False
        return True

    def _check_step(self, step: int | None) -> int:
        if step is not None and self._finished(step):
            return step
        steps = self.all_steps()
        if not steps:
            where = "" if self._exists() else " (the directory does not exist)"
            below = (
                checkpoints_below(self.directory)
                if self._exists() and not storage.is_uri(self.directory)
                else []
            )
            hint = (
                f"; checkpoints are in {below}: pass one of those"
                if below
                else "; save one first, or check the path"
            )
            raise NoCheckpointError(f"no checkpoint in {self.directory}{where}{hint}.")
        if step is None:
            return max(steps)
        if step not in steps:
            raise NoCheckpointError(
                f"no checkpoint for step {step} in {self.directory}; the steps there are {steps}."
            )
        return step

    def check_structure(self, step: int, target: Any, *, items: Sequence[str] | None = None) -> None:
        """See :meth:`nnx_shard.Checkpointer.check_structure`."""
        with self.reading(step):
            changed, self._checked[step] = (
                checked_files(self.directory / str(step)) if self.verify else ([], {})
            )
        if changed:
            raise self._corrupted(
                step, f"{len(changed)} of its files differ from when it was saved: {changed[:8]}"
            )
        saved = self._saved_shapes(step)
        wanted = {p: v for p, v in leaf_paths(storage_target(target)[0]).items() if hasattr(v, "shape")}
        parts = structure_problems(saved, wanted, items)
        if parts:
            raise CheckpointMismatchError(
                f"step {step} in {self.directory} holds another structure than the state restored into; "
                + "; ".join(parts)
                + ". Build the model, optimizer and EMA with the config they were saved with."
            )

    def _saved_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """``path -> shape`` of the step's saved leaves (and its items, kept for :meth:`items`): as its save
        recorded them in its metadata, else from Orbax's tree metadata, which opens every array."""
        folder, checked = self.directory / str(step), self._checked.pop(step, {})
        with self.reading(step):  # the item's own file: no barrier across processes, as a restore has
            if "meta/metadata" in checked:  # read and checked against the manifest just now
                meta = json.loads(checked["meta/metadata"])
            else:
                meta = ocp.JsonCheckpointHandler().restore(folder / "meta", args=ocp.args.JsonRestore())
            recorded = recorded_structure(meta) if isinstance(meta, Mapping) else None
            tree, tree_file = checked.get(f"state/{TREE_METADATA}"), folder / "state" / TREE_METADATA
            if recorded is None or tree is not None:
                missing = recorded is not None and not tree
            else:
                missing = not tree_file.exists() or tree_file.stat().length == 0
        if isinstance(meta, Mapping):
            self._meta[step] = meta
        if recorded is None:
            saved_tree = self._saved_tree(step)
            self._saved_items[step] = sorted(saved_tree)
            return {p: tuple(getattr(v, "shape", ())) for p, v in leaf_paths(saved_tree).items()}
        if missing:  # Orbax would read without it into a confusing structure error
            raise self._corrupted(
                step, f"the state item has no metadata (state/{TREE_METADATA} is missing or empty)"
            )
        self._saved_items[step], shapes = recorded
        return shapes

    def validate(self, step: int | None, target: Any, *, items: Sequence[str] | None = None) -> int:
        """See :meth:`nnx_shard.Checkpointer.validate`."""
        step = self._check_step(step)
        start = time.perf_counter()
        self._meta.clear()
        self.check_structure(step, target, items=items)
        logger.info("checked the structure of step %d in %.3f s", step, time.perf_counter() - start)
        return step

    def _reader(self, max_host_bytes: int | None, target: Any) -> ocp.CheckpointManager:
        """Orbax's reader, with a byte limiter when the read's host memory is bounded (see ``read_limit``)."""
        if max_host_bytes is None:
            return self.manager
        limit = read_limit(max_host_bytes, target)
        if limit not in self._budgeted:
            self._budgeted[limit] = ocp.CheckpointManager(
                self.directory, options=self._options, handler_registry=registry(limit)
            )
        return self._budgeted[limit]

    def read(
        self,
        step: int,
        target: Any,
        *,
        partial: bool = False,
        max_host_bytes: int | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """See :meth:`nnx_shard.Checkpointer.read`."""
        known = self._meta.pop(step, None)  # what the step's structure check read, from checked bytes
        stored, keys = storage_target(target)
        start = time.perf_counter()
        # the verification's programs compile while Orbax reads (the first compile in a process costs ~1 s)
        ahead = compile_ahead(jax.tree.leaves(stored)) if self.verify else None
        restore_args = ocp.checkpoint_utils.construct_restore_args(stored)
        args = {"state": ocp.args.PyTreeRestore(stored, restore_args=restore_args, partial_restore=partial)}
        if known is None:
            args["meta"] = ocp.args.JsonRestore()
        with self.reading(step):
            out = self._reader(max_host_bytes, stored).restore(step, args=ocp.args.Composite(**args))
        states, meta = out["state"], out["meta"] if known is None else known
        if not isinstance(meta, Mapping):
            raise self._corrupted(step, f"its metadata is a {type(meta).__name__}, not a JSON object")
        meta = dict(meta)
        logger.info("read step %d through Orbax in %.3f s", step, time.perf_counter() - start)
        if ahead is not None:
            start = time.perf_counter()
            ahead.join()
            logger.info(
                "waited for the fingerprint programs after the read in %.3f s", time.perf_counter() - start
            )
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
        return corrupted(self.directory, step, what, [s for s in self.all_steps() if s != step])

    def restore(
        self, step: int | None, target: Any, *, items: Sequence[str] | None = None
    ) -> tuple[int, Any, dict[str, Any]]:
        """See :meth:`nnx_shard.Checkpointer.restore`."""
        step = self.validate(step, target, items=items)
        states, meta = self.read(step, target, partial=items is not None)
        return step, states, meta
