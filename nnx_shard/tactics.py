"""Sharding tactics (replicate, fsdp, shard_dim, spec, annotated), their safe string parser and registry.

A tactic is a callable ``(cur_spec, mesh, name, leaf) -> spec`` where a spec is
a tuple with one entry per dimension (``None``, an axis name, or a tuple of
axis names). Tactics chain with ``|``; the next one starts from the spec the
previous one returned.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from nnx_shard.errors import (
    IndivisibleShardingError,
    MeshAxisError,
    ShardingConflictError,
    TacticArgumentError,
    TacticSyntaxError,
    UnknownTacticError,
)
from nnx_shard.paths import Leaf
from nnx_shard.rules import ShardingRule

SpecEntry = None | str | tuple[str, ...]
Spec = tuple[SpecEntry, ...]
AxisArg = str | Sequence[str]


def format_spec(spec: Sequence[SpecEntry]) -> str:
    """``P(None, 'fsdp')``, the way error messages and plans print a spec."""
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def spec_axes(spec: Sequence[SpecEntry]) -> list[str]:
    """All mesh axes a spec uses, in order, with repeats."""
    out: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        out.extend((entry,) if isinstance(entry, str) else entry)
    return out


def entry_size(mesh: Mesh, entry: SpecEntry) -> int:
    """The number of shards one spec entry cuts a dimension into."""
    if entry is None:
        return 1
    axes = (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[a] for a in axes)


def normalize_spec(spec: Any, ndim: int, where: str = "") -> Spec:
    """A PartitionSpec, tuple or list as a tuple of exactly ``ndim`` entries."""
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > ndim:
        raise TacticArgumentError(
            f"gives {len(entries)} spec entries {format_spec(entries)} for {where} "
            f"with {ndim} dimensions; give at most {ndim}."
        )
    out: list[SpecEntry] = []
    for e in entries:
        if e is None or isinstance(e, str):
            out.append(e)
        elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
            out.append(tuple(e) if len(e) > 1 else (e[0] if e else None))
        else:
            raise TacticArgumentError(
                f"gives spec entry {e!r} for {where}; entries are None, an axis name, "
                f"or a tuple of axis names."
            )
    return tuple(out) + (None,) * (ndim - len(out))


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

    >>> str(fsdp(axis="fsdp") | shard_dim(axis="tp", dim=-1))
    "fsdp(axis='fsdp')|shard_dim(axis='tp', dim=-1)"
    """

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        raise NotImplementedError

    def __or__(self, other: Any) -> Chain:
        return Chain((self, as_tactic(other)))

    def __ror__(self, other: Any) -> Chain:
        return Chain((as_tactic(other), self))

    def __repr__(self) -> str:
        return str(self)


class Chain(Tactic):
    """Tactics applied one after the other to the same leaf."""

    def __init__(self, tactics: Sequence[Tactic]):
        flat: list[Tactic] = []
        for t in tactics:
            flat.extend(t.tactics if isinstance(t, Chain) else (t,))
        self.tactics = tuple(flat)

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        for t in self.tactics:
            cur_spec = normalize_spec(t(cur_spec, mesh, name, leaf), leaf.ndim, leaf.describe())
        return cur_spec

    def __str__(self) -> str:
        return "|".join(str(t) for t in self.tactics)


