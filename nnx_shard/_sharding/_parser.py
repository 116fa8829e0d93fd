"""Tactic strings: the registry of tactic names and the parser that never runs code.

``parse_tactic("fsdp(axis='fsdp')|shard_dim(axis='tp', dim=-1)")`` reads the
string with Python's ``ast`` and accepts only registered names called with
literal arguments; :func:`as_tactic` turns anything a strategy may hold into a
:class:`~nnx_shard.Tactic`.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any

from jax.sharding import PartitionSpec

from nnx_shard._sharding._logical import annotated
from nnx_shard._sharding._tactics import (
    Chain,
    FunctionTactic,
    Tactic,
    fsdp,
    replicate,
    shard_dim,
    spec,
    stacked,
)
from nnx_shard.errors import TacticArgumentError, TacticSyntaxError, UnknownTacticError

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
    >>> unregister_tactic("first_dim")  # the registry is process-wide: leave it as it was
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


def unregister_tactic(name: str) -> None:
    """Removes a tactic :func:`register_tactic` added (the built-in ones stay).

    Raises:
      UnknownTacticError: no tactic of that name was registered, or it is a built-in one.
    """
    if name in _BUILTIN or name not in _REGISTRY:
        what = "a built-in tactic" if name in _BUILTIN else "not registered"
        raise UnknownTacticError(
            f"cannot unregister tactic {name!r}: it is {what}; registered: {registered_tactics()}."
        )
    del _REGISTRY[name]


def registered_tactics() -> list[str]:
    """The names usable in tactic strings."""
    return sorted(_REGISTRY)


for _factory in (replicate, fsdp, shard_dim, spec, annotated, stacked):
    register_tactic(_factory)
register_tactic("logical_partitioning")(annotated)
_BUILTIN = frozenset(_REGISTRY)


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
    """A Tactic from a tactic string, a Tactic, a PartitionSpec, a callable, or an object with
    ``as_tactic()``.

    Objects that know how to act as a tactic (such as
    :class:`nnx_shard.ShardingRule` instances) provide ``as_tactic()``.

    >>> str(as_tactic(PartitionSpec("fsdp")))
    "spec('fsdp')"
    """
    if isinstance(tactic, Tactic):
        return tactic
    if isinstance(tactic, str):
        return parse_tactic(tactic)
    if isinstance(tactic, PartitionSpec):
        return spec(*tactic)
    convert = getattr(tactic, "as_tactic", None)
    if callable(convert):
        return as_tactic(convert())
    if callable(tactic):
        return FunctionTactic(tactic)
    raise TacticArgumentError(
        f"expected a tactic string, a Tactic, a PartitionSpec, a ShardingRule or a callable; got {tactic!r}."
    )
