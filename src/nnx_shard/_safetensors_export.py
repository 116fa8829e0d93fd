"""A fine-tuned model written back in the file layout it was loaded from, by inverting the same key map."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from nnx_shard._errors import WeightsMismatchError
from nnx_shard._safetensors import STACK_INDEX, Rule, key_rules, model_leaves, resolve_files, targets_of
from nnx_shard._weight_transforms import full_ops, invert

# safetensors' dtype names -> NumPy's (an export reproduces the source files' dtypes)
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
_GROUP = re.compile(r"\((?!\?)(?:[^()\\]|\\.)*\)")


def lora_pairs(paths: Sequence[str]) -> dict[str, tuple[str, str]]:
    """``{base kernel: (lora_a, lora_b)}`` for flax's ``nnx.LoRALinear`` (``x/kernel``, ``x/lora/lora_a``),
    ``nnx.LoRA(base_module=...)`` (``x/base_module/kernel``, ``x/lora_a``) and qwix (``x/kernel_lora_a``).

    >>> lora_pairs(["q/kernel", "q/lora/lora_a", "q/lora/lora_b"])
    {'q/kernel': ('q/lora/lora_a', 'q/lora/lora_b')}
    """
    have, out = set(paths), {}
    for a in paths:
        if not a.endswith("lora_a"):
            continue
        b = a[: -len("lora_a")] + "lora_b"
        stem = a[: -len("lora_a")].rstrip("_/")
        parent = stem.removesuffix("lora").rstrip("/") if stem.split("/")[-1] == "lora" else None
        join = lambda *parts: "/".join(x for x in parts if x)
        candidates = [join(stem, "base_module", "kernel"), stem]
        if parent is not None:
            candidates.insert(0, join(parent, "kernel"))
        for base in candidates:
            if base in have and b in have and base != a:
                out[base] = (a, b)
                break
    return out


def _host(x: Any) -> np.ndarray:
    """A leaf's whole value on this host (a collective when it spans processes)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _file_names(regex: str, groups: dict[int, str]) -> str:
    """The name a simple regex matches with its groups set: ``model\\.layers\\.(\\d+)\\.w`` -> ``model.layers.3.w``."""
    k = iter(range(1, 100))
    text = _GROUP.sub(lambda m: groups[next(k)], regex)
    return re.sub(r"\\(.)", r"\1", text).removeprefix("^").removesuffix("$")


def save_safetensors(
    model: Any,
    path: str | os.PathLike[str],
    key_map: Sequence[Rule],
    *,
    like: str | os.PathLike[str] | Sequence[str] | None = None,
    merge_lora: bool = True,
    lora_scale: float = 1.0,
) -> list[str]:
    """Writes ``model`` in the file layout ``key_map`` loaded it from, and returns the files written.

    Each rule is inverted: transforms undone, ``split`` targets joined, stacked
    leaves unstacked. The file names and shapes come from ``like`` (the source
    files) when given, which the export then reproduces; without it from the
    rules' regexes with their groups filled in (simple regexes only), and a
    rule that relied on the implied reshape needs ``like``. LoRA adapters are
    merged into their base kernels (``kernel + lora_scale * a @ b``; flax's
    LoRA has no scale, qwix's is ``alpha / rank``), or only the adapters are
    written under their model paths (``merge_lora=False``). Each process writes
    the tensors assigned to it, and process 0 ``model.safetensors.index.json``.

    >>> import tempfile, numpy as np, nnx_shard as ns
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> rules = [(r"fc\\.weight", "kernel", "T"), (r"fc\\.bias", "bias")]
    >>> folder = tempfile.mkdtemp()
    >>> ns.save_safetensors(model, folder, rules)  # doctest: +ELLIPSIS
    ['.../model-00001-of-00001.safetensors']
    >>> again = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    >>> _ = ns.load_safetensors(again, folder, rules)
    >>> bool(np.array_equal(again.kernel.get_value(), model.kernel.get_value()))
    True
    """
    from safetensors.numpy import save_file

    leaves = model_leaves(model)
    values = {p: v.get_value() for p, v in leaves.items()}
    pairs = lora_pairs(list(values))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    n, me = jax.process_count(), jax.process_index()
    name = f"model-{me + 1:05d}-of-{n:05d}.safetensors"
    if not merge_lora:
        adapters = [p for pair in pairs.values() for p in pair]
        tensors = {p: _host(values[p]) for p in adapters}
        save_file({p: t for k, (p, t) in enumerate(tensors.items()) if k % n == me}, str(out / name))
        _index(out, {p: f"model-{k % n + 1:05d}-of-{n:05d}.safetensors" for k, p in enumerate(tensors)})
        return [str(out / name)]
    shapes = _file_shapes(like)
    merged: dict[str, np.ndarray] = {}

    def value(target: str) -> np.ndarray:
        if target not in merged:
            base = _host(values[target])
            if target in pairs:
                a, b = (_host(values[p]).astype(np.float32) for p in pairs[target])
                base = (base.astype(np.float32) + lora_scale * (a @ b)).astype(base.dtype)
            merged[target] = base
        return merged[target]

    rules = key_rules(key_map)
    names = list(shapes) if shapes else _names_from_rules(key_map, leaves)
    written: dict[str, np.ndarray] = {}
    for file_name in names:
        match = next(((m, outs) for regex, outs in rules if (m := regex.fullmatch(file_name))), None)
        if match is None:
            continue
        parts = []
        for target, index, ops in targets_of(*match):
            if target not in values:
                raise WeightsMismatchError(f"{file_name} maps to {target}, which the model lacks.")
            part = value(target)[index] if index else value(target)
            parts.append((ops, part))
        file_shape, file_dtype = shapes.get(file_name, (None, None))
        tensor = _join(file_name, parts, file_shape)
        written[file_name] = (
            tensor.astype(_DTYPES[file_dtype], copy=False) if file_dtype in _DTYPES else tensor
        )
    mine = {k: t for j, (k, t) in enumerate(written.items()) if j % n == me}
    save_file(mine, str(out / name))
    _index(out, {k: f"model-{j % n + 1:05d}-of-{n:05d}.safetensors" for j, k in enumerate(written)})
    return [str(out / name)]


