"""Sharding tactics: replicate, fsdp, shard_dim, spec, annotated, chained with ``|``.

A tactic is a callable ``(cur_spec, mesh, name, leaf) -> spec`` where a spec is a tuple with one entry per
dimension (``None``, an axis name, or a tuple of axis names); a tactic with something to say (why a leaf
stayed replicated) returns ``Noted(spec, notes)`` instead, and planning keeps the notes. Tactics chain with
``|``; the next one starts from the spec the previous one returned. Strings name tactics through the parser
and registry in :mod:`nnx_shard._sharding._parser`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh

from nnx_shard._base import (
    WHOLE,
    Leaf,
    Spec,
    SpecEntry,
    entry_size,
    finalize_spec,
    format_spec,
    normalize_spec,
    spec_axes,
    spec_problems,
    trim_spec,
)
from nnx_shard._sharding._notes import Note, Noted, NoteKind, noted, split_noted
from nnx_shard.errors import (
    IndivisibleShardingError,
    MeshAxisError,
    ShardingConflictError,
    TacticArgumentError,
)

AxisArg = str | Sequence[str]


def _axes(axis: AxisArg, tactic: str) -> tuple[str, ...]:
    if isinstance(axis, str):
        return (axis,)
    if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, str) for a in axis):
        return tuple(axis)
    raise TacticArgumentError(f"{tactic}(axis=...) takes a mesh axis name or a tuple of names; got {axis!r}.")


def _entry(axes: tuple[str, ...]) -> SpecEntry:
    return axes[0] if len(axes) == 1 else axes


def check_axes(axes: Sequence[str], mesh: Mesh, leaf: Leaf, tactic: str) -> None:
    """Raises MeshAxisError for axes the mesh lacks."""
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise MeshAxisError(
            f"cannot place {leaf.describe()} with {tactic}: mesh axis {missing[0]!r} is not "
            f"in the mesh, whose axes are {tuple(mesh.axis_names)}. Use one of those names."
        )


def sharded(entry: Any) -> bool:
    """True for a spec entry that names mesh axes (not None, not a dimension kept whole)."""
    return entry is not None and entry is not WHOLE


def _check_unused(axes: Sequence[str], cur: Spec, leaf: Leaf, tactic: str) -> None:
    used = set(spec_axes(cur))
    twice = [a for a in axes if a in used]
    if twice:
        raise ShardingConflictError(
            f"cannot use mesh axis {twice[0]!r} again on {leaf.describe()} with {tactic}: "
            f"it is already {format_spec(cur)}. A mesh axis may shard one dimension only; "
            f"drop one tactic or use another axis."
        )


class Tactic:
    """Base class of tactics: callable ``(cur_spec, mesh, name, leaf) -> spec``, chained with ``|``.

    A tactic returns the new spec, or :class:`Noted` ``(spec, notes)`` to say why (the plan shows them).

    >>> str(fsdp(axis="fsdp") | shard_dim(axis="tp", dim=-1))
    "fsdp(axis='fsdp')|shard_dim(axis='tp', dim=-1)"
    """

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        raise NotImplementedError

    def __or__(self, other: Any) -> Chain:
        return Chain((self, _chainable(other)))

    def __ror__(self, other: Any) -> Chain:
        return Chain((_chainable(other), self))

    def __repr__(self) -> str:
        return str(self)


def _chainable(other: Any) -> Tactic:
    if isinstance(other, Tactic):
        return other
    if callable(other) and not isinstance(other, str):
        return FunctionTactic(other)
    raise TacticArgumentError(
        f"cannot chain {other!r} with |; chain Tactic objects (ns.sharding.fsdp('fsdp') | "
        "ns.sharding.replicate()), "
        f"or write the whole chain as one string for nnx_shard.parse_tactic."
    )


class Chain(Tactic):
    """Tactics applied one after the other to the same leaf."""

    def __init__(self, tactics: Sequence[Tactic]):
        flat: list[Tactic] = []
        for t in tactics:
            flat.extend(t.tactics if isinstance(t, Chain) else (t,))
        self.tactics = tuple(flat)

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Any:
        notes: tuple[Note, ...] = ()
        for t in self.tactics:
            result = t(cur_spec, mesh, name, leaf)
            if isinstance(result, Noted):  # inline, not split_noted: this runs for every leaf of a plan
                notes, result = notes + result.notes, result.spec
            cur_spec = normalize_spec(result, leaf.ndim, leaf.describe())
        return Noted(cur_spec, notes) if notes else cur_spec

    def __str__(self) -> str:
        return "|".join(str(t) for t in self.tactics)


class _Replicate(Tactic):
    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        if any(sharded(e) for e in cur_spec):
            raise ShardingConflictError(
                f"cannot replicate {leaf.describe()}: it is already {format_spec(cur_spec)}. "
                f"Put the more specific rule first, or drop one tactic."
            )
        return cur_spec

    def __str__(self) -> str:
        return "replicate()"


def replicate() -> Tactic:
    """Keeps a leaf whole on every device; refuses a leaf an earlier tactic sharded.

    >>> replicate()((None, None), None, "w", None)
    (None, None)
    """
    return _Replicate()


class _Fsdp(Tactic):
    def __init__(self, axis: AxisArg, min_size_to_shard_mb: float):
        self.axes = _axes(axis, "fsdp")
        if not isinstance(min_size_to_shard_mb, (int, float)) or min_size_to_shard_mb < 0:
            raise TacticArgumentError(
                f"fsdp(min_size_to_shard_mb=...) takes a number >= 0; got {min_size_to_shard_mb!r}."
            )
        self.min_size_to_shard_mb = min_size_to_shard_mb

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        check_axes(self.axes, mesh, leaf, str(self))
        # A step that would shard nothing never conflicts (as in big_vision).
        if leaf.nbytes <= self.min_size_to_shard_mb * 2**20:
            minimum = self.min_size_to_shard_mb
            why = f"fsdp: replicated, {leaf.nbytes} bytes is below min_size_to_shard_mb={minimum}"
            return Noted(cur_spec, (Note(NoteKind.BELOW_MIN_SIZE, why),))
        size = entry_size(mesh.shape, self.axes)
        # Largest dimension first; among equal sizes the last one (the output
        # features of a kernel), as big_vision does. Dimensions kept whole are skipped.
        for i in sorted(range(leaf.ndim), key=lambda i: (leaf.shape[i], i), reverse=True):
            if cur_spec[i] is None and leaf.shape[i] % size == 0:
                _check_unused(self.axes, cur_spec, leaf, str(self))
                return cur_spec[:i] + (_entry(self.axes),) + cur_spec[i + 1 :]
        axes = "x".join(self.axes)
        why = f"fsdp: replicated, no free dimension of {leaf.shape} is divisible by {axes}={size}"
        return Noted(cur_spec, (Note(NoteKind.NO_DIVISIBLE_DIM, why),))

    def __str__(self) -> str:
        axis = self.axes[0] if len(self.axes) == 1 else self.axes
        extra = (
            "" if self.min_size_to_shard_mb == 4 else f", min_size_to_shard_mb={self.min_size_to_shard_mb}"
        )
        return f"fsdp(axis={axis!r}{extra})"


def fsdp(axis: AxisArg, min_size_to_shard_mb: float = 4) -> Tactic:
    """Shards the largest free dimension divisible by the size of ``axis``.

    Leaves of at most ``min_size_to_shard_mb`` MiB, and leaves with no such
    dimension, stay replicated; the plan notes why.

    Args:
      axis: a mesh axis name, or a tuple of names sharding one dimension together.
      min_size_to_shard_mb: leaves this small or smaller are not sharded.

    >>> from nnx_shard import create_mesh
    >>> from nnx_shard.sharding import Leaf
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> leaf = Leaf("w", (1024, 4096), "float32")
    >>> fsdp("fsdp")((None, None), mesh, "w", leaf)
    (None, 'fsdp')
    """
    return _Fsdp(axis, min_size_to_shard_mb)


def _dim(dim: Any, tactic: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TacticArgumentError(f"{tactic}(dim=...) takes an integer; got {dim!r}.")
    return dim


class _ShardDim(Tactic):
    def __init__(self, axis: AxisArg, dim: int, ignore_ndim_error: bool = False):
        self.axes = _axes(axis, "shard_dim")
        self.dim = _dim(dim, "shard_dim")
        self.ignore_ndim_error = bool(ignore_ndim_error)

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        check_axes(self.axes, mesh, leaf, str(self))
        if not -leaf.ndim <= self.dim < leaf.ndim:
            if self.ignore_ndim_error:
                why = f"shard_dim: skipped, dim {self.dim} is not among its {leaf.ndim} dimensions"
                return Noted(cur_spec, (Note(NoteKind.SKIPPED, why),))
            raise TacticArgumentError(
                f"cannot shard dim {self.dim} of {leaf.describe()}: it has {leaf.ndim} "
                f"dimensions. Use a dim in [{-leaf.ndim}, {leaf.ndim - 1}], a narrower regex, "
                f"or ignore_ndim_error=True (big_vision) to skip such leaves."
            )
        i = self.dim % leaf.ndim
        if cur_spec[i] is WHOLE:
            raise ShardingConflictError(
                f"cannot shard dim {self.dim} of {leaf.describe()}: it is kept whole (a stacked layer "
                f"axis, or marked by stacked()). Shard another dimension."
            )
        if cur_spec[i] is not None:
            raise ShardingConflictError(
                f"cannot shard dim {self.dim} of {leaf.describe()}: it is already "
                f"{format_spec(cur_spec)}. Put the more specific rule first, or drop one tactic."
            )
        _check_unused(self.axes, cur_spec, leaf, str(self))
        size = entry_size(mesh.shape, self.axes)
        if leaf.shape[i] % size:
            raise IndivisibleShardingError(
                f"cannot shard dim {self.dim} of {leaf.describe()} over "
                f"{'x'.join(self.axes)}={size}: {leaf.shape[i]} is not divisible by {size}. "
                f"Pick another dim or axis, or use fsdp() which skips indivisible dims."
            )
        return cur_spec[:i] + (_entry(self.axes),) + cur_spec[i + 1 :]

    def __str__(self) -> str:
        axis = self.axes[0] if len(self.axes) == 1 else self.axes
        extra = ", ignore_ndim_error=True" if self.ignore_ndim_error else ""
        return f"shard_dim(axis={axis!r}, dim={self.dim}{extra})"


def shard_dim(axis: AxisArg, dim: int, ignore_ndim_error: bool = False) -> Tactic:
    """Shards dimension ``dim`` (negative counts from the end) over ``axis``; raises if it cannot.

    With ``ignore_ndim_error=True`` (as in big_vision), a leaf without that
    dimension is left as it is, with a note in the plan.

    >>> from nnx_shard import create_mesh
    >>> from nnx_shard.sharding import Leaf
    >>> mesh = create_mesh((2, 4), ("dp", "tp"))
    >>> shard_dim("tp", -1)((None, None), mesh, "w", Leaf("w", (6, 8), "float32"))
    (None, 'tp')
    """
    return _ShardDim(axis, dim, ignore_ndim_error)


class _Stacked(Tactic):
    def __init__(self, dim: int):
        self.dim = _dim(dim, "stacked")

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        if not -leaf.ndim <= self.dim < leaf.ndim:
            raise TacticArgumentError(
                f"cannot keep dim {self.dim} of {leaf.describe()} whole: it has {leaf.ndim} dimensions."
            )
        i = self.dim % leaf.ndim
        if sharded(cur_spec[i]):
            raise ShardingConflictError(
                f"cannot keep dim {self.dim} of {leaf.describe()} whole: it is already "
                f"{format_spec(cur_spec)}. Put stacked() first in the chain."
            )
        return cur_spec[:i] + (WHOLE,) + cur_spec[i + 1 :]

    def __str__(self) -> str:
        return f"stacked(dim={self.dim})"


def stacked(dim: int = 0) -> Tactic:
    """Keeps dimension ``dim`` whole: the later tactics of the chain leave it unsharded.

    For layers stacked by ``nnx.vmap`` / ``nnx.scan``, whose layer count may
    be the largest dimension: ``"stacked(dim=0)|fsdp(axis='fsdp')"`` shards a
    layer's own dimensions, never the layer axis. Dimensions NNX marks with
    ``transform_metadata={nnx.PARTITION_NAME: 'layers'}`` are kept whole
    without it (see :func:`nnx_shard.infer_sharding`'s ``stacked_axis_names``).

    >>> from nnx_shard import create_mesh

    >>> from nnx_shard.sharding import Leaf
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> leaf = Leaf("blocks/kernel", (16, 8, 8), "float32")
    >>> (stacked(0) | fsdp("fsdp", 0))((None, None, None), mesh, leaf.path, leaf)
    (WHOLE, None, 'fsdp')
    """
    return _Stacked(dim)


def fit_spec(spec: Any, cur_spec: Spec, leaf: Leaf, tactic: str) -> tuple[Spec, list[Note]]:
    """A tactic's full spec fitted to the leaf: longer specs trimmed (and noted), dimensions kept whole
    respected."""
    out, trimmed = trim_spec(spec, leaf.ndim, leaf.describe())
    notes = []
    if trimmed:
        why = f"{tactic}: trimmed {format_spec(tuple(spec))} to the leaf's {leaf.ndim} dimensions"
        notes.append(Note(NoteKind.TRIMMED, why))
    for i, (was, new) in enumerate(zip(cur_spec, out, strict=True)):
        if was is WHOLE and sharded(new):
            raise ShardingConflictError(
                f"cannot set {format_spec(out)} on {leaf.describe()}: dim {i} is kept whole (a "
                f"stacked layer axis, or marked by stacked()). Leave it None."
            )
    return tuple(WHOLE if was is WHOLE else new for was, new in zip(cur_spec, out, strict=True)), notes


class _Spec(Tactic):
    def __init__(self, entries: Sequence[Any]):
        self.entries = normalize_spec(entries, len(entries), "spec()")

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        if any(sharded(e) for e in cur_spec):
            raise ShardingConflictError(
                f"cannot set {format_spec(self.entries)} on {leaf.describe()}: it is already "
                f"{format_spec(cur_spec)}. spec() sets the whole spec: put it alone or first."
            )
        spec, notes = fit_spec(self.entries, cur_spec, leaf, str(self))
        return noted(validate_spec(spec, mesh, leaf, str(self)), notes)

    def __str__(self) -> str:
        return "spec(" + ", ".join(repr(e) for e in self.entries) + ")"


def spec(*entries: SpecEntry) -> Tactic:
    """Sets an explicit PartitionSpec (missing trailing entries are None).

    >>> from nnx_shard import create_mesh
    >>> from nnx_shard.sharding import Leaf
    >>> mesh = create_mesh((2, 4), ("dp", "tp"))
    >>> spec("tp")((None, None), mesh, "w", Leaf("w", (8, 3), "float32"))
    ('tp', None)
    """
    return _Spec(entries)


def validate_spec(spec_: Spec, mesh: Mesh, leaf: Leaf, tactic: str) -> Spec:
    """Checks a complete spec against the mesh and the leaf; returns it unchanged.

    Raises:
      MeshAxisError: an axis not in the mesh.
      ShardingConflictError: a mesh axis used twice.
      IndivisibleShardingError: a dimension not divisible by its shards.
    """
    for p in spec_problems(spec_, leaf.shape, mesh.shape):
        if p.kind == "axis":
            raise MeshAxisError(
                f"cannot place {leaf.describe()} with {tactic}: mesh axis {p.axis!r} is not "
                f"in the mesh, whose axes are {tuple(mesh.axis_names)}. Use one of those names."
            )
        if p.kind == "twice":
            raise ShardingConflictError(
                f"gives {leaf.describe()} the spec {format_spec(spec_)}, which uses mesh axis "
                f"{p.axis!r} twice. A mesh axis may shard one dimension only."
            )
        if p.kind == "indivisible":
            raise IndivisibleShardingError(
                f"cannot shard dim {p.dim} of {leaf.describe()} as {format_spec(spec_)}: "
                f"{p.size} is not divisible by {p.shards}. Pick another dim or axis."
            )
    return spec_


class FunctionTactic(Tactic):
    """A user's plain callable ``(cur_spec, mesh, name, leaf) -> spec`` as a Tactic."""

    def __init__(self, fn: Callable[..., Any], text: str | None = None):
        self.fn = fn
        self.text = text or getattr(fn, "__name__", repr(fn))

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Any:
        given, said = split_noted(self.fn(finalize_spec(cur_spec), mesh, name, leaf))
        out, notes = fit_spec(given, cur_spec, leaf, self.text)
        return noted(validate_spec(out, mesh, leaf, self.text), [*said, *notes])

    def __str__(self) -> str:
        return self.text
