"""PartitionSpec algebra: normalise, format, the axes and sizes of entries, bytes per device, validation.

A spec here is a tuple with one entry per dimension: ``None``, a mesh axis
name, or a tuple of axis names sharding that dimension together. Every other
module takes these helpers from here, so each rule exists once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from nnx_shard._base._caches import cached
from nnx_shard.errors import TacticArgumentError

SpecEntry = None | str | tuple[str, ...]
Spec = tuple[SpecEntry, ...]


class _Whole:
    """A dimension a tactic marked as not to be sharded by later tactics in its chain."""

    _instance: _Whole | None = None

    def __new__(cls) -> _Whole:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "WHOLE"

    def __reduce__(self) -> str:
        return "WHOLE"


WHOLE = _Whole()
"""Spec entry for a dimension kept whole: later tactics in a chain must not shard it; it ends as ``None``."""


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one spec entry, in order.

    >>> entry_axes(None), entry_axes("fsdp"), entry_axes(("dp", "fsdp"))
    ((), ('fsdp',), ('dp', 'fsdp'))
    """
    if entry is None or entry is WHOLE:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec: Sequence[Any]) -> list[str]:
    """All mesh axes a spec uses, in order, with repeats.

    >>> spec_axes((None, ("dp", "fsdp"), "tp"))
    ['dp', 'fsdp', 'tp']
    """
    return [a for entry in spec for a in entry_axes(entry)]


def entry_size(axis_sizes: Mapping[str, int], entry: Any) -> int:
    """The number of shards one spec entry cuts a dimension into (axes the mesh lacks count as 1).

    ``axis_sizes`` is ``mesh.shape`` or any mapping of axis name to size.

    >>> entry_size({"dp": 2, "fsdp": 4}, ("dp", "fsdp"))
    8
    """
    return math.prod(axis_sizes.get(a, 1) for a in entry_axes(entry))


def format_spec(spec: Sequence[Any]) -> str:
    """``P(None, 'fsdp')``, the way error messages and plans print a spec.

    >>> format_spec((None, ("dp", "fsdp")))
    "P(None, ('dp', 'fsdp'))"
    """
    return "P(" + ", ".join("None" if e is WHOLE else repr(e) for e in spec) + ")"


def normalize_entry(entry: Any, where: str) -> SpecEntry | _Whole:
    """One entry as None, an axis name, or a tuple of two or more names."""
    if entry is None or entry is WHOLE or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        return tuple(entry) if len(entry) > 1 else (entry[0] if entry else None)
    raise TacticArgumentError(
        f"gives spec entry {entry!r} for {where}; entries are None, an axis name, or a tuple of axis names."
    )


def normalize_spec(spec: Any, ndim: int, where: str = "") -> Spec:
    """A PartitionSpec, tuple or list as a tuple of exactly ``ndim`` entries (missing ones are None).

    Raises:
      TacticArgumentError: more entries than dimensions, or an entry that is
        not None, a name or a tuple of names. Use :func:`trim_spec` to drop
        trailing entries instead.

    >>> normalize_spec(PartitionSpec("fsdp"), 2)
    ('fsdp', None)
    """
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > ndim:
        raise TacticArgumentError(
            f"gives {len(entries)} spec entries {format_spec(entries)} for {where} "
            f"with {ndim} dimensions; give at most {ndim}."
        )
    out = tuple(normalize_entry(e, where) for e in entries)
    return out + (None,) * (ndim - len(out))


def trim_spec(spec: Any, ndim: int, where: str = "") -> tuple[Spec, bool]:
    """Like :func:`normalize_spec`, but drops trailing ``None`` entries beyond ``ndim`` (as eformer does).

    Returns:
      ``(spec, trimmed)``: the spec and whether entries were dropped.

    Raises:
      TacticArgumentError: a dropped entry names a mesh axis (it would be lost silently).

    >>> trim_spec((None, "tp", None, None), 2)
    ((None, 'tp'), True)
    """
    entries = tuple(spec) if spec is not None else ()
    if len(entries) <= ndim:
        return normalize_spec(entries, ndim, where), False
    dropped = entries[ndim:]
    if any(entry_axes(normalize_entry(e, where)) for e in dropped):
        raise TacticArgumentError(
            f"gives {len(entries)} spec entries {format_spec(entries)} for {where} with {ndim} "
            f"dimensions, and the entries beyond dimension {ndim - 1} name mesh axes "
            f"{format_spec(dropped)}; give at most {ndim} entries."
        )
    return normalize_spec(entries[:ndim], ndim, where), True


