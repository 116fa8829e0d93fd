"""NNX state <-> ``encoder/layers/0/mlp/kernel``: the one path flattener, and which parameter a leaf mirrors."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph

from nnx_shard._specs import itemsize

# The first path segment under which a state mirrors the parameters:
# ``nnx.Optimizer`` keeps ``opt_state``, ``nnx.EMA`` keeps ``params``.
MIRROR_ROOTS = frozenset({"opt_state", "params"})


@functools.cache
def optax_state_fields() -> frozenset[str]:
    """The field names of every optax state NamedTuple (``mu``, ``nu``, ``inner_state``...).

    Read from the installed optax, so new optimizers are covered without a list
    to maintain.

    >>> {"mu", "nu", "inner_state"} <= optax_state_fields()
    True
    """
    import optax

    modules = [optax]
    for sub in ("contrib", "transforms", "schedules"):
        try:
            modules.append(getattr(__import__(f"optax.{sub}"), sub))
        except (ImportError, AttributeError):  # pragma: no cover - older optax
            pass
    fields: set[str] = set()
    for module in modules:
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
                fields.update(obj._fields)
    return frozenset(fields | MIRROR_ROOTS)


def is_variable(x: Any) -> bool:
    """True for an ``nnx.Variable`` (the leaves of NNX states)."""
    return isinstance(x, nnx.Variable)


def path_str(keypath: tuple[Any, ...]) -> str:
    """Joins a jax key path with ``/``: ``(DictKey('up'), DictKey('kernel'))`` -> ``'up/kernel'``.

    >>> path_str(jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0][1][0])
    'a/1'
    """
    return jax.tree_util.keystr(keypath, simple=True, separator="/")


def flatten_with_paths(tree: Any, is_leaf: Any = is_variable) -> tuple[list[tuple[str, Any]], Any]:
    """``([(path, leaf), ...], treedef)``: every leaf with its ``/``-joined path, Variables as leaves.

    >>> flatten_with_paths({"w": 1, "b": [2, 3]})[0]
    [('b/0', 2), ('b/1', 3), ('w', 1)]
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(path_str(p), v) for p, v in flat], treedef


def _is_structural(segment: str) -> bool:
    return segment.isdigit() or segment in optax_state_fields()


def mirror_candidates(segments: tuple[str, ...], group_depth: int = 0) -> tuple[str, ...]:
    """The names a strategy rule may also match for a leaf that mirrors a parameter.

    For ``opt_state/1/0/mu/up/kernel`` these are the suffixes left after each
    leading structural segment (chain indices, optax state fields), ending with
    the parameter path ``up/kernel``. For ``params/up/kernel`` in an EMA it is
    ``up/kernel``. When states are grouped (``{'model': ..., 'opt': ...}``),
    ``group_depth`` segments name the group and the path inside it counts too.

    >>> mirror_candidates(("opt_state", "0", "mu", "up", "kernel"))
    ('0/mu/up/kernel', 'mu/up/kernel', 'up/kernel')
    >>> mirror_candidates(("params", "up", "kernel"))
    ('up/kernel',)
    >>> mirror_candidates(("encoder", "layers", "0", "kernel"))
    ()
    """
    rel = segments[group_depth:]
    out: list[str] = ["/".join(rel)] if group_depth and rel else []
    start = 0
    if len(rel) > 1 and rel[1] in MIRROR_ROOTS and rel[0] not in MIRROR_ROOTS:
        start = 1  # a user's own key naming the optimizer / EMA, then its root
    if len(rel) > start + 1 and _is_structural(rel[start]):
        i = start
        while i < len(rel) - 1 and _is_structural(rel[i]):
            i += 1
            out.append("/".join(rel[i:]))
    return tuple(out)