class _Replicate(Tactic):
    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        if any(e is not None for e in cur_spec):
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
        _check_unused(self.axes, cur_spec, leaf, str(self))
        if leaf.nbytes <= self.min_size_to_shard_mb * 2**20:
            leaf.notes.append(
                f"fsdp: replicated, {leaf.nbytes} bytes is below "
                f"min_size_to_shard_mb={self.min_size_to_shard_mb}"
            )
            return cur_spec
        size = math.prod(mesh.shape[a] for a in self.axes)
        # Largest dimension first; among equal sizes the last one (the output
        # features of a kernel), as big_vision does.
        for i in sorted(range(leaf.ndim), key=lambda i: (leaf.shape[i], i), reverse=True):
            if cur_spec[i] is None and leaf.shape[i] % size == 0:
                return cur_spec[:i] + (_entry(self.axes),) + cur_spec[i + 1 :]
        leaf.notes.append(
            f"fsdp: replicated, no free dimension of {leaf.shape} is divisible by "
            f"{'x'.join(self.axes)}={size}"
        )
        return cur_spec

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

    >>> from nnx_shard.mesh import create_mesh
    >>> from nnx_shard.paths import Leaf
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> leaf = Leaf("w", (1024, 4096), "float32")
    >>> fsdp("fsdp")((None, None), mesh, "w", leaf)
    (None, 'fsdp')
    """
    return _Fsdp(axis, min_size_to_shard_mb)


class _ShardDim(Tactic):
    def __init__(self, axis: AxisArg, dim: int):
        self.axes = _axes(axis, "shard_dim")
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TacticArgumentError(f"shard_dim(dim=...) takes an integer; got {dim!r}.")
        self.dim = dim

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        check_axes(self.axes, mesh, leaf, str(self))
        if not -leaf.ndim <= self.dim < leaf.ndim:
            raise TacticArgumentError(
                f"cannot shard dim {self.dim} of {leaf.describe()}: it has {leaf.ndim} "
                f"dimensions. Use a dim in [{-leaf.ndim}, {leaf.ndim - 1}] or a narrower regex."
            )
        i = self.dim % leaf.ndim
        if cur_spec[i] is not None:
            raise ShardingConflictError(
                f"cannot shard dim {self.dim} of {leaf.describe()}: it is already "
                f"{format_spec(cur_spec)}. Put the more specific rule first, or drop one tactic."
            )
        _check_unused(self.axes, cur_spec, leaf, str(self))
        size = math.prod(mesh.shape[a] for a in self.axes)
        if leaf.shape[i] % size:
            raise IndivisibleShardingError(
                f"cannot shard dim {self.dim} of {leaf.describe()} over "
                f"{'x'.join(self.axes)}={size}: {leaf.shape[i]} is not divisible by {size}. "
                f"Pick another dim or axis, or use fsdp() which skips indivisible dims."
            )
        return cur_spec[:i] + (_entry(self.axes),) + cur_spec[i + 1 :]

    def __str__(self) -> str:
        axis = self.axes[0] if len(self.axes) == 1 else self.axes
        return f"shard_dim(axis={axis!r}, dim={self.dim})"


def shard_dim(axis: AxisArg, dim: int) -> Tactic:
    """Shards dimension ``dim`` (negative counts from the end) over ``axis``; raises if it cannot.

    >>> from nnx_shard.mesh import create_mesh
    >>> from nnx_shard.paths import Leaf
    >>> mesh = create_mesh((2, 4), ("dp", "tp"))
    >>> shard_dim("tp", -1)((None, None), mesh, "w", Leaf("w", (6, 8), "float32"))
    (None, 'tp')
    """
    return _ShardDim(axis, dim)


class _Spec(Tactic):
    def __init__(self, entries: Sequence[Any]):
        self.entries = normalize_spec(entries, len(entries), "spec()")

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        if any(e is not None for e in cur_spec):
            raise ShardingConflictError(
                f"cannot set {format_spec(self.entries)} on {leaf.describe()}: it is already "
                f"{format_spec(cur_spec)}. spec() sets the whole spec: put it alone or first."
            )
        spec = normalize_spec(self.entries, leaf.ndim, leaf.describe())
        return validate_spec(spec, mesh, leaf, str(self))

    def __str__(self) -> str:
        return "spec(" + ", ".join(repr(e) for e in self.entries) + ")"


def spec(*entries: SpecEntry) -> Tactic:
    """Sets an explicit PartitionSpec (missing trailing entries are None).

    >>> from nnx_shard.mesh import create_mesh
    >>> from nnx_shard.paths import Leaf
    >>> mesh = create_mesh((2, 4), ("dp", "tp"))
    >>> spec("tp")((None, None), mesh, "w", Leaf("w", (8, 3), "float32"))
    ('tp', None)
    """
    return _Spec(entries)


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

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        annotation = _annotation(leaf, self.rules)
        if annotation is None:
            leaf.notes.append("annotated: replicated, the leaf has no sharding annotation")
            return cur_spec
        new = normalize_spec(annotation, leaf.ndim, leaf.describe())
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
            if merged[i] is not None and merged[i] != e:
                raise ShardingConflictError(
                    f"cannot apply annotation {format_spec(new)} to {leaf.describe()}: it is "
                    f"already {format_spec(cur_spec)}. Put the more specific rule first, or "
                    f"drop one tactic."
                )
            merged[i] = e
        return validate_spec(tuple(merged), mesh, leaf, str(self))

    def __str__(self) -> str:
        return "annotated()" if self.rules is None else f"annotated(rules={list(self.rules)!r})"


def _rule_target(target: Any) -> SpecEntry:
    if target is None or isinstance(target, str):
        return target
    if isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target):
        return tuple(target)
    raise ValueError(target)


def _annotation(leaf: Leaf, rules: tuple[tuple[str, SpecEntry], ...] | None) -> Spec | None:
    """The leaf's own ``out_sharding`` metadata, logical names mapped through ``rules``."""
    var = leaf.variable
    if var is None:
        return None
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if not names:
        return None
    if rules is None:
        from flax.core import spmd

        rules = tuple(spmd.composite_rules(spmd.get_logical_axis_rules(), meta.get("sharding_rules", ())))
    table: dict[str, SpecEntry] = {}
    for logical, axis in rules:
        table.setdefault(logical, axis)
    return tuple(table.get(n, n) if isinstance(n, str) else n for n in names)


