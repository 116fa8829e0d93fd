"""The names of a pretrained weight's key map: its rules compiled, a matched name's targets, the files and
leaves.

Shared by the loader, the exporter and the PEFT adapters (``_safetensors``,
``_safetensors_export``, ``_peft``).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from nnx_shard._base import as_state, check_model, flatten_with_paths, is_graph_object
from nnx_shard._weights._transforms import Op, parse
from nnx_shard.errors import WeightsMismatchError
from nnx_shard.key_maps import Rule  # the one definition of a key-map rule

STACK_INDEX = re.compile(r"^(.*)\[([\d,\s]+)\]$")


def resolve_files(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """A path, a glob, a list, or a folder (with Hugging Face's ``model.safetensors.index.json``, or not)."""
    if isinstance(files, (str, os.PathLike)):
        path = Path(files)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                return _indexed(path, index)
            found = sorted(str(p) for p in path.glob("*.safetensors"))
        else:
            found = sorted(glob.glob(str(path))) if any(c in str(path) for c in "*?[") else [str(path)]
    else:
        found = [str(f) for f in files]
    missing = [f for f in found if not Path(f).is_file()]
    if not found or missing:
        raise WeightsMismatchError(
            f"no safetensors files at {files!r}{f' (missing: {missing})' if missing else ''}; pass a file, a "
            f"glob, a list, or a folder holding *.safetensors (with model.safetensors.index.json)."
        )
    return found


def _indexed(folder: Path, index: Path) -> list[str]:
    """The files ``model.safetensors.index.json`` names, each a plain name inside ``folder`` (checked before
    any is opened: an index is data, and may not point elsewhere on the disk)."""
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, OSError, KeyError, TypeError, AttributeError) as e:
        raise WeightsMismatchError(f"{index} is not an index with a weight_map of file names: {e!r}") from e
    outside = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]
    if outside:
        raise WeightsMismatchError(
            f"{index} names files outside its folder: {outside[:5]}; an index's weight_map holds plain file "
            f"names of that folder (model-00001-of-00002.safetensors). Nothing was opened."
        )
    return [str(folder / n) for n in names]


def key_rules(key_map: Sequence[Rule]) -> list[tuple[re.Pattern[str], list[tuple[str, tuple[Op, ...]]]]]:
    out = []
    for rule in key_map:
        if not isinstance(rule, (tuple, list)) or len(rule) not in (2, 3):
            raise WeightsMismatchError(
                f"a key map rule is (regex, target) or (regex, target, transform), or (regex, "
                f"[(target, transform), ...]); got {rule!r}."
            )
        pattern, target = rule[0], rule[1]
        transform = rule[2] if len(rule) == 3 else None
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise WeightsMismatchError(f"key map regex {pattern!r} does not compile: {e}") from e
        pairs = [(target, transform)] if isinstance(target, str) else list(target)
        out.append((regex, [(t, parse(tr)) for t, tr in pairs]))
    return out


def targets_of(
    m: re.Match[str], outs: list[tuple[str, tuple[Op, ...]]]
) -> list[tuple[str, tuple[int, ...], Any]]:
    """``(leaf path, stacked index, ops)`` of each target a matched rule fills (``layers[\\1]`` -> index)."""
    out = []
    for template, ops in outs:
        target, index = m.expand(template), ()
        if (hit := STACK_INDEX.match(target)) is not None:
            target, index = hit.group(1), tuple(int(x) for x in hit.group(2).split(","))
        out.append((target, index, ops))
    return out


def model_leaves(model: Any) -> dict[str, Any]:
    """``{path: Variable}`` of a model (or state); EmptyStateError when it has no parameter to fill."""
    if is_graph_object(model):
        check_model(model)
    state = as_state(model)[0]
    return {p.removesuffix("/value"): v for p, v in flatten_with_paths(state)[0]}


def host_value(x: Any) -> np.ndarray:
    """A leaf's whole value on this host (a collective when it spans processes)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def file_shapes(like: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape, safetensors dtype)}`` of the source files (empty without them)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in resolve_files(like) if like is not None else []:
        with safe_open(f, framework="numpy") as h:
            for k in h.keys():
                s = h.get_slice(k)
                shapes[k] = (tuple(s.get_shape()), s.get_dtype())
    return shapes


def mismatches(groups: Sequence[tuple[str, list[str]]], first: int = 5) -> str:
    """Each non-empty group of problems as a count and its first few, one line each (empty when none).

    >>> print(mismatches([("leaves nothing fills", ["a (2,)"]), ("tensors no rule maps", [])]))
    <BLANKLINE>
    1 leaves nothing fills:
      a (2,)
    >>> print(mismatches([("tensors", [f"t{i}" for i in range(8)])], first=2))
    <BLANKLINE>
    8 tensors:
      t0
      t1
      ... and 6 more
    """
    out = []
    for what, items in groups:
        if items:
            out.append(f"{len(items)} {what}:")
            out += [f"  {item}" for item in items[:first]]
            if len(items) > first:
                out.append(f"  ... and {len(items) - first} more")
    return "".join(f"\n{line}" for line in out)