@dataclasses.dataclass
class Leaf:
    """One array of a state, as a tactic sees it: its path, shape and dtype, never its data.

    Attributes:
      path: ``/``-joined path, e.g. ``opt_state/0/mu/up/kernel``.
      shape: the global shape, or None for a leaf without one (masked entries).
      dtype: the dtype, or None.
      variable: the ``nnx.Variable`` holding it, if any (for its metadata).
      candidates: the parameter paths it mirrors, most specific last.
      notes: soft findings about its placement (too small to shard, ...).

    >>> leaf = Leaf("opt_state/0/mu/up/kernel", (16, 32), "bfloat16", candidates=("up/kernel",))
    >>> leaf.nbytes, leaf.mirrors, leaf.describe()
    (1024, 'up/kernel', "'opt_state/0/mu/up/kernel' (shape (16, 32))")
    """

    path: str
    shape: tuple[int, ...] | None
    dtype: Any
    variable: Any = None
    candidates: tuple[str, ...] = ()
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ndim(self) -> int:
        return len(self.shape or ())

    @property
    def size(self) -> int:
        return math.prod(self.shape or ())

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize if self.shape is not None else 0

    @property
    def value(self) -> jax.ShapeDtypeStruct | None:
        """An abstract array, so seed-style tactics can read ``leaf.value.shape``."""
        if self.shape is None:
            return None
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    @property
    def mirrors(self) -> str | None:
        """The parameter path this leaf mirrors (optimizer or EMA), if any."""
        return self.candidates[-1] if self.candidates else None

    def describe(self) -> str:
        """``'up/kernel' (shape (16, 32))``, for error messages."""
        return f"{self.path!r} (shape {self.shape})"


def abstract_of(value: Any) -> tuple[tuple[int, ...], Any] | None:
    """Shape and dtype of an array, abstract array or Python number; None if it has none."""
    if isinstance(value, nnx.Variable):
        value = value.get_value()
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return tuple(int(d) for d in shape), dtype
    if isinstance(value, (bool, int, float, complex, np.number)):
        return (), np.result_type(value)
    return None


def is_graph_object(x: Any) -> bool:
    """True for Modules, ``nnx.Optimizer``, ``nnx.EMA`` and other NNX graph nodes."""
    return not isinstance(x, nnx.State) and nnx_graph.is_graph_node(x)


def as_state(tree: Any) -> tuple[Any, int]:
    """Turns Modules into ``nnx.State`` and says how many path segments name a group.

    A Module, Optimizer or EMA becomes its ``nnx.state``; a dict, list or tuple
    of them becomes the same container of states, whose keys name groups.
    """
    if is_graph_object(tree):
        return nnx.state(tree), 0
    if type(tree) in (dict, list, tuple) and tree:
        values = tree.values() if isinstance(tree, dict) else tree
        if any(is_graph_object(v) or isinstance(v, nnx.State) for v in values):
            conv = lambda v: nnx.state(v) if is_graph_object(v) else v
            if isinstance(tree, dict):
                return {k: conv(v) for k, v in tree.items()}, 1
            return type(tree)(conv(v) for v in tree), 1
    return tree, 0


def flatten_leaves(tree: Any) -> tuple[list[Leaf], Any]:
    """Flattens a state, Module or pytree into :class:`Leaf` records and a treedef.

    The treedef has one leaf per ``nnx.Variable`` (or per array of a plain
    pytree), so ``jax.tree_util.tree_unflatten(treedef, values)`` builds a tree
    of the same structure holding ``values``.
    """
    state, group_depth = as_state(tree)
    flat, treedef = flatten_with_paths(state)
    leaves = []
    for path, value in flat:
        segments = tuple(path.split("/")) if path else ()
        abstract = abstract_of(value)
        shape, dtype = abstract if abstract is not None else (None, None)
        leaves.append(
            Leaf(
                path=path,
                shape=shape,
                dtype=dtype,
                variable=value if isinstance(value, nnx.Variable) else None,
                candidates=mirror_candidates(segments, group_depth),
            )
        )
    return leaves, treedef


def flatten_state(state: Any) -> Iterator[tuple[str, Any]]:
    """Yields ``(path, leaf)`` for every Variable (or array) of a state, as in the seed.

    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> [name for name, _ in flatten_state(nnx.state(model))]
    ['bias', 'kernel']
    """
    state, _ = as_state(state)
    yield from flatten_with_paths(state)[0]