def annotated(rules: Sequence[Sequence[Any]] | None = None) -> Tactic:
    """Uses the leaf's own NNX sharding annotation (``nnx.with_partitioning`` / ``out_sharding``).

    Optimizer leaves carry their parameter's annotation, so one ``annotated()``
    rule places them too. Logical names are mapped through ``rules``
    (``[('embed', 'fsdp'), ('mlp', 'tp')]``), else through flax's logical axis
    rules in context and the variable's own ``sharding_rules``.
    Leaves without an annotation stay replicated, with a note in the plan.

    >>> str(annotated(rules=[("embed", "fsdp")]))
    "annotated(rules=[('embed', 'fsdp')])"
    """
    return _Annotated(rules)


def validate_spec(spec_: Spec, mesh: Mesh, leaf: Leaf, tactic: str) -> Spec:
    """Checks a complete spec against the mesh and the leaf; returns it unchanged.

    Raises:
      MeshAxisError: an axis not in the mesh.
      ShardingConflictError: a mesh axis used twice.
      IndivisibleShardingError: a dimension not divisible by its shards.
    """
    axes = spec_axes(spec_)
    check_axes(axes, mesh, leaf, tactic)
    twice = sorted({a for a in axes if axes.count(a) > 1})
    if twice:
        raise ShardingConflictError(
            f"gives {leaf.describe()} the spec {format_spec(spec_)}, which uses mesh axis "
            f"{twice[0]!r} twice. A mesh axis may shard one dimension only."
        )
    for i, entry in enumerate(spec_):
        n = entry_size(mesh, entry)
        if leaf.shape[i] % n:
            raise IndivisibleShardingError(
                f"cannot shard dim {i} of {leaf.describe()} as {format_spec(spec_)}: "
                f"{leaf.shape[i]} is not divisible by {n}. Pick another dim or axis."
            )
    return spec_


class FunctionTactic(Tactic):
    """A user's plain callable ``(cur_spec, mesh, name, leaf) -> spec`` as a Tactic."""

    def __init__(self, fn: Callable[..., Any], text: str | None = None):
        self.fn = fn
        self.text = text or getattr(fn, "__name__", repr(fn))

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        out = normalize_spec(self.fn(cur_spec, mesh, name, leaf), leaf.ndim, leaf.describe())
        return validate_spec(out, mesh, leaf, self.text)

    def __str__(self) -> str:
        return self.text


class RuleTactic(Tactic):
    """A :class:`nnx_shard.ShardingRule` standing as the tactic of a strategy entry."""

    def __init__(self, rule: Any):
        self.rule = rule

    def __call__(self, cur_spec: Spec, mesh: Mesh, name: str, leaf: Leaf) -> Spec:
        out = normalize_spec(self.rule.apply(leaf.value), leaf.ndim, leaf.describe())
        if any(e is not None for e in out) and any(e is not None for e in cur_spec):
            raise ShardingConflictError(
                f"cannot apply {self} to {leaf.describe()}: it is already "
                f"{format_spec(cur_spec)}. Put the rule first in the chain."
            )
        if all(e is None for e in out):
            return cur_spec
        return validate_spec(out, mesh, leaf, str(self))

    def __str__(self) -> str:
        return type(self.rule).__name__


_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_tactic(name: str | Callable[..., Any] | None = None) -> Any:
    """Registers a tactic factory under a name usable in tactic strings.

    The factory takes literal arguments and returns a :class:`Tactic` or a
    plain callable ``(cur_spec, mesh, name, leaf) -> spec``.

    >>> @register_tactic("first_dim")
    ... def first_dim(axis):
    ...     return lambda cur, mesh, name, leaf: (axis,) + cur[1:]
    >>> str(parse_tactic("first_dim(axis='fsdp')"))
    "first_dim(axis='fsdp')"
    """

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        key = name if isinstance(name, str) else factory.__name__
        if not key.isidentifier():
            raise TacticArgumentError(f"a tactic name must be an identifier; got {key!r}.")
        _REGISTRY[key] = factory
        return factory

    if callable(name):
        return deco(name)
    return deco


