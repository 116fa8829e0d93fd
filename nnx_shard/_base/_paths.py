"""NNX state <-> ``encoder/layers/0/mlp/kernel``: the one path flattener, and which parameter a leaf mirrors."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph
from flax.nnx.training.optimizer import OptState

from nnx_shard._base._caches import cached
from nnx_shard._base._specs import itemsize
from nnx_shard._base._visibility import raise_hidden, reveal

# The first path segment under which a state mirrors the parameters:
# ``nnx.Optimizer`` keeps ``opt_state``, ``nnx.EMA`` keeps ``params``.
MIRROR_ROOTS = frozenset({"opt_state", "params"})


@cached(maxsize=None)
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
      candidates: other names a strategy rule may match it by: the path inside
        its group, and for an optimizer or EMA leaf the parameter it mirrors
        (``up/kernel``, and ``model/up/kernel`` when grouped with the model).
      mirror: the parameter path it mirrors (optimizer or EMA state), if any.
      mirror_variable: that parameter's Variable, when the model is at hand.
      stacked: dimensions NNX marks as stacked layers (kept whole by default).

    >>> leaf = Leaf("opt_state/0/mu/up/kernel", (16, 32), "bfloat16", candidates=("up/kernel",), mirror="up/kernel")
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
        """The logical names of its dimensions (``out_sharding``, ``sharding_names`` or ``sharding``), if any."""
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
    if type(tree) in (dict, list, tuple) and tree:
        values = tree.values() if isinstance(tree, dict) else tree
        if any(is_graph_object(v) or isinstance(v, nnx.State) for v in values):
            conv = lambda v: nnx.state(v) if is_graph_object(v) else v
            if isinstance(tree, dict):
                return {k: conv(v) for k, v in tree.items()}, 1
            return type(tree)(conv(v) for v in tree), 1
    return tree, 0


def visible(tree: Any) -> Any:
    """``tree``, once every Variable of its Modules is visible to ``nnx.state``: qwix's class swaps are repaired,
    anything else hidden raises :class:`~nnx_shard.EmptyStateError` (see ``_visibility``). Run where objects
    enter (planning, creation), not on every read of their state."""
    values = tree.values() if isinstance(tree, dict) else tree if type(tree) in (list, tuple) else (tree,)
    for obj in values:
        if is_graph_object(obj) and (hidden := reveal(obj)):
            raise_hidden(hidden, type(obj).__name__)
    return tree


def _annotation_names(meta: dict[str, Any]) -> Any:
    return meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding") or None


def _kind(obj: Any) -> str:
    if isinstance(obj, nnx.Optimizer):
        return "optimizer"
    if isinstance(obj, nnx.EMA) or _is_ema_state(obj):
        return "ema"
    return "model" if is_graph_object(obj) else "state"


def _is_ema_state(obj: Any) -> bool:
    """``nnx.state(ema)``: a State whose one key is ``params``, every leaf under it an ``nnx.Param``."""
    if not isinstance(obj, nnx.State) or list(obj.keys()) != ["params"]:
        return False
    leaves = jax.tree.leaves(obj, is_leaf=is_variable)
    return bool(leaves) and all(isinstance(v, nnx.Param) for v in leaves)


def _group_kinds(tree: Any, group_depth: int) -> dict[Any, str]:
    if not group_depth:
        return {None: _kind(tree)}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    return {str(k): _kind(v) for k, v in items}


def _in_optax_state(keypath: tuple[Any, ...]) -> bool:
    fields = optax_state_fields()
    return any(isinstance(k, jax.tree_util.GetAttrKey) and k.name in fields for k in keypath)


def flatten_leaves(tree: Any) -> tuple[list[Leaf], Any]:
    """Flattens a state, Module or pytree into :class:`Leaf` records and a treedef.

    The treedef has one leaf per ``nnx.Variable`` (or per array of a plain
    pytree), so ``jax.tree_util.tree_unflatten(treedef, values)`` builds a tree
    of the same structure holding ``values``. A leaf mirrors a parameter only
    when it is known to be optimizer or EMA state: it belongs to an
    ``nnx.Optimizer`` (its Variables are ``OptState``s) or to an optax state, or
    to an ``nnx.EMA``, or, among grouped states, it sits under ``params`` and a
    parameter of the same path and shape lives in another group.
    """
    state, group_depth = as_state(visible(tree))
    kinds = _group_kinds(tree, group_depth)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)
    records = []
    index: dict[str | None, dict[str, tuple[tuple[int, ...] | None, Any]]] = {}
    for keypath, value in flat:
        path = path_str(keypath)
        segments = tuple(path.split("/")) if path else ()
        group = segments[0] if group_depth and segments else None
        abstract = abstract_of(value)
        shape = abstract[0] if abstract is not None else None
        records.append((keypath, path, segments, group, value, abstract))
        index.setdefault(group, {})["/".join(segments[group_depth:])] = (shape, value)

    def holder(param: str, shape: Any, own: Any) -> str | None:
        found = [g for g, paths in index.items() if g != own and param in paths and paths[param][0] == shape]
        return next((g for g in found if kinds.get(g) == "model"), found[0] if found else None)

    leaves = []
    for keypath, path, segments, group, value, abstract in records:
        shape, dtype = abstract if abstract is not None else (None, None)
        rel = segments[group_depth:]
        kind = kinds.get(group, "state")
        known = (
            kind in ("optimizer", "ema")
            or isinstance(value, OptState)
            or _in_optax_state(keypath)
            or (
                bool(group_depth)
                and len(rel) > 1
                and rel[0] == "params"
                and holder("/".join(rel[1:]), shape, group)
            )
        )
        candidates = (
            mirror_candidates(segments, group_depth) if known else (("/".join(rel),) if group_depth else ())
        )
        fields = [i for i, k in enumerate(keypath) if isinstance(k, jax.tree_util.GetAttrKey)]
        if known and fields and len(candidates) < 2 and fields[-1] + 1 < len(segments):
            # An optax state under the user's own keys: what follows its last field is the parameter.
            candidates = (*candidates, "/".join(segments[fields[-1] + 1 :]))
        mirror = candidates[-1] if known and candidates and candidates[-1] != "/".join(rel) else None
        mirror_variable = None
        if mirror is not None and group_depth:
            model = holder(mirror, shape, group)
            if model is not None:
                candidates = (*candidates, f"{model}/{mirror}")  # rules written against model/... paths
                mirror_variable = index[model][mirror][1]
        leaves.append(
            Leaf(
                path=path,
                shape=shape,
                dtype=dtype,
                variable=value if is_variable(value) else None,
                candidates=candidates,
                mirror=mirror,
                mirror_variable=mirror_variable if is_variable(mirror_variable) else None,
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
