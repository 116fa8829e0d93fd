"""A Trainer's checkpoints: what a save writes (the frozen base left out, the data position) and how a restore
reads."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from nnx_shard._base import MODEL
from nnx_shard._checkpoint import (
    Checkpointer,
    RestoreOptions,
    RestoreReport,
    newest_listed,
    storable,
    tree_fingerprints,
)
from nnx_shard._live import ShardingHooks, restore_options
from nnx_shard._trainer._data import gather_states
from nnx_shard._trainer._finetune import frozen_filter
from nnx_shard._trainer._lineage import Lineage
from nnx_shard._trainer._observe import Observer
from nnx_shard._trainer._recovery import Progress, Recovery
from nnx_shard.errors import CheckpointError, CheckpointMismatchError, ConfigError


def states_to_save(
    states: dict[str, Any], wrt: Any, save_frozen: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    """The states a checkpoint holds: without the frozen parameters when ``save_frozen`` is False, their
    fingerprints then going into ``extra`` (``frozen_fingerprints``) for the restore to check."""
    if save_frozen:
        return states
    frozen, rest = nnx.split_state(states["model"], frozen_filter(wrt), ...)
    extra["frozen_fingerprints"] = tree_fingerprints(storable(frozen)[0])
    return {**states, "model": rest}


def frozen_for_restore(checkpointer: Any, step: int | None, items: Any, live_model: Any, wrt: Any) -> Any:
    """The filter of the parameters ``step`` was saved without (None when it holds them all), once the live
    ones are the same weights it was trained on.

    Raises:
      CheckpointMismatchError: the live frozen parameters differ from those the checkpoint was saved with.
    """
    steps = checkpointer.all_steps()
    if (items and "model" not in items) or (step is None and not steps):
        return None  # the restore itself says there is nothing to read
    try:
        meta = checkpointer.metadata(steps[-1] if step is None else step)
    except CheckpointError:  # a missing or damaged step: the restore names it, its files checked first
        return None
    saved = meta.get("frozen_fingerprints")
    if saved is None:
        return None
    frozen = nnx.split_state(live_model, frozen_filter(wrt), ...)[0]
    live = tree_fingerprints(storable(frozen)[0])
    differ = sorted(p for p in set(saved) | set(live) if saved.get(p) != live.get(p))
    if differ:
        raise CheckpointMismatchError(
            f"step {meta.get('step')} was saved without its frozen parameters (save_frozen=False), and the "
            f"model's frozen parameters differ from the ones it was trained on: {differ[:8]}"
            f"{' ...' if len(differ) > 8 else ''}. Load the same base weights (Trainer.load_pretrained) "
            "first."
        )
    return frozen_filter(wrt)


def trainer_options(
    config: Any,
    checkpointer: Any,
    step: int | None,
    live_model: Any,
    wrt: Any,
    options: RestoreOptions | None,
    keywords: dict[str, Any],
) -> RestoreOptions:
    """A Trainer's restore options: ``options=`` or the keywords, ``free_live`` and ``max_host_bytes`` not
    given taking the config's; reading its own ``checkpointer``, the frozen base kept when not saved."""
    if options is None:
        keywords = dict(keywords)
        for key in ("free_live", "max_host_bytes"):
            keywords[key] = config[key] if keywords.get(key) is None else keywords[key]
    opts = restore_options("Trainer.restore_and_reshard", options, keywords)
    if checkpointer is not None and opts.frozen is None:
        frozen = frozen_for_restore(checkpointer, step, opts.only, live_model, wrt)
        opts = dataclasses.replace(opts, frozen=frozen)
    return opts


class Checkpoints:
    """A Trainer's saves and restores: what a save writes (the frozen base left out, the data position), how a
    restore reads, and the data position a restore hands to the next ``train()``.

    Holds the few parts of the Trainer it needs: the config, the checkpointer (None without a workdir),
    the hooks, the lineage, the observer and the progress.
    """

    def __init__(
        self,
        config: Any,
        checkpointer: Checkpointer | None,
        hooks: ShardingHooks,
        lineage: Lineage,
        observer: Observer,
        progress: Progress,
    ):
        self.config, self.checkpointer, self.hooks = config, checkpointer, hooks
        self.lineage, self.observer, self.progress = lineage, observer, progress
        self.data_states: list[Any] | None = None  # the data position a restore read, for the next train()
        self.resumed = False  # resumed (or restored) in this Trainer's life: resume="auto" does nothing more

    def resume_auto(self, recovery: Recovery, restore: Callable[[int], Any]) -> bool:
        """With ``config.resume="auto"``, once in a Trainer's life: a restart's snapshots, else the newest
        checkpoint that reads (with ``restore(step)``); True when the state came from snapshots."""
        if self.config.resume != "auto" or self.resumed or self.checkpointer is None:
            return False
        self.resumed, got = True, recovery.resume_auto(restore)
        if got is not None:
            self.data_states = got.data_states
        return got is not None

    def require(self, what: str) -> Checkpointer:
        if self.checkpointer is None:
            raise ConfigError(f"no workdir in the config: set config.workdir to {what} checkpoints.")
        return self.checkpointer

    def save(
        self, states: dict[str, Any], mesh: Mesh, *, wrt: Any, batches: Any, metrics: Any, force: bool
    ) -> bool:
        """Saves ``states`` at the progress's step: without the frozen base unless ``save_frozen``, with the
        data position, and a ``save`` or ``save_skipped`` event; the lineage told first and after."""
        checkpointer, step, config = self.require("save"), self.progress.step, self.config
        self.lineage.before_save()
        extra = {}
        if batches is not None and batches.resumable:
            extra["data_state"] = gather_states(batches.state())
        start, strategy = time.perf_counter(), list(config.sharding_strategy)
        to_save = states_to_save(states, wrt, config.save_frozen, extra)
        if not checkpointer.save(
            step, to_save, metrics=metrics, mesh=mesh, strategy=strategy, extra=extra, force=force
        ):
            reason = checkpointer.last_skip_reason or "not written"
            self.observer.event("save_skipped", 0.0, step, reason=reason)
            return False
        self.lineage.saved(step)
        self.observer.event(
            "save", time.perf_counter() - start, step, **({"metrics": metrics} if metrics else {})
        )
        return True

    def restore(
        self, source: Any, step: int | None, options: Any, keywords: dict[str, Any], *, wrt: Any
    ) -> RestoreReport:
        """Restores ``source`` (None: this Trainer's checkpoints, whose step, lineage and data position are
        then taken) through the hooks, as :meth:`nnx_shard.Trainer.restore_and_reshard` describes."""
        start, own = time.perf_counter(), source is None
        checkpointer = self.checkpointer if own else None
        if checkpointer is not None and step is None:  # several processes: the newest all list, agreed once
            step = newest_listed(checkpointer)
        model = self.hooks.states()[MODEL]
        opts = trainer_options(self.config, checkpointer, step, model, wrt, options, keywords)
        report = self.hooks.restore_and_reshard(checkpointer if own else source, step=step, options=opts)
        if own:
            self.progress.step, self.resumed = report.step, True
            self.data_states = report.saved.get("data_state")
            self.lineage.restored(report.step)
        self.observer.event("restore", time.perf_counter() - start, self.progress.step, report=str(report))
        return report
