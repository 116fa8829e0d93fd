"""infer_sharding(state, strategy, mesh): a NamedSharding per leaf, and a plan that says why."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import (
    WHOLE,
    Leaf,
    Spec,
    bytes_per_device,
    finalize_spec,
    flatten_leaves,
    is_graph_object,
    normalize_spec,
    spec_axes,
)
from nnx_shard._sharding._explicit import explicit_axes
from nnx_shard._sharding._notes import Note, Noted, NoteKind
from nnx_shard._sharding._parser import as_tactic
from nnx_shard._sharding._plan import LeafPlacement, ShardingPlan
from nnx_shard._sharding._tactics import Tactic
from nnx_shard.errors import (
    EmptyStateError,
    EmptyStateKind,
    InvalidRegexError,
    InvalidStrategyError,
    StateTypeError,
    TacticError,
    UnmatchedLeavesError,
    UnusedRuleWarning,
)

logger = logging.getLogger("nnx_shard")

Strategy = Sequence[tuple[str, Any]]


class _Rule:
    __slots__ = ("index", "pattern", "regex", "tactic", "text")

    def __init__(self, index: int, pattern: str, regex: re.Pattern[str], tactic: Tactic, text: str):
        self.index, self.pattern, self.regex, self.tactic, self.text = (
            index,
            pattern,
            regex,
            tactic,
            text,
        )


def _compile_strategy(strategy: Any) -> list[_Rule]:
    # A list or tuple of pairs (an ml_collections field holds one of those); a dict
    # has no order worth trusting and a string is a common slip: both are refused.
    if isinstance(strategy, (str, bytes, Mapping)) or not isinstance(strategy, Sequence):
        raise InvalidStrategyError(
            f"expected a strategy: an ordered list of (regex, tactic) pairs such as "
            f"[('.*embedding.*', 'replicate'), ('.*', \"fsdp(axis='fsdp')\")]; got "
            f"{type(strategy).__name__} {strategy!r:.200}."
        )
    rules = []
    for i, entry in enumerate(strategy):
        if isinstance(entry, (str, bytes)) or len(entry) != 2:
            raise InvalidStrategyError(
                f"rule {i} of the strategy is {entry!r}; each rule is a (regex, tactic) pair."
            )
        pattern, tactic = entry
        if not isinstance(pattern, str):
            raise InvalidStrategyError(f"rule {i}: the regex must be a string; got {pattern!r}.")
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise InvalidRegexError(
                f"rule {i} ({pattern!r}, {tactic!r}): the regex does not compile: {e}. "
                f"Escape special characters, e.g. r'layers\\.0'."
            ) from None
        text = tactic if isinstance(tactic, str) else None
        try:
            tac = as_tactic(tactic)
        except TacticError as e:
            raise e.with_rule(i, pattern, str(tactic)) from None
        rules.append(_Rule(i, pattern, regex, tac, text or str(tac)))
    return rules


def _match(rules: list[_Rule], leaf: Leaf) -> tuple[_Rule | None, str | None]:
    names = (leaf.path, *leaf.candidates)
    for rule in rules:
        search = rule.regex.search
        for name in names:
            if search(name):
                return rule, name
    return None, None


STACKED_AXIS_NAMES: tuple[str, ...] = ("layers",)


def _check_state(state: Any) -> None:
    if (
        inspect.isfunction(state)
        or inspect.ismethod(state)
        or inspect.isclass(state)
        or isinstance(state, functools.partial)
    ):
        name = getattr(state, "__name__", type(state).__name__)
        raise StateTypeError(
            f"expected a state, Module, Optimizer, EMA or pytree (or their abstract versions); got the "
            f"callable {name!r}. Pass nnx.eval_shape({name}) to plan from abstract shapes, or the "
            f"objects it builds."
        )


def _check_not_empty(state: Any, leaves: list[Leaf]) -> None:
    if not leaves and _holds_graph_objects(state):
        raise EmptyStateError(
            EmptyStateKind.NO_PARAMETERS,
            f"nnx.state of the objects given ({_describe(state)}) holds no Variable: there is nothing to "
            f"place. Pass the model whose weights you train (or nnx.eval_shape of its factory).",
        )


def _holds_graph_objects(state: Any) -> bool:
    if is_graph_object(state):
        return True
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return any(is_graph_object(v) for v in values)


def _describe(state: Any) -> str:
    if isinstance(state, dict):
        return ", ".join(f"{k}: {type(v).__name__}" for k, v in state.items())
    return type(state).__name__


def _mark_stacked(leaf: Leaf, names: Sequence[str]) -> tuple[Spec, list[Note]]:
    """The starting spec: dimensions NNX marks as stacked layers are kept whole (and noted)."""
    annotation = leaf.annotation() or ()
    leaf.stacked = tuple(i for i, n in enumerate(annotation) if isinstance(n, str) and n in names)
    if not leaf.stacked:  # most leaves: no comprehension to run (this is once per leaf of every plan)
        return (None,) * leaf.ndim, []
    notes = [
        Note(NoteKind.KEPT_WHOLE, f"dim {i} kept whole: stacked layer axis {annotation[i]!r}")
        for i in leaf.stacked
    ]
    return tuple(WHOLE if i in leaf.stacked else None for i in range(leaf.ndim)), notes


def _leaf_spec(leaf: Leaf, rule: Any, mesh: Mesh, stacked_axis_names: Any) -> tuple[Spec, tuple[Note, ...]]:
    """The spec ``rule``'s tactic gives ``leaf``, and the notes on it (scalars and unmatched leaves
    replicated)."""
    spec, notes = _mark_stacked(leaf, stacked_axis_names)
    if leaf.ndim == 0:
        notes.append(Note(NoteKind.SCALAR, "scalar: replicated"))
    elif rule is None:
        notes.append(Note(NoteKind.NO_RULE, "no rule matched: replicated"))
    else:
        try:
            result = rule.tactic(spec, mesh, leaf.path, leaf)
            if isinstance(result, Noted):
                notes += result.notes
                result = result.spec
            spec = normalize_spec(result, leaf.ndim, leaf.describe())
        except TacticError as e:
            raise e.with_rule(rule.index, rule.pattern, rule.text) from None
    return finalize_spec(spec), tuple(notes)


def _unmatched_error(unmatched: list[Leaf]) -> UnmatchedLeavesError:
    shown = "\n".join(f"  {leaf.path} {leaf.shape}" for leaf in unmatched[:10])
    more = f"\n  ... and {len(unmatched) - 10} more" if len(unmatched) > 10 else ""
    return UnmatchedLeavesError(
        f"{len(unmatched)} leaves match no rule of the strategy:\n{shown}{more}\n"
        f"End the strategy with ('.*', 'replicate') to replicate everything else, or pass strict=False."
    )


def plan_sharding(
    state: Any,
    strategy: Strategy,
    mesh: Mesh,
    *,
    strict: bool = True,
    stacked_axis_names: Sequence[str] = STACKED_AXIS_NAMES,
) -> ShardingPlan:
    """Infers shardings and returns the full plan: per leaf its rule, spec and bytes.

    Takes the same arguments as :func:`infer_sharding`; the shardings are in
    ``plan.shardings``.

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> model = nnx.eval_shape(lambda: nnx.Linear(64, 256, rngs=nnx.Rngs(0)))
    >>> plan = plan_sharding(model, [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh)
    >>> plan.leaf("kernel").spec, plan.leaf("kernel").bytes_per_device
    (P(None, 'fsdp'), 8192)
    """
    _check_state(state)
    rules = _compile_strategy(strategy)
    leaves, treedef = flatten_leaves(state)
    _check_not_empty(state, leaves)
    cache: dict[Spec, NamedSharding] = {}

    def sharding_for(spec: Spec) -> NamedSharding:
        s = cache.get(spec)
        if s is None:
            s = cache[spec] = NamedSharding(mesh, PartitionSpec(*spec))
        return s

    used: set[int] = set()
    unmatched: list[Leaf] = []
    out: list[NamedSharding | None] = [None] * len(leaves)
    placements: list[LeafPlacement] = []
    # the model's leaves first, then the optimizer's and the EMA's that mirror them: in the plan and in errors
    for i in sorted(range(len(leaves)), key=lambda i: leaves[i].kind.rank):
        leaf = leaves[i]
        if leaf.shape is None:
            placements.append(LeafPlacement.skipped(leaf))
            continue
        rule, matched = _match(rules, leaf)
        if rule is not None:
            used.add(rule.index)
        elif leaf.ndim:
            unmatched.append(leaf)
        spec, notes = _leaf_spec(leaf, rule, mesh, stacked_axis_names)
        sharding = out[i] = sharding_for(spec)
        placements.append(
            LeafPlacement(
                path=leaf.path,
                shape=leaf.shape,
                dtype=str(leaf.dtype),
                spec=sharding.spec,
                rule_index=None if rule is None else rule.index,
                matched=matched if matched != leaf.path else None,
                total_bytes=leaf.nbytes,
                bytes_per_device=bytes_per_device(sharding, leaf.shape, leaf.dtype),
                notes=notes,
                kind=leaf.kind,
            )
        )
    if strict and unmatched:
        raise _unmatched_error(unmatched)
    unused = [r.index for r in rules if r.index not in used]
    if not _QUIET.get():
        _report(placements, rules, unused)
    return ShardingPlan(
        mesh=mesh,
        leaves=placements,
        rules=[(r.pattern, r.text) for r in rules],
        unused_rules=unused,
        shardings=jax.tree_util.tree_unflatten(treedef, out),
        notes=_explicit_note(placements, mesh),
    )


def _explicit_note(placements: list[LeafPlacement], mesh: Mesh) -> list[Note]:
    """A note when Explicit mesh axes shard leaves: a step of the user's own must run under auto_axes."""
    explicit = set(explicit_axes(mesh))
    hit = [p for p in placements if p.spec is not None and explicit & set(spec_axes(tuple(p.spec)))]
    if not hit:
        return []
    axes = sorted(explicit & {a for p in hit for a in spec_axes(tuple(p.spec))})
    return [
        Note(
            NoteKind.EXPLICIT_AXES,
            f"Explicit mesh axes {axes} shard {len(hit)} leaves (first {hit[0].path!r} {hit[0].spec}): "
            f"a step of your own over them runs its model under nnx_shard.auto_axes (or "
            f"jax.sharding.auto_axes with these shardings as outputs), or JAX may refuse an op whose "
            f"output sharding is ambiguous; the Trainer does this itself. See 'Explicit meshes' on the "
            f"placement page of the docs (docs/placement.md).",
        )
    ]


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("nnx_shard_quiet_planning", default=False)


@contextlib.contextmanager
def quiet_planning() -> Iterator[None]:
    """Plans made inside neither warn of unused rules nor log notes: for rules the user did not write
    (``ns.suggest``'s candidates), whose notes would read as complaints about the user's own."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def _report(placements: list[LeafPlacement], rules: list[_Rule], unused: list[int]) -> None:
    """Warns of each rule that matched no leaf, then logs the notes."""
    for i in unused:
        msg = (
            f"rule {i} ({rules[i].pattern!r}, {rules[i].text!r}) matched no leaf; check the regex for a typo."
        )
        warnings.warn(msg, UnusedRuleWarning, stacklevel=4)
    _log_notes(placements, rules)


def _log_notes(placements: list[LeafPlacement], rules: list[_Rule]) -> None:
    """Logs each kind of note once per rule, at its kind's level, with a count and the first leaf."""
    seen: dict[tuple[int | None, NoteKind], list[tuple[LeafPlacement, Note]]] = {}
    for p in placements:
        for note in p.notes:
            if note.kind.level is not None:
                seen.setdefault((p.rule_index, note.kind), []).append((p, note))
    for (index, kind), found in seen.items():
        where = (
            "no rule" if index is None else f"rule {index} ({rules[index].pattern!r}, {rules[index].text!r})"
        )
        first, note = found[0]
        what = "left replicated" if kind.replicates else "noted"
        logger.log(
            kind.level,
            "%s: %d leaves %s; first %r %s: %s",
            where,
            len(found),
            what,
            first.path,
            first.shape,
            note,
        )


def infer_sharding(
    state: Any,
    strategy: Strategy,
    mesh: Mesh,
    *,
    strict: bool = True,
    return_plan: bool = False,
    stacked_axis_names: Sequence[str] = STACKED_AXIS_NAMES,
) -> Any:
    """Infers a ``NamedSharding`` for every leaf from an ordered list of (regex, tactic) rules.

    ``state`` may be an ``nnx.State``, a Module, an ``nnx.Optimizer``, an
    ``nnx.EMA``, a plain pytree, a dict or tuple of those, or abstract versions
    of any of them (``nnx.eval_shape``, ``jax.ShapeDtypeStruct``); nothing is
    allocated. Paths are ``/``-joined (``encoder/layers/0/mlp/kernel``); each
    rule's regex is tried with ``re.search`` and the first matching rule wins.
    A leaf that mirrors a parameter (``opt_state/0/mu/up/kernel``,
    ``params/up/kernel`` in an EMA) is also tried under the parameter's path
    ``up/kernel``, so one strategy serves model, optimizer and EMA.
    Scalars are replicated without a rule; leaves without a shape (masked
    optimizer entries) get ``None``.

    Args:
      state: what to place.
      strategy: ``[(regex, tactic), ...]``; a tactic is a string such as
        ``"fsdp(axis='fsdp')|shard_dim(axis='tp', dim=-1)"``, a Tactic, a
        ShardingRule, a PartitionSpec or a callable ``(cur_spec, mesh, name, leaf) -> spec``.
      mesh: the mesh to place on.
      strict: raise :class:`UnmatchedLeavesError` when a leaf with dimensions
        matches no rule (else it is replicated, and the plan says so).
      return_plan: return ``(shardings, plan)``.
      stacked_axis_names: names that mark a stacked layer axis in a leaf's
        NNX annotation (``nnx.vmap`` / ``nnx.scan`` with
        ``transform_metadata={nnx.PARTITION_NAME: 'layers'}`` insert it); such
        dimensions are kept whole by every tactic unless ``annotated()`` maps
        the name to a mesh axis. An optimizer slot that lost the annotation
        takes its parameter's. Tactics can mark a dimension too: ``stacked(dim=0)``.

    Returns:
      A pytree of ``NamedSharding`` mirroring ``state`` (an ``nnx.State`` for a
      State or Module), usable as ``jax.jit(..., out_shardings=...)`` or with
      ``jax.device_put``.

    Raises:
      InvalidStrategyError: a malformed strategy or regex.
      TacticError: a subclass naming the rule, the leaf and the fix.
      UnmatchedLeavesError: in strict mode, leaves no rule matched.
      StateTypeError: a factory or class instead of a state (use ``nnx.eval_shape``).

    >>> import optax
    >>> from flax import nnx
    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((2, 4), ("dp", "fsdp"))
    >>> model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    >>> strategy = [("^kernel$", "shard_dim(axis='fsdp', dim=-1)"), (".*", "replicate")]
    >>> infer_sharding(opt, strategy, mesh)["opt_state"][0]["mu"]["kernel"].spec
    P(None, 'fsdp')
    """
    plan = plan_sharding(state, strategy, mesh, strict=strict, stacked_axis_names=stacked_axis_names)
    return (plan.shardings, plan) if return_plan else plan.shardings
