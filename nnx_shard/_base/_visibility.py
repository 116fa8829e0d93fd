"""What ``nnx.state`` can see of a model: Variables it would miss are found, repaired or named before anything
compiles.

Flax makes a Module a pytree unless its class says ``pytree=False``. qwix's
``apply_lora_to_model`` swaps a model's class for a subclass of it, and Flax
makes that subclass a pytree even when the original was not (google-tunix's
``Llama3``): the instance's attributes were never registered as pytree data, so
``nnx.state`` sees none of them. :func:`reveal` finds such objects; the qwix
case is repaired in place (the subclass is made again with ``pytree=False``,
keeping qwix's intercepted call), anything else is named in an
:class:`~nnx_shard.EmptyStateError` with the fix.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from nnx_shard.errors import EmptyStateError, EmptyStateKind

log = logging.getLogger("nnx_shard")
_VISIBLE = "_nnx_shard_visible_class"  # on a qwix-made class: its pytree=False twin


def _is_pytree_object(x: Any) -> bool:
    return isinstance(x, nnx.Pytree) and not isinstance(x, nnx.Variable)


def _children(obj: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """``(attribute, path, value)`` for each attribute of ``obj`` that is or holds Modules or Variables."""
    items = vars(obj).items() if _is_pytree_object(obj) else ()
    for name, value in items:
        if name.startswith("_pytree__"):
            continue
        yield name, f"{path}/{name}".lstrip("/"), value


def _holds_variables(value: Any, seen: set[int]) -> bool:
    if isinstance(value, nnx.Variable):
        return True
    if id(value) in seen:
        return False
    if _is_pytree_object(value):
        seen.add(id(value))
        return any(_holds_variables(v, seen) for _, _, v in _children(value, ""))
    if isinstance(value, (list, tuple)):
        return any(_holds_variables(v, seen) for v in value)
    if isinstance(value, dict):
        return any(_holds_variables(v, seen) for v in value.values())
    return False


def _qwix_twin(cls: type) -> type | None:
    """The ``pytree=False`` twin of a class qwix made from a ``pytree=False`` Module (None for any other)."""
    original = cls.__dict__.get("_unquantized_type")
    if original is None or getattr(original, "_pytree__is_pytree", True) or not cls._pytree__is_pytree:
        return None
    twin = cls.__dict__.get(_VISIBLE)
    if twin is None:
        twin = types.new_class(cls.__name__, (cls,), {"pytree": False})
        twin.__module__, twin.__qualname__ = cls.__module__, cls.__qualname__
        setattr(cls, _VISIBLE, twin)
    return twin


def reveal(obj: Any) -> list[str]:
    """Repairs the objects of ``obj``'s graph that qwix made invisible; returns the paths of Variables
    ``nnx.state`` still cannot see (attributes of pytree Modules never registered as data).

    >>> class Base(nnx.Module, pytree=False):
    ...     def __init__(self):
    ...         self.w = nnx.Param(jax.numpy.ones(2))
    >>> model = Base()
    >>> model.__class__ = type("Swapped", (Base,), {})  # Flax makes the subclass a pytree
    >>> reveal(model), len(nnx.state(model))
    (['w'], 0)
    >>> reveal(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    []
    """
    hidden: list[str] = []
    repaired: list[str] = []
    seen: set[int] = set()

    def visit(value: Any, path: str) -> None:
        if isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                visit(v, f"{path}/{k}".lstrip("/"))
            return
        if isinstance(value, dict):
            for k, v in value.items():
                visit(v, f"{path}/{k}".lstrip("/"))
            return
        if not _is_pytree_object(value) or id(value) in seen:
            return
        seen.add(id(value))
        twin = _qwix_twin(type(value))
        if twin is not None:
            value.__class__ = twin
            repaired.append(path or type(value).__name__)
        pytree = type(value)._pytree__is_pytree
        nodes = getattr(value, "_pytree__nodes", {}) if pytree else {}
        for name, child_path, child in _children(value, path):
            if pytree and not nodes.get(name, False) and _holds_variables(child, set()):
                hidden.append(child_path)
                continue
            visit(child, child_path)

    visit(obj, "")
    if repaired:
        log.info(
            "made %d qwix-wrapped Module(s) visible to nnx.state (pytree=False, as their original "
            "classes): %s",
            len(repaired),
            repaired[:4],
        )
    return hidden


def raise_hidden(hidden: list[str], what: str) -> None:
    raise EmptyStateError(
        EmptyStateKind.HIDDEN_VARIABLES,
        f"the {what} holds Variables that nnx.state does not see: {hidden[:8]}"
        f"{' ...' if len(hidden) > 8 else ''}. Their Module is a pytree (Flax's default) whose "
        f"attributes were set around Flax's bookkeeping (e.g. its class was swapped after creation). "
        f"Create the class with `pytree=False`, or assign the attributes as `self.x = nnx.data(...)`.",
    )


def check_model(model: Any, *, what: str = "model", wrt: Any = None) -> None:
    """Raises :class:`EmptyStateError` when ``model`` has nothing to place or train, naming which case.

    Hidden Variables come first (their fix differs), then a state with no
    ``nnx.Param``, then a ``wrt`` filter that selects none of them.

    >>> check_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), wrt=nnx.LoRAParam)
    Traceback (most recent call last):
    ...
    nnx_shard.errors.EmptyStateError: wrt=LoRAParam selects none of the model's 2 parameters...
    """
    if hidden := reveal(model):
        raise_hidden(hidden, what)
    state = nnx.state(model)
    params = [v for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    if not any(isinstance(v, nnx.Param) for v in params):
        raise EmptyStateError(
            EmptyStateKind.NO_PARAMETERS,
            f"the {what} ({type(model).__name__}) holds no nnx.Param: nnx.state sees "
            f"{len(params)} Variable(s) and nothing to place or train. Pass the model itself (not a "
            f"function or a state of another object), and create its weights as nnx.Param.",
        )
    if wrt is not None:
        selected = jax.tree.leaves(nnx.state(model, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable))
        if not selected:
            n = sum(isinstance(v, nnx.Param) for v in params)
            raise EmptyStateError(
                EmptyStateKind.WRT_SELECTS_NOTHING,
                f"wrt={getattr(wrt, '__name__', wrt)!s} selects none of the {what}'s {n} parameters: nothing "
                f"would train. Use wrt=nnx.Param to train them all, or add the adapters (e.g. qwix's "
                f"apply_lora_to_model, nnx.LoRA) before creating the optimizer.",
            )
