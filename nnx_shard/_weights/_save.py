"""A fine-tuned model written back in the file layout it was loaded from, by inverting the same key map."""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from nnx_shard._weights._file_views import DTYPES
from nnx_shard._weights._hf_folder import DEFAULT_SHARD_SIZE, write_folder, writes_through_storage
from nnx_shard._weights._keys import (
    Rule,
    file_shapes,
    host_value,
    key_rules,
    mismatches,
    model_leaves,
    targets_of,
)
from nnx_shard._weights._lora import find_adapters
from nnx_shard._weights._transforms import full_ops, invert
from nnx_shard.errors import WeightsMismatchError
from nnx_shard.key_maps import resolve_key_map

_TEMPLATE_INDEX = re.compile(r"^(.*)\[([\\\d,\s]+)\]$")  # a stacked target before expansion: w[\1, \2]
_GROUP = re.compile(r"\((?!\?)(?:[^()\\]|\\.)*\)")


def _file_names(regex: str, groups: dict[int, str]) -> str:
    """The name a simple regex matches with its groups set: ``model\\.layers\\.(\\d+)\\.w`` ->
    ``model.layers.3.w``."""
    k = iter(range(1, 100))

    def fill(m: re.Match[str]) -> str:
        n = next(k)
        if n not in groups:
            raise WeightsMismatchError(
                f"the regex {regex!r} has a group ({m.group(0)}) its target does not use, so the names it "
                f"exports are not known: pass like= (the source files)."
            )
        return groups[n]

    text = _GROUP.sub(fill, regex)
    return re.sub(r"\\(.)", r"\1", text).removeprefix("^").removesuffix("$")


@writes_through_storage
def save_safetensors(
    model: Any,
    path: str | os.PathLike[str],
    key_map: Sequence[Rule] | None = None,
    *,
    like: str | os.PathLike[str] | Sequence[str] | None = None,
    merge_lora: bool = True,
    lora_scale: float | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    skip: Sequence[str] = (),
    ignore: Sequence[str] = (),
) -> list[str]:
    """Writes ``model`` in the file layout ``key_map`` loaded it from, as Hugging Face lays a folder out.

    Each rule is inverted: transforms undone, ``split`` targets joined, stacked
    leaves unstacked. The file names and shapes come from ``like`` (the source
    files) when given, which the export then reproduces; without it from the
    rules' regexes with their groups filled in (simple regexes only), and a
    rule that relied on the implied reshape needs ``like``. Without
    ``key_map``, the map is chosen from ``like``'s ``config.json`` (its
    ``architectures``) or the model's class (see :mod:`nnx_shard.key_maps`).

    The folder is what ``transformers``' ``save_pretrained`` writes: files
    split at ``max_shard_size`` (``"5GB"`` as transformers; at least one per
    process, each writing its own), ``model.safetensors.index.json`` with
    ``metadata.total_size``, ``format: pt`` in each file's metadata, and
    ``config.json``, the generation and tokenizer files copied from ``like``
    when it is a folder, so ``from_pretrained(path)`` opens it as written.

    LoRA adapters (flax's, qwix's on ``nnx.Linear`` or ``nnx.Einsum`` kernels
    of any rank) are merged into their kernels as the library that made them
    computes them (``lora_scale`` overrides the scale: qwix's ``alpha / rank``,
    1.0 for flax's); ``merge_lora=False`` writes the base weights alone, and
    :func:`nnx_shard.save_peft_adapters` writes the adapters.

    Nothing is dropped: a model parameter no rule exports (unless ``skip``
    matches it) or, with ``like``, a source tensor left unwritten (unless
    ``ignore`` matches it) raises before any file is written.

    Returns:
      The files this process wrote.

    Raises:
      WeightsMismatchError: leaves or source tensors left out, targets the model
        lacks, or a layout that cannot be inverted.

    >>> import tempfile, numpy as np, nnx_shard as ns
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> rules = [(r"fc\\.weight", "kernel", "T"), (r"fc\\.bias", "bias")]
    >>> folder = tempfile.mkdtemp()
    >>> ns.save_safetensors(model, folder, rules)  # doctest: +ELLIPSIS
    ['.../model.safetensors']
    >>> again = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    >>> _ = ns.load_safetensors(again, folder, rules)
    >>> bool(np.array_equal(again.kernel.get_value(), model.kernel.get_value()))
    True
    """
    key_map, _ = resolve_key_map(key_map, model, like)
    leaves = model_leaves(model)
    values = {p: v.get_value() for p, v in leaves.items()}
    adapters = find_adapters(model, lora_scale) if merge_lora else {}
    shapes = file_shapes(like)
    merged: dict[str, np.ndarray] = {}

    def value(target: str) -> np.ndarray:
        if target not in merged:
            base = host_value(values[target])
            if target in adapters:
                ad = adapters[target]
                delta = ad.delta(host_value(values[ad.a]), host_value(values[ad.b])).reshape(base.shape)
                base = (base.astype(np.float32) + delta).astype(base.dtype)
            merged[target] = base
        return merged[target]

    rules = key_rules(key_map)
    names = list(shapes) if shapes else _names_from_rules(key_map, leaves)
    written: dict[str, np.ndarray] = {}
    used: dict[str, set[tuple[int, ...]]] = {}
    unwritten, problems = [], []
    for file_name in names:
        match = next(((m, outs) for regex, outs in rules if (m := regex.fullmatch(file_name))), None)
        if match is None:
            if not any(re.fullmatch(p, file_name) for p in ignore):
                unwritten.append(file_name)
            continue
        parts = []
        for target, index, ops in targets_of(*match):
            if target not in values:
                problems.append(f"{file_name} -> {target}: the model has no such leaf")
                continue
            used.setdefault(target, set()).add(index)
            parts.append((ops, value(target)[index] if index else value(target)))
        if len(parts) < len(match[1]):
            continue
        file_shape, file_dtype = shapes.get(file_name, (None, None))
        tensor = _join(file_name, parts, file_shape)
        written[file_name] = tensor.astype(DTYPES[file_dtype], copy=False) if file_dtype in DTYPES else tensor
    _check_complete(leaves, used, unwritten, problems, skip, adapters)
    return write_folder(path, written, like=like, max_shard_size=max_shard_size)


