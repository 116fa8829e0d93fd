"""A run's lineage in its workdir: the step it came from, whose checkpoints it may replace, and its lock."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax

from nnx_shard._checkpoint import Checkpointer, WorkdirLock
from nnx_shard._cluster import gather_json
from nnx_shard.errors import CheckpointCorruptError, CheckpointExistsError

logger = logging.getLogger("nnx_shard")


class Lineage:
    """Keeps one run from losing another's work, or its own.

    A run that did not resume never saves over checkpoints it finds
    (:class:`CheckpointExistsError`, or ``overwrite`` sets them aside). A run
    that restored an older step than the newest sets the newer ones aside at
    its first save: they belong to the run it branched from. ``resume="auto"``
    goes back to the newest step that reads and verifies. Steps set aside are
    moved, never deleted (see :meth:`Checkpointer.set_aside`).
    """

    def __init__(self, checkpointer: Checkpointer | None, workdir: str | None, *, lock_stale_after: float):
        self.checkpointer = checkpointer
        self.workdir = workdir
        self.lock_stale_after = lock_stale_after
        self.restored_step: int | None = None
        self.restored_from = "checkpoint"  # or "snapshot": a restart's in-memory snapshots
        self.last_saved: int | None = None
        self._branch_open = False
        self._checked = False

    def restored(self, step: int) -> None:
        """``step`` was restored: it counts as saved, and steps newer than it are another run's."""
        self.restored_step = self.last_saved = step
        self._branch_open = True

    def restored_snapshot(self, step: int) -> None:
        """``step`` came from in-memory snapshots: newer than any checkpoint, and not on disk."""
        self.restored_step, self.restored_from = step, "snapshot"

    def saved(self, step: int) -> None:
        self.last_saved = step

    def resume_newest(self, restore: Callable[[int], Any], after: int) -> None:
        """Restores the newest step after ``after`` that reads and verifies; newer ones that fail are set
        aside.

        When none does, raises :class:`CheckpointCorruptError` listing every
        step and why, and moves nothing: a restart must not start from scratch.
        """
        if self.checkpointer is None:
            return
        failed: list[tuple[int, CheckpointCorruptError]] = []
        # the steps every process lists (a host's view may lag): each one tried is a restore of every process
        listings = gather_json(self.checkpointer.all_steps(), site="lineage.resume")
        for step in sorted(set.intersection(*map(set, listings)), reverse=True):
            if step <= after:
                break
            try:
                restore(step)
            except CheckpointCorruptError as e:
                logger.warning("step %d does not restore; trying the one before: %s", step, e)
                failed.append((step, e))
                continue
            if failed:  # never tried again by a later restart; kept for a post-mortem
                self.checkpointer.set_aside(
                    [s for s, _ in failed],
                    kind="rejected",
                    why=f"they did not read or verify; step {step} was restored instead ("
                    + "; ".join(f"step {s}: {e}" for s, e in failed)
                    + ")",
                )
            return
        if failed:
            raise CheckpointCorruptError(
                f"resume='auto' found no step in {self.checkpointer.directory} that reads and verifies, "
                f"so the run does not start: "
                + "; ".join(f"step {s}: {e}" for s, e in failed)
                + ". Move the damaged steps away to start from scratch, or restore one by hand."
            ) from failed[0][1]

    def check_fresh(self, *, overwrite: bool) -> None:
        """Before the first step of a run that restored nothing: refuses (or sets aside) checkpoints found."""
        if self.checkpointer is None or self._checked:
            return
        self._checked = True
        if self.restored_step is not None:
            return
        # decided from process 0's listing, gathered: a process whose listing differs (taken after process 0
        # set the steps aside, or a lagging view of the storage) must not train on alone or stop alone
        steps = gather_json(self.checkpointer.all_steps(), site="lineage.fresh")[0]
        if not steps:
            return
        if overwrite:
            self.checkpointer.set_aside(
                steps, kind="overwritten", why="config overwrite=True: this run starts afresh"
            )
            return
        raise CheckpointExistsError(
            f"workdir {self.workdir} already holds checkpoints of another run (steps {steps}), and this run "
            f"does not resume from them. Resume with config resume='auto' (or call restore_and_reshard), use "
            f"another workdir, or set config overwrite=True to set them aside (moved, not deleted) and start "
            f"afresh. Nothing in the workdir was touched."
        )

    def before_save(self) -> None:
        """At the first save after a restore: steps newer than the restored one are set aside."""
        if not self._branch_open or self.checkpointer is None:
            return
        self._branch_open = False
        listed = [s for s in self.checkpointer.all_steps() if s > (self.restored_step or 0)]
        # every process's listing is taken before process 0 moves any step, and the set-aside (with its
        # barrier) is decided from one of them: a process listing after the move would see none and skip it
        newer = gather_json(listed, site="lineage.newer")[0]
        if newer:
            self.checkpointer.set_aside(
                newer,
                kind="abandoned",
                why=f"this run restored step {self.restored_step} and trains on from there; the newer "
                f"steps belong to the run it branched from",
            )

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Holds the workdir's lock (process 0 holds it for all processes)."""
        if self.workdir is None or jax.process_index() != 0:
            yield
            return
        lock = WorkdirLock(self.workdir, stale_after=self.lock_stale_after).acquire()
        try:
            yield
        finally:
            lock.release()
