"""Where a restore reads from: the :class:`Source` protocol and the registry that resolves what a user passes.

Every restore reads through one :class:`Source`. Each kind lives in its own module and registers itself
here: nnx_shard's checkpoints (``_source_checkpoint``), plain Orbax in each layout (``_source_orbax``),
in-memory snapshots (``_source_snapshots``), state a user loaded (``_source_loaded``) and safetensors
folders (``_source_safetensors``). :func:`as_source` asks each registered kind in turn whether it takes the
object; the first that does builds the source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

from nnx_shard._checkpoint._restore_options import RestoreOptions
from nnx_shard.errors import CheckpointFormatError


@dataclasses.dataclass
class ReadRequest:
    """What a restore asks of its source: the step, what to read into, and the options.

    Attributes:
      step: the step asked for (None: the newest the source has).
      target: the abstract state to read, per object (``jax.ShapeDtypeStruct`` leaves carrying the shardings).
      expected: the structure the source must hold per object (``target`` before ``ema_as_model`` moved it).
      live: the live states of every object (read only; freed after :meth:`Source.prepare` with
        ``free_live``).
      options: the restore's options.
    """

    step: int | None
    target: dict[str, Any]
    expected: dict[str, Any]
    live: dict[str, Any]
    options: RestoreOptions


@runtime_checkable
class Source(Protocol):
    """A place a restore reads from. ``prepare`` checks (nothing live is freed before it returns), ``read``
    reads; then ``step`` is the step read (None where the source has no steps).

    ``objects(live)`` names the objects a restore reads by default (all live ones, or those the source holds);
    ``describe()`` is None for nnx_shard's checkpoints, else what the report says was read, with
    ``note`` after it; ``collective`` is True where every process of the mesh takes part in the read.
    """

    step: int | None
    collective: bool
    note: str

    def objects(self, live: list[str]) -> list[str]: ...

    def prepare(self, request: ReadRequest) -> None: ...

    def read(self, request: ReadRequest) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def describe(self) -> str | None: ...

    def complete(self, restored: list[str]) -> bool: ...


class SourceDefaults:
    """The members most sources share: read by one process each (not collective), no note, no steps, the
    objects it is asked for, nothing to check before the read, everything it holds read."""

    collective = False
    note = ""
    step: int | None = None

    def objects(self, live: list[str]) -> list[str]:
        return live

    def prepare(self, request: ReadRequest) -> None:
        return None

    def complete(self, restored: list[str]) -> bool:
        return True


def target_shardings(target: dict[str, Any]) -> dict[str, Any]:
    """The shardings of a request's target, per object (what a source places host or device data onto)."""
    return {name: jax.tree.map(lambda x: x.sharding, tree) for name, tree in target.items()}


Matcher = Callable[[Any], bool]
Maker = Callable[[Any, RestoreOptions], Source]
_REGISTRY: list[tuple[str, Matcher, Maker]] = []


def register_source(name: str, matches: Matcher, make: Maker, *, before: str | None = None) -> None:
    """Adds a kind of source: ``matches(obj)`` says whether it takes ``obj``, ``make(obj, options)`` builds
    it.

    Kinds are asked in the order registered (``before`` puts this one ahead of the kind of that name); a
    name registered again replaces its entry.
    """
    global _REGISTRY
    _REGISTRY = [entry for entry in _REGISTRY if entry[0] != name]
    at = next((k for k, entry in enumerate(_REGISTRY) if entry[0] == before), len(_REGISTRY))
    _REGISTRY.insert(at, (name, matches, make))


def unregister_source(name: str) -> None:
    """Removes the kind of source registered as ``name`` (nothing when there is none)."""
    global _REGISTRY
    _REGISTRY = [entry for entry in _REGISTRY if entry[0] != name]


def registered() -> list[str]:
    """The names of the registered kinds of source, in the order they are asked."""
    return [name for name, _, _ in _REGISTRY]


def as_source(obj: Any, options: RestoreOptions) -> Source:
    """The source that reads ``obj``: a :class:`Source` itself, else the first registered kind that takes it.

    Raises:
      CheckpointFormatError: no kind takes ``obj``, or the options do not apply to the kind that does.
    """
    if isinstance(obj, Source):
        return obj
    for _, matches, make in _REGISTRY:
        if matches(obj):
            return make(obj, options)
    raise CheckpointFormatError(
        f"cannot restore from {type(obj).__name__} {obj!r:.80}; a restore reads a Checkpointer, a checkpoint "
        f"directory (nnx_shard's or plain Orbax's), a safetensors folder, a mapping of loaded states, or a "
        f"Source (kinds: {', '.join(registered())})."
    )