def _check_complete(
    leaves: dict[str, Any],
    used: dict[str, set[tuple[int, ...]]],
    unwritten: list[str],
    problems: list[str],
    skip: Sequence[str],
    adapters: dict[str, Any],
) -> None:
    """Raises when a parameter, a slice of a stacked one or a source tensor would be left out of the
    export."""
    merged_in = {p for ad in adapters.values() for p in (ad.a, ad.b)}
    missing = []
    for path, v in leaves.items():
        if not isinstance(v, nnx.Param) or isinstance(v, nnx.LoRAParam) or path in merged_in:
            continue
        if any(re.fullmatch(p, path) for p in skip):
            continue
        got = used.get(path)
        shape = tuple(v.get_value().shape)
        depth = len(next(iter(got))) if got else 0
        need = math.prod(shape[:depth]) if depth else 1
        if not got or len(got) < need:
            missing.append(f"{path} {shape}" + (f" ({len(got)} of {need} slices)" if got else ""))
    text = mismatches(
        [
            ("model parameters no rule exports (add a rule, or a skip= pattern)", missing),
            ("source tensors (like=) no rule writes (add a rule, or an ignore= pattern)", unwritten),
            ("tensors whose target is missing", problems),
        ]
    )
    if text:
        raise WeightsMismatchError("the export would drop weights; nothing was written." + text)


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
    """File tensor names for each model leaf a rule's template can produce (simple regexes only): a stacked
    target (``w[\\1]``) gives one name per slice of the leaf's leading axes, a list of targets (``split``) its
    first target's names."""
    names: list[str] = []
    for regex, outs in key_rules(key_map):
        template = outs[0][0]
        stacked = _TEMPLATE_INDEX.match(template)
        base, index = (
            (stacked.group(1), [x.strip() for x in stacked.group(2).split(",")])
            if stacked
            else (template, [])
        )
        if any(not re.fullmatch(r"\\\d", x) for x in index):
            raise WeightsMismatchError(
                f"the rule {regex.pattern!r} -> {template!r} indexes its target with {index}, not with "
                "groups "
                f"(\\1, \\2): pass like= (the source files) to name what it exports."
            )
        bits = re.split(r"\\(\d)", base)
        pattern = "".join(re.escape(b) if k % 2 == 0 else f"(?P<g{b}>[^/]+)" for k, b in enumerate(bits))
        for leaf in leaves:
            hit = re.fullmatch(pattern, leaf)
            if hit is None:
                continue
            groups = {int(k[1:]): v for k, v in hit.groupdict().items()}
            shape = leaves[leaf].get_value().shape
            for at in itertools.product(*(range(d) for d in shape[: len(index)])):
                groups.update({int(x[1:]): str(i) for x, i in zip(index, at, strict=True)})
                name = _file_names(regex.pattern, groups)
                if regex.fullmatch(name) is None:
                    raise WeightsMismatchError(
                        f"the rule {regex.pattern!r} is not simple enough to name the tensor of {leaf!r} "
                        f"(got {name!r}): pass like= (the source files)."
                    )
                names.append(name)
    return list(dict.fromkeys(names))
