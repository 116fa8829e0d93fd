"""A restore onto given shardings: live states and options in, restored states and a report out."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from nnx_shard._base import check_every_process_in, describe_mesh
from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._faults import quiet
from nnx_shard._checkpoint._format import abstract_target
from nnx_shard._checkpoint._plain import plain_source
from nnx_shard.errors import CheckpointError, ConflictingArgumentsError

logger = logging.getLogger("nnx_shard")


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """How a restore reads, built once from the public arguments and passed down unchanged.

    Attributes:
      items: the objects to restore (None: all the hooks own).
      item: for a plain Orbax checkpoint, the name of its item to read.
      ema_as_model: load the checkpoint's EMA parameters into the model's.
      free_live: free the live arrays being restored before the read.
      max_host_bytes: the host memory the read may hold at once; None is no limit
        (``0``, as ``config.max_host_bytes`` spells it, becomes None here).
      frozen: an nnx filter of model parameters the checkpoint does not hold.

    >>> RestoreOptions(items=["model"], max_host_bytes=0)
    RestoreOptions(items=('model',), item=None, ema_as_model=False, free_live=False, max_host_bytes=None, frozen=None)
    """

    items: tuple[str, ...] | None = None
    item: str | None = None
    ema_as_model: bool = False
    free_live: bool = False
    max_host_bytes: int | None = None
    frozen: Any = None

    def __post_init__(self) -> None:
        if self.items is not None:
            object.__setattr__(self, "items", tuple(self.items))
        if self.max_host_bytes is not None:
            if not isinstance(self.max_host_bytes, int) or self.max_host_bytes < 0:
                raise CheckpointError(
                    f"max_host_bytes is a whole number of bytes >= 0 (0 or None: no limit); got {self.max_host_bytes!r}."
                )
            object.__setattr__(self, "max_host_bytes", self.max_host_bytes or None)

    @classmethod
    def given(cls, options: RestoreOptions | None, **arguments: Any) -> RestoreOptions:
        """``options`` when given, else one built from ``arguments``; both at once raise, nothing is dropped.

        >>> RestoreOptions.given(None, items=["model"]).items
        ('model',)
        >>> RestoreOptions.given(RestoreOptions(), free_live=True)
        Traceback (most recent call last):
        ...
        nnx_shard.errors.ConflictingArgumentsError: options= was given together with free_live=True...
        """
        if options is None:
            return cls(**arguments)
        clash = {k: v for k, v in arguments.items() if v is not None and v is not False}  # every default
        if clash:
            shown = ", ".join(f"{k}={v!r}" for k, v in clash.items())
            raise ConflictingArgumentsError(
                f"options= was given together with {shown}; give one or the other: put them in the options "
                f"(dataclasses.replace(options, {next(iter(clash))}=...)), or leave options= out."
            )
        return options


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """What a restore did: which step, from where, onto what.

    >>> print(RestoreReport(300, {"devices": 8, "mesh": "fsdp=8", "processes": 1}, 4, 1, "fsdp=4"))
    restored step 300, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)"""

    step: int | None
    saved: dict[str, Any]
    devices: int
    processes: int
    mesh: str
    items: tuple[str, ...] | None = None
    ema_as_model: bool = False
    plain: str | None = None  # the items read from a checkpoint written by plain Orbax

    def __str__(self) -> str:
        show = self.saved.get("processes", 1) != 1 or self.processes != 1
        saved = _where(
            self.saved.get("devices", 0), self.saved.get("mesh", "?"), self.saved.get("processes", 1), show
        )
        onto = _where(self.devices, self.mesh, self.processes, show)
        if self.plain is not None:
            step = "" if self.step is None else f"step {self.step}, "
            return (
                f"restored {step}{self.plain} of a plain Orbax checkpoint onto {onto}; "
                f"it carries no fingerprints, so its content was not verified"
            )
        what = f"step {self.step}"
        if self.items is not None:
            extra = "; the EMA parameters as the model" if self.ema_as_model else ""
            what += f" ({', '.join(self.items)} only{extra})"
        return f"restored {what}, saved on {saved}, onto {onto}"


def _where(devices: int, mesh: str, processes: int, show_processes: bool) -> str:
    """``8 devices (fsdp=8)``, ``1 device``, ``4 devices (fsdp=4) in 2 processes``."""
    text = f"{devices} device{'s' if devices != 1 else ''}" + (f" ({mesh})" if devices != 1 else "")
    if show_processes:
        text += f" in {processes} process{'es' if processes != 1 else ''}"
    return text


def check_placed(states: Any, shardings: Any) -> None:
    """Refuses a restore that did not land exactly on the target (never keep an old device subset)."""
    targets, treedef = jax.tree_util.tree_flatten(shardings, is_leaf=lambda v: v is None)
    for target, sub in zip(targets, treedef.flatten_up_to(states), strict=True):
        for x in jax.tree.leaves(sub):
            if (
                target is not None
                and isinstance(x, jax.Array)
                and not x.sharding.is_equivalent_to(target, x.ndim)
            ):
                raise CheckpointError(f"a restored array landed on {x.sharding}, not on the target {target}.")


def restore_names(objects: Sequence[str], items: Sequence[str] | None, ema_as_model: bool) -> list[str]:
    """The objects a restore reads: ``items`` (default all), checked; the EMA not read with ``ema_as_model``."""
    names = list(objects) if items is None else list(items)
    unknown = sorted(set(names) - set(objects))
    if unknown:
        raise CheckpointError(
            f"items {unknown} are not among the objects {sorted(objects)}; restore some of those."
        )
    if ema_as_model and "model" not in names:
        raise CheckpointError(
            "ema_as_model=True loads EMA parameters into the 'model' object; include 'model' in items."
        )
    return [n for n in names if n != "ema"] if ema_as_model else names


def _targets(
    states: dict[str, Any], shardings: Mapping[str, Any], names: list[str], opts: RestoreOptions
) -> tuple[Any, Any, Any]:
    """What to read into, the structure the checkpoint must have, and the frozen part kept (``states`` trimmed)."""
    target = {k: abstract_target(states[k], shardings[k]) for k in names}
    kept = None
    if opts.frozen is not None and "model" in target:  # the frozen part stays as it is, never read
        kept, states["model"] = nnx.split_state(states["model"], opts.frozen, ...)
        target["model"] = nnx.split_state(target["model"], opts.frozen, ...)[1]
    expected = dict(target)
    if opts.ema_as_model:  # read the model's parameters from the EMA, its other state from the model
        params, rest = nnx.split_state(target["model"], nnx.Param, ...)
        if jax.tree.leaves(rest):
            target["model"] = rest
        else:  # a model of parameters only: nothing of it is read (an empty item is not a tree Orbax reads)
            del target["model"]
        target["ema"] = expected["ema"] = nnx.State({"params": params})
    return target, expected, kept


def restore_onto(
    checkpointer: Checkpointer | str | os.PathLike[str],
    states: Mapping[str, Any],
    shardings: Mapping[str, Any],
    mesh: Mesh,
    *,
    step: int | None = None,
    options: RestoreOptions | None = None,
) -> tuple[dict[str, Any], RestoreReport]:
    """Reads ``step`` (default: the latest) of a checkpoint straight into ``shardings``; owns nothing.

    ``states`` are the live states of every object (``{"model": State, ...}``),
    ``shardings`` their targets on ``mesh``. Returns the restored states of the
    objects read (``options.items``, default all) and a :class:`RestoreReport`.
    A failed restore changes nothing live unless ``options.free_live`` freed it.
    """
    opts = options or RestoreOptions()
    check_every_process_in(  # Orbax reads an array only onto devices of every process
        mesh,
        "a restore",
        "Restore onto a mesh with a device on every process, then move the state with "
        "Trainer.resize(mesh) or ShardingHooks.on_mesh_change(mesh), which may leave processes out.",
    )
    states = dict(states)
    names = restore_names(list(states), opts.items, opts.ema_as_model)
    target, expected, kept = _targets(states, shardings, names, opts)
    with quiet():  # one quiet block for the whole restore: the reads inside share its cleanup
        plain = plain_source(checkpointer, opts.item, opts.ema_as_model)
        if plain is not None:  # checked before anything live is freed
            plain.prepare(step, target, opts.item)
        else:
            checkpointer = (
                checkpointer if isinstance(checkpointer, Checkpointer) else Checkpointer(checkpointer)
            )
            step = checkpointer.validate(step, expected, items=sorted(expected))
            if opts.free_live:
                checkpointer.metadata(step)  # readable, before anything live is freed
        if opts.free_live:
            for x in jax.tree.leaves({k: states[k] for k in names}):
                if isinstance(x, jax.Array):
                    x.delete()
        try:
            if plain is not None:
                restored, saved = plain.read(target, opts.max_host_bytes), {}
            else:
                restored, saved = checkpointer.read(
                    step, target, partial=True, max_host_bytes=opts.max_host_bytes
                )
        except CheckpointError:
            if opts.free_live:
                logger.error(
                    "restore of step %s failed after the live state was freed (free_live=True)", step
                )
            raise
    restored = dict(restored)
    if kept is not None:
        restored["model"] = nnx.merge_state(restored["model"], kept)
    if opts.ema_as_model:
        params = restored.pop("ema")["params"]
        restored["model"] = nnx.merge_state(restored["model"], params) if "model" in restored else params
    check_placed(restored, {k: shardings[k] for k in restored})
    partial = plain is None and (sorted(restored) != checkpointer.items(step) or opts.ema_as_model)
    report = RestoreReport(
        step=plain.step if plain is not None else step,
        saved=saved,
        devices=int(mesh.devices.size),
        processes=jax.process_count(),
        mesh=describe_mesh(mesh),
        items=tuple(sorted(restored)) if partial else None,
        ema_as_model=opts.ema_as_model,
        plain=plain.describe() if plain is not None else None,
    )
    return restored, report
