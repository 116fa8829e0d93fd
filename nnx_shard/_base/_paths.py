"""NNX state <-> ``encoder/layers/0/mlp/kernel``: the one path flattener, Leaf records, grouped objects."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph

from nnx_shard._base._mirror import Parameters
from nnx_shard._base._specs import itemsize
from nnx_shard._base._training_state import Kind, TrainingState
from nnx_shard._base._visibility import raise_hidden, reveal


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


@dataclasses.dataclass
class Leaf:
    """One array of a state, as a tactic sees it: its path, shape and dtype, never its data.

    Attributes:
      path: ``/``-joined path, e.g. ``opt_state/0/mu/up/kernel``.
      shape: the global shape, or None for a leaf without one (masked entries).
      dtype: the dtype, or None.
      variable: the ``nnx.Variable`` holding it, if any (for its metadata).
      candidates: other names a strategy rule may match it by: the path inside
        its group, and for an optimizer or EMA leaf the parameter it mirrors
        (``up/kernel``, and ``model/up/kernel`` when grouped with the model).
      mirror: the parameter path it mirrors (optimizer or EMA state), if any.
      mirror_variable: that parameter's Variable, when the model is at hand.
      stacked: dimensions NNX marks as stacked layers (kept whole by default).
      kind: the part of the training state it belongs to (:class:`Kind`), from its group's name.

    >>> path = "opt_state/0/mu/up/kernel"
    >>> leaf = Leaf(path, (16, 32), "bfloat16", candidates=("up/kernel",), mirror="up/kernel")
    >>> leaf.nbytes, leaf.mirror, leaf.describe()
    (1024, 'up/kernel', "'opt_state/0/mu/up/kernel' (shape (16, 32))")
    """

    path: str
    shape: tuple[int, ...] | None
    dtype: Any
    variable: Any = None
    candidates: tuple[str, ...] = ()
    mirror: str | None = None
    mirror_variable: Any = None
    stacked: tuple[int, ...] = ()
    kind: Kind = Kind.STATE

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

    def metadata(self) -> dict[str, Any]:
        """The NNX metadata of its Variable, else of the parameter it mirrors (empty for plain arrays).

        Optimizer slots that lost an annotation their parameter carries (flax
        #5112) get the parameter's.
        """
        own = self.variable.get_metadata() if self.variable is not None else {}
        if _annotation_names(own) is None and self.mirror_variable is not None:
            return self.mirror_variable.get_metadata()
        return own

    def annotation(self) -> tuple[Any, ...] | None:
        """The logical names of its dimensions (``out_sharding``, ``sharding_names`` or ``sharding``), if
        any."""
        names = _annotation_names(self.metadata())
        return tuple(names) if names is not None and len(names) == self.ndim else None

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
    if isinstance(tree, TrainingState):
        tree = dict(tree)
    if type(tree) in (dict, list, tuple) and tree:
        values = tree.values() if isinstance(tree, dict) else tree
        if any(is_graph_object(v) or isinstance(v, nnx.State) for v in values):
            conv = lambda v: nnx.state(v) if is_graph_object(v) else v
            if isinstance(tree, dict):
                return {k: conv(v) for k, v in tree.items()}, 1
            return type(tree)(conv(v) for v in tree), 1
    return tree, 0


def visible(tree: Any) -> Any:
    """``tree``, once every Variable of its Modules is visible to ``nnx.state``: qwix's class swaps are
    repaired, anything else hidden raises :class:`~nnx_shard.EmptyStateError` (see ``_visibility``). Run where
    objects enter (planning, creation), not on every read of their state."""
    values = tree.values() if isinstance(tree, Mapping) else tree if type(tree) in (list, tuple) else (tree,)
    for obj in values:
        if is_graph_object(obj) and (hidden := reveal(obj)):
            raise_hidden(hidden, type(obj).__name__)
    return tree


def _annotation_names(meta: dict[str, Any]) -> Any:
    return meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding") or None


def _group_kinds(tree: Any, group_depth: int) -> dict[Any, Kind]:
    """What each group is, from its type (what the mirror rules use); the whole tree's when ungrouped."""
    if not group_depth:
        return {None: Kind.of(tree)}
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    return {str(k): Kind.of(v) for k, v in items}


def flatten_leaves(tree: Any) -> tuple[list[Leaf], Any]:
    """Flattens a state, Module or pytree into :class:`Leaf` records and a treedef.

    The treedef has one leaf per ``nnx.Variable`` (or per array of a plain
    pytree), so ``jax.tree_util.tree_unflatten(treedef, values)`` builds a tree
    of the same structure holding ``values``. Which parameter each optimizer or
    EMA leaf mirrors is decided in :mod:`nnx_shard._base._mirror`, rule by rule.
    """
    state, group_depth = as_state(visible(tree))
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)
    parameters = Parameters(_group_kinds(tree, group_depth), group_depth)
    part_kind = tree.kind if isinstance(tree, TrainingState) else Kind.named  # a typed state says, else names
    records = []
    for keypath, value in flat:
        path = path_str(keypath)
        segments = tuple(path.split("/")) if path else ()
        abstract = abstract_of(value)
        parameters.add(segments, abstract[0] if abstract is not None else None, value)
        records.append((keypath, path, segments, value, abstract))
    leaves = []
    for keypath, path, segments, value, abstract in records:
        shape, dtype = abstract if abstract is not None else (None, None)
        mirror = parameters.mirror_of(keypath, segments, shape, value)
        leaves.append(
            Leaf(
                path=path,
                shape=shape,
                dtype=dtype,
                variable=value if is_variable(value) else None,
                candidates=mirror.candidates,
                mirror=mirror.path,
                mirror_variable=mirror.variable if is_variable(mirror.variable) else None,
                kind=part_kind(segments[0]) if group_depth and segments else Kind.STATE,
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
