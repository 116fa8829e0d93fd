"""Which parameter an optimizer or EMA leaf mirrors: the heuristic every strategy rule relies on.

A rule written for a parameter (``.*kernel``, ``^head/kernel$``) also places the optimizer's moments and the
EMA's copy of that parameter, so each leaf must know the parameter it mirrors. The rules, in order:

1. **Only optimizer or EMA state mirrors.** A leaf is such state when its group is an ``nnx.Optimizer`` or an
   ``nnx.EMA`` (or ``nnx.state`` of one); when it is an ``OptState`` Variable; when its key path runs through
   a field of an optax state (``mu``, ``nu``, ... read from the installed optax); or, among grouped states,
   when it sits under ``params`` and a parameter of the same path *and shape* lives in another group. A plain
   pytree's ``value/w`` is never taken for one, whatever its shape.
2. **The parameter is what follows the structure.** ``opt_state/0/mu/up/kernel`` mirrors ``up/kernel``: chain
   indices and optax fields are structural (a user's own key naming the optimizer may come first); an EMA's
   ``params/up/kernel`` mirrors ``up/kernel``; an optax state kept under the user's own keys mirrors what
   follows its last field. Each suffix on the way is a name a rule may match too.
3. **Counters find no parameter**: ``opt_state/0/count`` reads as ``count`` after its structure, which no
   parameter is, so it carries no parameter's Variable and no ``model/...`` name (rules reach it by
   ``count``); ``nnx.Optimizer``'s own ``step`` is outside ``opt_state`` and mirrors nothing.
4. **Grouped with the model**, the parameter is looked up by path and shape in the other groups, the model's
   first; found, ``model/up/kernel`` is a name rules may match too, and its Variable (its annotations) is
   carried. Stacked (``nnx.vmap``/``nnx.scan``) layers and LoRA parameters follow the same rules: their
   moments have their shapes.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
from flax.nnx.training.optimizer import OptState

from nnx_shard._base._caches import cached
from nnx_shard._base._training_state import Kind

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


def _is_structural(segment: str) -> bool:
    return segment.isdigit() or segment in optax_state_fields()


def mirror_candidates(segments: tuple[str, ...], group_depth: int = 0) -> tuple[str, ...]:
    """Rule 2: the names a strategy rule may also match for a leaf that mirrors a parameter.

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


@dataclasses.dataclass(frozen=True)
class Mirror:
    """What one leaf mirrors: the names rules may match it by, the parameter's path, the parameter's
    Variable."""

    candidates: tuple[str, ...]
    path: str | None
    variable: Any


class Parameters:
    """Every leaf of a (grouped) state by group and path inside it: where rule 4 looks a parameter up.

    ``kinds`` says what each group is (``model``, ``optimizer``, ``ema``, ``state``); ``group_depth`` is 1
    when the first path segment names a group, else 0.
    """

    def __init__(self, kinds: dict[Any, Kind], group_depth: int):
        self.kinds = kinds
        self.group_depth = group_depth
        self.paths: dict[str | None, dict[str, tuple[tuple[int, ...] | None, Any]]] = {}

    def add(self, segments: tuple[str, ...], shape: tuple[int, ...] | None, value: Any) -> None:
        """Records one leaf (all of them before the first :meth:`mirror_of`)."""
        self.paths.setdefault(self._group(segments), {})["/".join(segments[self.group_depth :])] = (
            shape,
            value,
        )

    def _group(self, segments: tuple[str, ...]) -> str | None:
        return segments[0] if self.group_depth and segments else None

    def holder(self, param: str, shape: Any, own: str | None) -> str | None:
        """The group other than ``own`` holding ``param`` with ``shape``: the model's first."""
        found = [
            g for g, paths in self.paths.items() if g != own and param in paths and paths[param][0] == shape
        ]
        return next((g for g in found if self.kinds.get(g) is Kind.MODEL), found[0] if found else None)

    def is_state(self, keypath: tuple[Any, ...], segments: tuple[str, ...], shape: Any, value: Any) -> bool:
        """Rule 1: the leaf is optimizer or EMA state."""
        group, rel = self._group(segments), segments[self.group_depth :]
        fields = optax_state_fields()
        return (
            self.kinds.get(group, Kind.STATE) in (Kind.OPTIMIZER, Kind.EMA)
            or isinstance(value, OptState)
            or any(isinstance(k, jax.tree_util.GetAttrKey) and k.name in fields for k in keypath)
            or self._ema_params_of_another_group(rel, shape, group)
        )

    def _ema_params_of_another_group(self, rel: tuple[str, ...], shape: Any, group: str | None) -> bool:
        """Grouped, under ``params``, with a parameter of the same path and shape in another group."""
        if not self.group_depth or len(rel) < 2 or rel[0] != "params":
            return False
        return self.holder("/".join(rel[1:]), shape, group) is not None

    def mirror_of(
        self, keypath: tuple[Any, ...], segments: tuple[str, ...], shape: Any, value: Any
    ) -> Mirror:
        """Rules 1-4 for one leaf."""
        group, rel = self._group(segments), "/".join(segments[self.group_depth :])
        if not self.is_state(keypath, segments, shape, value):
            return Mirror((rel,) if self.group_depth else (), None, None)
        candidates = mirror_candidates(segments, self.group_depth)
        fields = [i for i, k in enumerate(keypath) if isinstance(k, jax.tree_util.GetAttrKey)]
        if fields and len(candidates) < 2 and fields[-1] + 1 < len(segments):
            # An optax state under the user's own keys: what follows its last field is the parameter.
            candidates = (*candidates, "/".join(segments[fields[-1] + 1 :]))
        path = candidates[-1] if candidates and candidates[-1] != rel else None
        variable = None
        if path is not None and self.group_depth and (model := self.holder(path, shape, group)) is not None:
            candidates = (*candidates, f"{model}/{path}")  # rules written against model/... paths
            variable = self.paths[model][path][1]
        return Mirror(candidates, path, variable)