def finalize_spec(spec: Sequence[Any]) -> Spec:
    """The spec with dimensions marked whole turned into ``None``."""
    return tuple(None if e is WHOLE else e for e in spec)


@cached(maxsize=None)
def _extended_itemsize(dtype: Any) -> int:
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return math.prod(data.shape) * jnp.dtype(data.dtype).itemsize


def is_key(x: Any) -> bool:
    """Whether ``x`` (an array, abstract array or dtype) holds typed PRNG keys: the one test for it.

    >>> is_key(jax.random.key(0)), is_key(jax.random.PRNGKey(0)), is_key(None)
    (True, False, False)
    """
    dtype = (
        x
        if isinstance(x, np.dtype) or (x is not None and not hasattr(x, "dtype"))
        else getattr(x, "dtype", None)
    )
    try:
        return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:  # not a dtype at all
        return False


def itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype, typed PRNG keys included (``key<fry>`` is 8).

    >>> itemsize("bfloat16"), itemsize(jax.random.key(0).dtype), itemsize(None)
    (2, 8, 0)
    """
    if dtype is None:
        return 0
    if is_key(dtype):
        return _extended_itemsize(dtype)
    return int(jnp.dtype(dtype).itemsize)


def shard_shape(sharding: NamedSharding, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the largest shard: ``NamedSharding.shard_shape``, rounding up when a dim does not divide.

    >>> from nnx_shard._base._mesh import create_mesh
    >>> shard_shape(NamedSharding(create_mesh((8,), ("fsdp",)), PartitionSpec("fsdp")), (12, 3))
    (2, 3)
    """
    shape = tuple(shape)
    try:
        return tuple(sharding.shard_shape(shape))
    except ValueError:  # indivisible (only analysis helpers ask): the fullest device rounds up
        spec = normalize_spec(sharding.spec, len(shape))
        return tuple(-(-d // entry_size(sharding.mesh.shape, e)) for d, e in zip(shape, spec, strict=True))


def bytes_per_device(sharding: NamedSharding, shape: Sequence[int], dtype: Any) -> int:
    """Exact bytes on the fullest device of an array of ``shape`` and ``dtype`` placed by ``sharding``."""
    return math.prod(shard_shape(sharding, shape)) * itemsize(dtype)


@dataclasses.dataclass(frozen=True)
class SpecProblem:
    """One way a spec does not fit a shape on a mesh.

    Attributes:
      kind: ``"rank"`` (more entries than dims), ``"axis"`` (not a mesh axis),
        ``"twice"`` (an axis used twice) or ``"indivisible"``.
      spec: the spec checked.
      dim: the dimension concerned (indivisible), else None.
      axis: the axis concerned (axis, twice), or the entry (indivisible).
      size: the dimension's size (indivisible).
      shards: how many shards the entry asks for (indivisible).
    """

    kind: str
    spec: tuple[Any, ...]
    dim: int | None = None
    axis: Any = None
    size: int | None = None
    shards: int | None = None


def spec_problems(
    spec: Sequence[Any], shape: Sequence[int], axis_sizes: Mapping[str, int]
) -> list[SpecProblem]:
    """Every way ``spec`` does not fit ``shape`` on a mesh with ``axis_sizes`` (``mesh.shape``).

    >>> [p.kind for p in spec_problems(("tp", "x"), (6, 8), {"dp": 2, "tp": 4})]
    ['axis', 'indivisible']
    """
    spec = tuple(spec)
    if len(spec) > len(shape):
        return [SpecProblem("rank", spec)]
    problems = []
    axes = spec_axes(spec)
    problems += [SpecProblem("axis", spec, axis=a) for a in dict.fromkeys(axes) if a not in axis_sizes]
    problems += [SpecProblem("twice", spec, axis=a) for a in sorted({a for a in axes if axes.count(a) > 1})]
    for i, entry in enumerate(spec):
        names = entry_axes(entry)
        if not names or any(n not in axis_sizes for n in names):
            continue
        k = entry_size(axis_sizes, entry)
        if shape[i] % k:
            problems.append(SpecProblem("indivisible", spec, dim=i, axis=entry, size=shape[i], shards=k))
    return problems
