"""The ``recovered`` event of a job restarted by ``nnx-shard launch``: what it resumed from and where the time
went."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_collections

from nnx_shard._base import mesh_processes, storage
from nnx_shard._cluster import FAILED_AT, PREVIOUS_PROCESSES, STOPPED_AT, agree, launch_info
from nnx_shard._live import ShardingHooks
from nnx_shard._snapshots import (
    Snapshots,
    SnapshotWriter,
    default_snapshot_dir,
    snapshot_folder,
    snapshot_own_bytes,
)
from nnx_shard._trainer import _data
from nnx_shard._trainer._lineage import Lineage
from nnx_shard._trainer._observe import Observer
from nnx_shard.errors import NoCheckpointError

logger = logging.getLogger("nnx_shard")


@dataclasses.dataclass
class Progress:
    """Where a Trainer's run is: the step (the loop advances it, a restore sets it) and the last eval's
    metrics."""

    step: int = 0
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)


def _env_time(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def recovery_fields(
    lineage: Lineage, read: float, began: float, first_step_s: float, compile_s: float
) -> dict[str, Any] | None:
    """The ``recovered`` event's fields, or None when this run is not a restart.

    ``source`` is ``"snapshot"`` or ``"checkpoint"``; the phases are ``detection_s`` (the death
    seen, the other processes stopped), ``relaunch_s`` (from then to the
    first step, less the restore: start, joining, creating the state),
    ``read_reshard_s``, ``compile_s`` and ``first_step_s`` (the first step without its compile). ``began`` is
    when the first step began (epoch); ``read`` the seconds the restore took.
    """
    info = launch_info()
    if info is None or info.restart == 0:
        return None
    failed, stopped = _env_time(FAILED_AT), _env_time(STOPPED_AT)
    return {
        "source": lineage.restored_from,
        "restored_step": lineage.restored_step,
        "restart": info.restart,
        "processes_before": int(os.environ.get(PREVIOUS_PROCESSES, "0") or 0),
        "processes_after": jax.process_count(),
        "detection_s": None if failed is None or stopped is None else round(stopped - failed, 3),
        "relaunch_s": None if stopped is None else round(began - stopped - read, 3),
        "read_reshard_s": round(read, 3),
        "compile_s": round(compile_s, 3),
        "first_step_s": round(max(first_step_s - compile_s, 0.0), 3),
    }


def failed_at() -> float | None:
    """When ``nnx-shard launch`` saw the death this job restarted after (epoch seconds); None on a first
    run."""
    return _env_time(FAILED_AT) if is_restart() else None


def is_restart() -> bool:
    """Whether this process is part of a job that ``nnx-shard launch`` restarted."""
    info = launch_info()
    return info is not None and info.restart > 0


class Recovery:
    """A Trainer's snapshots and restarts: writes in-memory snapshots, resumes a restarted job from them (or
    from the newest checkpoint), and reports the restart. Holds the few parts of the Trainer it needs."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        workdir: str | None,
        hooks: ShardingHooks,
        lineage: Lineage,
        observer: Observer,
        progress: Progress,
    ):
        self.config, self.workdir, self.hooks = config, workdir, hooks
        self.lineage, self.observer, self.progress = lineage, observer, progress

    def _root(self) -> Path:
        """``config.snapshot_dir``, or a folder of this workdir's own under ``/dev/shm``."""
        where = os.fspath(storage.location(self.workdir or "nnx_shard"))
        job = hashlib.sha256(where.encode()).hexdigest()[:12]
        return Path(self.config.snapshot_dir or default_snapshot_dir(job))

    def _previous_folder(self) -> Path | None:
        """This process's snapshot folder in the run before this restart (None at first, or a new process)."""
        info = launch_info()
        if info is None or info.restart == 0 or info.previous_id is None:
            return None
        return snapshot_folder(self._root(), info.restart - 1, info.previous_id)

    def resume_from_snapshots(self) -> Snapshots | None:
        """On a restart with snapshots on: restores the newest snapshot state newer than every checkpoint.

        A collective. Returns what was restored (its ``data_states`` are the caller's to use), or None (and
        nothing changed) when there is none, or
        when a piece does not read or verify: the caller restores a checkpoint instead.
        """
        info = launch_info()
        if info is None or info.restart == 0 or not self.config.snapshot_every:
            return None
        began = time.perf_counter()
        checkpointer = self.lineage.checkpointer
        steps = checkpointer.all_steps() if checkpointer is not None else []
        previous = int(os.environ.get(PREVIOUS_PROCESSES, "0") or 0)
        # the newest checkpoint any process lists (the snapshots read are chosen from it: every process
        # alike); a snapshot of its step is preferred: it is read from memory
        newest = int(agree("recovery.newest", [max(steps, default=0)]).max())
        got = Snapshots(self._previous_folder(), previous, after=newest - 1)
        try:
            self.hooks.restore_and_reshard(got)
        except NoCheckpointError:  # none complete and verified (every process alike): a checkpoint instead
            return None
        self.progress.step = got.step
        self.lineage.restored_snapshot(got.step)
        seconds = time.perf_counter() - began
        self.observer.event("restore", seconds, got.step, source="snapshot", processes_before=previous)
        return got

    def resume_auto(self, restore: Callable[[int], Any]) -> Snapshots | None:
        """``resume="auto"``: a restart's snapshots when newer than every checkpoint (returned: their
        ``data_states`` are the caller's), else the newest checkpoint that reads and verifies with
        ``restore(step)`` (None)."""
        got = self.resume_from_snapshots()
        if got is None:
            self.lineage.resume_newest(restore, after=self.progress.step)
        return got

    def start_snapshots(self) -> SnapshotWriter | None:
        """The snapshot writer of ``config.snapshot_every`` (None when off), its memory checked and logged.

        Raises:
          ConfigError: the snapshot folder has less free space than the kept snapshots need.
        """
        cfg = self.config
        if not cfg.snapshot_every:
            return None
        holding = mesh_processes(self.hooks.mesh)
        if len(holding) < jax.process_count():  # a snapshot is a collective of every process, a peer's too
            logger.warning(
                "in-memory snapshots pause while the mesh leaves %d of %d processes without devices "
                "(Trainer.resize); checkpoints go on, and snapshots start again on a mesh with every process",
                jax.process_count() - len(holding),
                jax.process_count(),
            )
            return None
        info = launch_info()
        root = self._root()
        discard = []
        if info is not None and info.restart > 0:  # its own, and a lost process's on the same host
            before = [info.previous_id] if info.previous_id is not None else []
            discard = [snapshot_folder(root, info.restart - 1, p) for p in [*before, *info.lost]]
        run = None if info is None else info.restart
        writer = SnapshotWriter(root, keep=2, run=run, discard=discard, every=cfg.snapshot_every)
        need = writer.check_space(snapshot_own_bytes(self.hooks.states()))
        logger.info(
            "snapshots every %d steps in %s: %.1f MiB of host memory here (own and a peer's shards, 2 kept)",
            cfg.snapshot_every,
            writer.folder,
            need / 2**20,
        )
        return writer

    def snapshot(self, writer: SnapshotWriter, step: int, batches: _data.Batches | None) -> None:
        """Starts the snapshot of ``step`` (a collective: every process at the same step) and logs it as an
        event whose seconds are what the step waited; one due while the last is still written is skipped.

        The position of ``batches`` goes with it when they can resume.
        """
        began = time.perf_counter()
        in_flight = writer.in_flight
        data = _data.encode_state(batches.state()) if batches is not None and batches.resumable else None
        if writer.write(step, self.hooks.states(), data, skip_if_busy=True):
            own, peer = writer.last_bytes
            self.observer.event("snapshot", time.perf_counter() - began, step, own_bytes=own, peer_bytes=peer)
            return
        log = logger.warning if writer.skipped == 1 else logger.info  # said once; the events count them all
        which = f"the one of step {in_flight}" if in_flight is not None else "another process's last one"
        log(
            "the snapshot of step %d was skipped: %s is still being written (%d skipped in this run); a "
            "larger "
            "snapshot_every leaves it time",
            step,
            which,
            writer.skipped,
        )
        self.observer.event("snapshot_skipped", time.perf_counter() - began, step, skipped=writer.skipped)