def _file_shapes(like: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape, safetensors dtype)}`` of the source files (empty without them)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in resolve_files(like) if like is not None else []:
        with safe_open(f, framework="numpy") as h:
            for k in h.keys():
                s = h.get_slice(k)
                shapes[k] = (tuple(s.get_shape()), s.get_dtype())
    return shapes


def _join(
    file_name: str, parts: list[tuple[Any, np.ndarray]], file_shape: tuple[int, ...] | None
) -> np.ndarray:
    """The file tensor from its target parts: each transform undone; parts of a ``split`` concatenated, in
    the file's axes when the split comes first, in the targets' when it comes last."""
    ops0 = parts[0][0]
    splits = [k for k, op in enumerate(ops0) if op.name == "split"]
    if len(parts) == 1 and not splits:
        return np.ascontiguousarray(_undo(file_name, ops0, parts[0][1], file_shape))
    if len(splits) != 1 or splits[0] not in (0, len(ops0) - 1):
        raise WeightsMismatchError(
            f"{file_name}: an export joins parts split by one split(...) at the start or the end of the "
            f"transform; got {' | '.join(map(str, ops0))}."
        )
    axis, n, _ = ops0[splits[0]].args
    if splits[0] == 0:  # split the file tensor, then transform each part
        block = (
            None
            if file_shape is None
            else tuple(d // n if a == axis else d for a, d in enumerate(file_shape))
        )
        pieces = [_undo(file_name, ops[1:], part, block) for ops, part in parts]
        return np.ascontiguousarray(np.concatenate(pieces, axis=axis))
    whole = np.concatenate([part for _, part in parts], axis=axis)  # transform, then split
    return np.ascontiguousarray(_undo(file_name, ops0[:-1], whole, file_shape))


def _undo(
    file_name: str, ops: Sequence[Any], value: np.ndarray, file_shape: tuple[int, ...] | None
) -> np.ndarray:
    if file_shape is None:
        if any(op.name == "reshape" for op in ops):
            raise WeightsMismatchError(
                f"{file_name}'s rule reshapes, so its file shape is not known: pass like= (the source files)."
            )
        return invert(ops, _shape_before(ops, value.shape), value)
    return invert(full_ops(ops, file_shape, value.shape), file_shape, value)


def _shape_before(ops: Sequence[Any], shape: tuple[int, ...]) -> tuple[int, ...]:
    for op in reversed(ops):
        shape = tuple(shape[k] for k in np.argsort(op.args))
    return shape


def _names_from_rules(key_map: Sequence[Rule], leaves: dict[str, Any]) -> list[str]:
    """File tensor names for each model leaf a rule's template can produce (simple regexes only)."""
    names = []
    for regex, outs in key_rules(key_map):
        template = outs[0][0]
        if STACK_INDEX.match(template) or len(outs) > 1:
            raise WeightsMismatchError(
                f"the rule {regex.pattern!r} -> {template!r} stacks or splits, so its file names are not known: "
                f"pass like= (the source files)."
            )
        bits = re.split(r"\\(\d)", template)
        pattern = "".join(re.escape(b) if k % 2 == 0 else f"(?P<g{b}>[^/]+)" for k, b in enumerate(bits))
        for leaf in leaves:
            hit = re.fullmatch(pattern, leaf)
            if hit is not None:
                names.append(_file_names(regex.pattern, {int(k[1:]): v for k, v in hit.groupdict().items()}))
    return names


def _index(folder: Path, weight_map: dict[str, str]) -> None:
    if jax.process_index() == 0:
        text = json.dumps({"metadata": {"format": "nnx_shard"}, "weight_map": weight_map}, indent=1)
        (folder / "model.safetensors.index.json").write_text(text)
