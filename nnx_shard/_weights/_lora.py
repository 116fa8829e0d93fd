"""LoRA adapters as the library that made them records them: which kernel each pair updates, how, and by how
much.

Three forms are found: flax's ``nnx.LoRALinear`` (``x/kernel`` with
``x/lora/lora_a``), ``nnx.LoRA(base_module=...)`` (``x/base_module/kernel``
with ``x/lora_a``) and qwix's ``apply_lora_to_model`` (``x/w`` with
``x/w_lora_a``). For qwix the contraction is the one qwix recorded: the
einsum it stored on the module (``w_lora_einsum_str``) for ``nnx.Einsum``
kernels of any rank, ``(..., in, r) @ (..., r, out)`` for ``dot_general``;
and the scale is its rule's ``alpha / rank``, read from the provider the
model's class was made with. Flax's LoRA has no scale (1.0).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
from flax import nnx

from nnx_shard._base import flatten_with_paths, is_graph_object
from nnx_shard.errors import WeightsMismatchError


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One LoRA pair: ``kernel += scale * einsum(equation, a, b)``, in the kernel's own layout.

    >>> ad = Adapter("q/kernel", "q/lora/lora_a", "q/lora/lora_b", "ir,ro->io", 2.0, "flax")
    >>> ad.delta(np.ones((3, 1)), np.ones((1, 2))).tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """

    base: str
    a: str
    b: str
    equation: str  # a's letters (rank last), b's (rank first) -> the kernel's
    scale: float
    source: str  # "flax" or "qwix"

    def delta(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.scale * np.einsum(self.equation, a.astype(np.float32), b.astype(np.float32))


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _flax_pairs(paths: set[str]) -> dict[str, tuple[str, str]]:
    """``{base kernel: (lora_a, lora_b)}`` for flax's two forms, from paths alone."""
    out = {}
    for a in sorted(paths):
        if not a.endswith("lora_a") or a.endswith("_lora_a"):
            continue
        b = a[: -len("lora_a")] + "lora_b"
        stem = a[: -len("lora_a")].rstrip("/")
        candidates = [_join(stem, "base_module", "kernel"), stem]
        if stem.split("/")[-1] == "lora":
            candidates.insert(0, _join(stem.removesuffix("lora").rstrip("/"), "kernel"))
        for base in candidates:
            if base in paths and b in paths and base != a:
                out[base] = (a, b)
                break
    return out


def _interleave(a: str, b: str, a_shape: tuple, b_shape: tuple, kernel: tuple) -> list[str]:
    """The orders of the kernel's letters (``a``'s and ``b``'s, each in its own order) that fit its shape."""
    size = dict(zip(a, a_shape, strict=True)) | dict(zip(b, b_shape, strict=True))
    n = len(a) + len(b)
    out = []
    for where in itertools.combinations(range(n), len(a)):
        letters, ia, ib = [], iter(a), iter(b)
        for k in range(n):
            letters.append(next(ia) if k in where else next(ib))
        if tuple(size[c] for c in letters) == tuple(kernel):
            out.append("".join(letters))
    return out


def _qwix_equation(module: Any, name: str, a: Any, b: Any, kernel: Any) -> str:
    """The einsum from ``a`` and ``b`` to the kernel's layout, from what qwix recorded for ``name``."""
    recorded = getattr(module, f"{name}_lora_einsum_str", None)
    if recorded is None:  # dot_general: a (*batch, prod(contract), r), b (*batch, r, prod(remain))
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] * b.shape[1] != int(np.prod(kernel.shape)):
            raise WeightsMismatchError(
                f"qwix adapter {name}_lora_a {a.shape} / {name}_lora_b {b.shape} of a {kernel.shape} kernel: "
                f"only unbatched dot_general adapters (nnx.Linear, LinearGeneral over leading axes) and "
                f"einsum adapters can be merged."
            )
        return "ir,ro->io"
    lhs = recorded.split("->")[0]
    _, a_str, b_str = lhs.split(",")
    a_letters, b_letters = a_str[:-1], b_str[1:]
    own = getattr(module, "einsum_str", None)
    if isinstance(own, str) and "->" in own and own.count(",") == 1:
        kernel_letters = own.split("->")[0].split(",")[1].strip()
        if sorted(kernel_letters) == sorted(a_letters + b_letters):
            return f"{a_str},{b_str}->{kernel_letters}"
    orders = _interleave(a_letters, b_letters, a.shape[:-1], b.shape[1:], kernel.shape)
    if len(orders) != 1:
        raise WeightsMismatchError(
            f"the qwix adapter of {name} ({recorded}) fits its {kernel.shape} kernel in {len(orders)} ways; "
            f"give the Module an einsum_str attribute ('lhs,rhs->out') naming the kernel's axes."
        )
    return f"{a_str},{b_str}->{orders[0]}"


