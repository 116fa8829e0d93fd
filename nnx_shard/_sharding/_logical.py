"""The annotated tactic: a leaf's own NNX sharding annotation, logical names mapped to mesh axes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from nnx_shard._base import Leaf, Spec, SpecEntry, entry_axes, format_spec, spec_axes
from nnx_shard._sharding._notes import Note, Noted, NoteKind
from nnx_shard._sharding._tactics import Tactic, sharded, validate_spec
from nnx_shard.errors import MeshAxisError, ShardingConflictError, TacticArgumentError

Rules = tuple[tuple[str, SpecEntry], ...]


def _rule_target(target: Any) -> SpecEntry:
    if target is None or isinstance(target, str):
        return target
    if isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target):
        return tuple(target)
    raise TacticArgumentError(
        f"a logical axis rule maps to None, a mesh axis or a tuple of them; got {target!r}."
    )


def logical_to_mesh(names: Sequence[Any], rules: Rules, used: Sequence[str] = ()) -> tuple[SpecEntry, ...]:
    """Maps logical dimension names to mesh axes exactly as flax does (``flax.linen.logical_to_mesh_axes``,
    which NNX's ``nnx.logical_axis_rules`` feed).

    The rules are priorities: each ``(logical name, mesh axes)`` pair in order
    gives the dimension of that name those axes, if the dimension has none yet
    and none of the axes is taken (by an earlier rule, or in ``used``: axes
    other tactics already put on the leaf). A name no rule places is
    replicated (``None``); ``None`` and non-string entries stay as they are.

    Raises:
      TacticArgumentError: a name occurs twice (flax refuses it too).

    >>> logical_to_mesh(("embed", "mlp"), (("embed", "data"), ("mlp", "data"), ("mlp", "model")))
    ('data', 'model')
    >>> logical_to_mesh(("mlp", "embed", "vocab"), (("embed", "data"), ("mlp", "data"), ("mlp", "model")))
    ('model', 'data', None)
    """
    dups = sorted({n for n in names if isinstance(n, str) and list(names).count(n) > 1})
    if dups:
        raise TacticArgumentError(
            f"logical names {dups} occur more than once in {tuple(names)}; flax refuses that too."
        )
    unassigned = object()
    out: list[Any] = [unassigned if isinstance(n, str) else n for n in names]
    taken = set(used)
    for n in names:
        if not isinstance(n, str) and n is not None:
            taken.update(entry_axes(n))
    for logical, axes in rules:
        if logical in names:
            pos = list(names).index(logical)
            wanted = set(entry_axes(axes))
            if out[pos] is unassigned and not wanted & taken:
                out[pos] = axes
                taken |= wanted
    return tuple(None if e is unassigned else e for e in out)


class _Annotated(Tactic):
    def __init__(self, rules: Sequence[Sequence[Any]] | None):
        if rules is not None:
            try:
                rules = tuple((str(a), _rule_target(b)) for a, b in rules)
            except (TypeError, ValueError):
                raise TacticArgumentError(
                    f"annotated(rules=...) takes (logical_name, mesh_axis) pairs; got {rules!r}."
                ) from None
        self.rules = rules

    def _rules(self, leaf: Leaf) -> Rules:
        if self.rules is not None:
            return self.rules
        from flax.core import spmd

        meta = leaf.metadata()
        return tuple(spmd.composite_rules(spmd.get_logical_axis_rules(), meta.get("sharding_rules", ())))

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        names = leaf.annotation()
        if names is None:
            return Noted(
                cur_spec,
                (Note(NoteKind.NO_ANNOTATION, "annotated: replicated, the leaf has no sharding annotation"),),
            )
        rules = self._rules(leaf)
        mapped = {logical for logical, _ in rules}
        # A stacked layer axis that no rule maps stays whole.
        names = tuple(None if i in leaf.stacked and n not in mapped else n for i, n in enumerate(names))
        # without rules the annotation names mesh axes, as flax NNX reads it outside logical_axis_rules
        new = logical_to_mesh(names, rules, spec_axes(cur_spec)) if rules else tuple(names)
        for axis in spec_axes(new):
            if axis not in mesh.shape:
                raise MeshAxisError(
                    f"cannot place {leaf.describe()} with {self}: its annotation "
                    f"{format_spec(new)} names {axis!r}, which is not a mesh axis "
                    f"{tuple(mesh.axis_names)}. Map logical names to mesh axes with "
                    f"annotated(rules=[({axis!r}, 'fsdp'), ...])."
                )
        merged = list(cur_spec)
        for i, e in enumerate(new):
            if e is None:
                continue
            if sharded(merged[i]) and merged[i] != e:
                raise ShardingConflictError(
                    f"cannot apply annotation {format_spec(new)} to {leaf.describe()}: it is "
                    f"already {format_spec(cur_spec)}. Put the more specific rule first, or "
                    f"drop one tactic."
                )
            merged[i] = e  # an explicit mapping of a stacked axis shards it (pipelining)
        return validate_spec(tuple(merged), mesh, leaf, str(self))

    def __str__(self) -> str:
        return "annotated()" if self.rules is None else f"annotated(rules={list(self.rules)!r})"


def annotated(rules: Sequence[Sequence[Any]] | None = None) -> Tactic:
    """Uses the leaf's own NNX sharding annotation (``nnx.with_partitioning`` / ``out_sharding``).

    Optimizer leaves carry their parameter's annotation (or take it from the
    parameter they mirror), so one ``annotated()`` rule places them too.
    Logical names are mapped through ``rules`` (``[('embed', 'fsdp'), ('mlp',
    'tp')]``), else through flax's logical axis rules in context and the
    variable's own ``sharding_rules``, as flax does: a name may appear in
    several rules, and the first whose mesh axes are still unused wins (see
    :func:`logical_to_mesh`). Leaves without an annotation stay replicated,
    with a note in the plan.

    >>> str(annotated(rules=[("embed", "fsdp")]))
    "annotated(rules=[('embed', 'fsdp')])"
    """
    return _Annotated(rules)


def logical_rules_of(tactics: Sequence[Any]) -> Rules:
    """The ``rules`` of every ``annotated(rules=...)`` among ``tactics`` (chains included), in order.

    These are put in force (``nnx.logical_axis_rules``) while a model is created,
    so that Flax's eager sharding resolves the logical names the same way.

    >>> logical_rules_of([annotated(rules=[("embed", "fsdp")]), annotated()])
    (('embed', 'fsdp'),)
    """
    out: list[tuple[str, SpecEntry]] = []
    for t in tactics:
        for part in getattr(t, "tactics", (t,)):
            if isinstance(part, _Annotated) and part.rules:
                out.extend(r for r in part.rules if r not in out)
    return tuple(out)