def registered_tactics() -> list[str]:
    """The names usable in tactic strings."""
    return sorted(_REGISTRY)


for _factory in (replicate, fsdp, shard_dim, spec, annotated):
    register_tactic(_factory)
register_tactic("logical_partitioning")(annotated)


def _literal(node: ast.AST, text: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise TacticSyntaxError(
            f"tactic {text!r}: argument {ast.unparse(node)!r} is not a literal. Tactic "
            f"arguments are strings, numbers, None, or tuples and lists of them; nothing is run."
        ) from None


def _build(term: ast.AST, text: str) -> Tactic:
    if isinstance(term, ast.Name):
        name, args, kwargs = term.id, [], {}
    elif isinstance(term, ast.Call) and isinstance(term.func, ast.Name):
        if any(isinstance(a, ast.Starred) for a in term.args) or any(k.arg is None for k in term.keywords):
            raise TacticSyntaxError(f"tactic {text!r}: *args and **kwargs are not allowed.")
        name = term.func.id
        args = [_literal(a, text) for a in term.args]
        kwargs = {k.arg: _literal(k.value, text) for k in term.keywords}
    else:
        raise TacticSyntaxError(
            f"tactic {text!r}: {ast.unparse(term)!r} is not a tactic call. Write "
            f"name(arg=literal, ...) joined by '|', e.g. \"fsdp(axis='fsdp')|shard_dim(axis='tp', dim=-1)\"."
        )
    return make_tactic(name, *args, **kwargs)


def make_tactic(name: str, *args: Any, **kwargs: Any) -> Tactic:
    """Builds a registered tactic by name, checking the arguments against its signature.

    >>> str(make_tactic("shard_dim", "tp", dim=0))
    "shard_dim(axis='tp', dim=0)"
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UnknownTacticError(
            f"unknown tactic {name!r}; the tactics are {registered_tactics()}. "
            f"Register your own with @nnx_shard.register_tactic."
        )
    sig = inspect.signature(factory)
    shown = ", ".join(
        p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in sig.parameters.values()
    )
    unknown = [k for k in kwargs if k not in sig.parameters]
    try:
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TacticArgumentError(f"{name}(): {e}; it takes {name}({shown}).") from None
    out = factory(*args, **kwargs)
    if isinstance(out, Tactic):
        return out
    if callable(out):
        bound = sig.bind(*args, **kwargs)
        given = ", ".join(f"{k}={v!r}" for k, v in bound.arguments.items())
        return FunctionTactic(out, f"{name}({given})")
    raise TacticArgumentError(
        f"tactic factory {name!r} returned {out!r}; it must return a callable "
        f"(cur_spec, mesh, name, leaf) -> spec."
    )


def parse_tactic(text: str) -> Tactic:
    """Parses ``"fsdp(axis='fsdp')|shard_dim(axis='tp', dim=-1)"`` without running any code.

    Only registered tactic names and literal arguments are accepted (Python's
    ``ast``; never ``eval``).

    Raises:
      TacticSyntaxError: anything but a ``|`` chain of calls with literal arguments.
      UnknownTacticError: a name that is not registered.
      TacticArgumentError: arguments that do not fit the tactic.

    >>> parse_tactic("fsdp(axis=('dp', 'fsdp'))|shard_dim(axis='tp', dim=0)").tactics[1].dim
    0
    """
    if not isinstance(text, str) or not text.strip():
        raise TacticSyntaxError(f"expected a tactic string like \"fsdp(axis='fsdp')\"; got {text!r}.")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise TacticSyntaxError(f"tactic {text!r} is not valid syntax: {e.msg}.") from None
    terms: list[ast.AST] = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            walk(node.left)
            walk(node.right)
        else:
            terms.append(node)

    walk(tree)
    tactics = [_build(t, text) for t in terms]
    return tactics[0] if len(tactics) == 1 else Chain(tactics)


def as_tactic(tactic: Any) -> Tactic:
    """A Tactic from a tactic string, a Tactic, a ShardingRule or a plain callable."""
    if isinstance(tactic, Tactic):
        return tactic
    if isinstance(tactic, str):
        return parse_tactic(tactic)
    if isinstance(tactic, ShardingRule):
        return RuleTactic(tactic)
    if isinstance(tactic, PartitionSpec):
        return _Spec(tuple(tactic))
    if callable(tactic):
        return FunctionTactic(tactic)
    raise TacticArgumentError(
        f"expected a tactic string, a Tactic, a ShardingRule or a callable; got {tactic!r}."
    )