def _closure_objects(fn: Any, depth: int = 0) -> Iterator[Any]:
    """Objects reachable from a function's closure, partials and wrappers (a few levels deep)."""
    if depth > 6 or fn is None:
        return
    if isinstance(fn, functools.partial):
        yield from fn.args
        yield from fn.keywords.values()
        yield from _closure_objects(fn.func, depth + 1)
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield value
        if callable(value):
            yield from _closure_objects(value, depth + 1)
    yield from _closure_objects(getattr(fn, "__wrapped__", None), depth + 1)


def _qwix_rules(model: Any) -> list[Any] | None:
    """The rules of the qwix provider ``model``'s class was made with (None when not made by qwix)."""
    for cls in type(model).__mro__:
        if "_unquantized_type" not in cls.__dict__:
            continue
        for attr in cls.__dict__.values():
            for obj in _closure_objects(attr):
                rules = getattr(obj, "_rules", None)
                if isinstance(rules, list) and type(obj).__name__.endswith("Provider"):
                    return rules
    return None


def _qwix_scale(rules: list[Any] | None, module: Any, op: str, rank: int, name: str) -> float | None:
    """``alpha / rank`` of the first rule qwix matches for ``module`` and ``op`` (as qwix looks it up)."""
    if rules is None:
        return None
    path = "/".join(map(str, getattr(module, "qwix_path", ())))
    for rule in rules:
        names = getattr(rule, "op_names", ())
        if re.fullmatch(rule.module_path, path) and (not names or op in names):
            alpha = getattr(rule, "alpha", None)
            return None if alpha is None else float(alpha) / rank
    return None


def find_adapters(model: Any, lora_scale: float | None = None) -> dict[str, Adapter]:
    """``{base kernel path: Adapter}`` of every LoRA pair in ``model`` (a Module, or a State: flax forms
    only).

    ``lora_scale`` overrides every scale; without it qwix's ``alpha / rank``
    is used, and 1.0 for flax's LoRA (which has none).

    >>> found = find_adapters(nnx.LoRALinear(4, 3, lora_rank=2, rngs=nnx.Rngs(0)))
    >>> found["kernel"].a, found["kernel"].equation, found["kernel"].scale
    ('lora/lora_a', 'ir,ro->io', 1.0)
    """
    if not is_graph_object(model):
        paths = {p.removesuffix("/value") for p, _ in flatten_with_paths(model)[0]}
        return {
            base: Adapter(base, a, b, "ir,ro->io", 1.0 if lora_scale is None else lora_scale, "flax")
            for base, (a, b) in _flax_pairs(paths).items()
        }
    rules = _qwix_rules(model)
    out: dict[str, Adapter] = {}
    paths: set[str] = set()
    for path, node in nnx.iter_graph(model):
        prefix = "/".join(map(str, path))
        if isinstance(node, nnx.Variable):
            paths.add(prefix)
            continue
        if not isinstance(node, nnx.Module):
            continue
        for attr, value in vars(node).items():
            if not (attr.endswith("_lora_a") and isinstance(value, nnx.Variable)):
                continue
            name = attr.removesuffix("_lora_a")
            kernel, b = getattr(node, name, None), getattr(node, f"{name}_lora_b", None)
            if not isinstance(kernel, nnx.Variable) or not isinstance(b, nnx.Variable):
                continue
            a_val, b_val, k_val = value.get_value(), b.get_value(), kernel.get_value()
            equation = _qwix_equation(node, name, a_val, b_val, k_val)
            op = "einsum" if hasattr(node, f"{name}_lora_einsum_str") else "dot_general"
            scale = lora_scale
            if scale is None:
                scale = _qwix_scale(rules, node, op, a_val.shape[-1], name)
            if scale is None:
                raise WeightsMismatchError(
                    f"the qwix adapter of {_join(prefix, name)} has no rule to read its alpha from (the "
                    "model "
                    "was not made by qwix's apply_lora_to_model in this process): pass "
                    "lora_scale=alpha/rank."
                )
            base = _join(prefix, name)
            out[base] = Adapter(base, f"{base}_lora_a", f"{base}_lora_b", equation, scale, "qwix")
    for base, (a, b) in _flax_pairs(paths).items():
        out.setdefault(
            base, Adapter(base, a, b, "ir,ro->io", 1.0 if lora_scale is None else lora_scale, "flax")
        )
    return out
