"""The one options type every restore takes, and the report every restore returns."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from nnx_shard.errors import CheckpointError, ConflictingArgumentsError

# the old names of restore arguments, which still work with a DeprecationWarning (see CHANGELOG)
RENAMED = {"items": "only", "item": "orbax_item"}


def renamed(arguments: dict[str, Any], where: str) -> dict[str, Any]:
    """``arguments`` with the old names (``items``, ``item``) moved to the new ones, each with a warning."""
    out = dict(arguments)
    for old, new in RENAMED.items():
        if out.get(old) is None:
            out.pop(old, None)
            continue
        if out.get(new) is not None:
            raise ConflictingArgumentsError(
                f"{where} got both {old}= and {new}=; {old}= is the old name of {new}=."
            )
        warnings.warn(
            f"{where}: {old}= is now {new}= (items= and item= differed by one letter and meant different "
            f"things); the old name goes away in a later release.",
            DeprecationWarning,
            stacklevel=3,
        )
        out[new] = out.pop(old)
    return out


@dataclasses.dataclass(frozen=True, init=False)
class RestoreOptions:
    """How a restore reads, built once from the public arguments and passed down unchanged.

    Every restore (:func:`nnx_shard.restore_and_reshard`, :meth:`ShardingHooks.restore_and_reshard`,
    :meth:`Trainer.restore_and_reshard`) takes these, as keywords or as one ``options=``.

    Attributes:
      only: restore only these objects (None: all); the source's others are not read.
      orbax_item: for a plain Orbax checkpoint, the name of its item to read.
      ema_as_model: load the checkpoint's EMA parameters into the model's.
      free_live: free the live arrays being restored before the read.
      max_host_bytes: the host memory the read may hold at once; None is no limit
        (``0``, as ``config.max_host_bytes`` spells it, becomes None here).
      frozen: an nnx filter of model parameters the checkpoint does not hold.

    ``items=`` and ``item=`` are the old names of ``only=`` and ``orbax_item=`` (they warn).

    >>> RestoreOptions(only=["model"], max_host_bytes=0)
    RestoreOptions(only=('model',), orbax_item=None, ema_as_model=False, free_live=False, max_host_bytes=None,
    frozen=None)
    """

    only: tuple[str, ...] | None
    orbax_item: str | None
    ema_as_model: bool
    free_live: bool
    max_host_bytes: int | None
    frozen: Any

    def __init__(
        self,
        only: Sequence[str] | None = None,
        orbax_item: str | None = None,
        ema_as_model: bool = False,
        free_live: bool = False,
        max_host_bytes: int | None = None,
        frozen: Any = None,
        *,
        items: Sequence[str] | None = None,
        item: str | None = None,
    ):
        names = renamed(
            {"only": only, "orbax_item": orbax_item, "items": items, "item": item}, "RestoreOptions"
        )
        only, orbax_item = names.get("only"), names.get("orbax_item")
        if isinstance(only, str):
            raise CheckpointError(
                f"only= takes a sequence of object names, e.g. [{only!r}]; got the string {only!r}."
            )
        if max_host_bytes is not None and (not isinstance(max_host_bytes, int) or max_host_bytes < 0):
            raise CheckpointError(
                "max_host_bytes is a whole number of bytes >= 0 (0 or None: no limit); got "
                f"{max_host_bytes!r}."
            )
        for name, value in [
            ("only", None if only is None else tuple(only)),
            ("orbax_item", orbax_item),
            ("ema_as_model", bool(ema_as_model)),
            ("free_live", bool(free_live)),
            ("max_host_bytes", max_host_bytes or None),
            ("frozen", frozen),
        ]:
            object.__setattr__(self, name, value)

    @property
    def items(self) -> tuple[str, ...] | None:
        """The old name of :attr:`only`."""
        warnings.warn("RestoreOptions.items is now RestoreOptions.only.", DeprecationWarning, stacklevel=2)
        return self.only

    @property
    def item(self) -> str | None:
        """The old name of :attr:`orbax_item`."""
        warnings.warn(
            "RestoreOptions.item is now RestoreOptions.orbax_item.", DeprecationWarning, stacklevel=2
        )
        return self.orbax_item

    @classmethod
    def given(cls, options: RestoreOptions | None, **arguments: Any) -> RestoreOptions:
        """``options`` when given, else one built from ``arguments``; both at once raise, nothing is dropped.

        >>> RestoreOptions.given(None, only=["model"]).only
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
    restored step 300, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)
    >>> print(RestoreReport(None, {}, 8, 1, "fsdp=8", source="state loaded in memory"))
    restored state loaded in memory onto 8 devices (fsdp=8)
    """

    step: int | None
    saved: dict[str, Any]
    devices: int
    processes: int
    mesh: str
    only: tuple[str, ...] | None = None  # the objects read, when not all the source holds
    ema_as_model: bool = False
    source: str | None = (
        None  # what was read when not an nnx_shard checkpoint, e.g. "item 'x' of a plain ..."
    )
    note: str = ""  # said after the source, e.g. that it carries no fingerprints

    @property
    def items(self) -> tuple[str, ...] | None:
        """The old name of :attr:`only`."""
        warnings.warn("RestoreReport.items is now RestoreReport.only.", DeprecationWarning, stacklevel=2)
        return self.only

    def __str__(self) -> str:
        show = self.saved.get("processes", 1) != 1 or self.processes != 1
        onto = _where(self.devices, self.mesh, self.processes, show)
        if self.source is not None:
            step = "" if self.step is None else f"step {self.step}, "
            return f"restored {step}{self.source} onto {onto}{self.note}"
        saved = _where(
            self.saved.get("devices", 0), self.saved.get("mesh", "?"), self.saved.get("processes", 1), show
        )
        what = f"step {self.step}"
        if self.only is not None:
            extra = "; the EMA parameters as the model" if self.ema_as_model else ""
            what += f" ({', '.join(self.only)} only{extra})"
        return f"restored {what}, saved on {saved}, onto {onto}{self.note}"


def _where(devices: int, mesh: str, processes: int, show_processes: bool) -> str:
    """``8 devices (fsdp=8)``, ``1 device``, ``4 devices (fsdp=4) in 2 processes``."""
    text = f"{devices} device{'s' if devices != 1 else ''}" + (f" ({mesh})" if devices != 1 else "")
    if show_processes:
        text += f" in {processes} process{'es' if processes != 1 else ''}"
    return text
