"""A folder of safetensors laid out as Hugging Face's ``save_pretrained`` lays it out, so ``from_pretrained``
opens it.

Files are split at ``max_shard_size`` (transformers' default, 5 GB) in
transformers' names (``model.safetensors`` alone, else
``model-00001-of-00003.safetensors``), each with ``format: pt`` in its
metadata; ``model.safetensors.index.json`` maps every tensor to its file and
gives ``metadata.total_size``; ``config.json`` and the generation and
tokenizer files are copied from the source folder. With several processes,
each writes its own files (at least one each) and process 0 the index.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nnx_shard._base import storage
from nnx_shard.errors import WeightsMismatchError

DEFAULT_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
INDEX = "model.safetensors.index.json"
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB``, ``500MiB`` or an int, as transformers reads ``max_shard_size``.

    >>> parse_size("5GB"), parse_size("2MiB"), parse_size(100)
    (5000000000, 2097152, 100)
    """
    if isinstance(size, int) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise WeightsMismatchError(
            "max_shard_size takes a positive number of bytes or a size such as '5GB' or '500MiB'; got "
            f"{size!r}."
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def split_by_size(tensors: dict[str, np.ndarray], limit: int, at_least: int = 1) -> list[list[str]]:
    """Tensor names grouped into files of at most ``limit`` bytes in order (a larger tensor alone), at
    least ``at_least`` files while there are tensors to spread.

    >>> split_by_size({"a": np.zeros(4, np.uint8), "b": np.zeros(4, np.uint8), "c": np.zeros(9, np.uint8)}, 8)
    [['a', 'b'], ['c']]
    """
    groups: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        if not groups or (size + t.nbytes > limit and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += t.nbytes
    if len(groups) < at_least <= len(tensors):  # one file per process at least: contiguous, even by count
        names = list(tensors)
        groups = [list(part) for part in np.array_split(np.array(names, dtype=object), at_least)]
    return groups or [[]]


def file_names(count: int, prefix: str = "model") -> list[str]:
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def through_storage(
    path: str | os.PathLike[str], like: Any, write: Callable[[str, Any], list[str]]
) -> list[str]:
    """``write(folder, like)`` on local folders: a URI ``path`` (``gs://...``) is written to a local folder
    first and uploaded, a URI ``like`` fetched first; returns the written files' names where they end."""
    with contextlib.ExitStack() as stack:
        if isinstance(like, (str, os.PathLike)) and storage.is_uri(like):
            like = stack.enter_context(storage.fetched_folder(like))
        if not storage.is_uri(path):
            return write(os.fspath(path), like)
        local = stack.enter_context(storage.staged_folder(path))
        return [storage.uri_of(f, local, path) for f in write(local, like)]


def writes_through_storage(write: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """Lets an export ``write(model, path, key_map=None, *, like=None, **options)`` take URIs for ``path`` and
    ``like`` (see :func:`through_storage`); local paths go straight to it."""

    @functools.wraps(write)
    def exported(
        model: Any, path: Any, key_map: Any = None, *, like: Any = None, **options: Any
    ) -> list[str]:
        if not storage.is_uri(path) and not (isinstance(like, (str, os.PathLike)) and storage.is_uri(like)):
            return write(model, path, key_map, like=like, **options)
        return through_storage(
            path, like, lambda folder, source: write(model, folder, key_map, like=source, **options)
        )

    return exported


def copy_side_files(like: Any, out: Path) -> list[str]:
    """Copies config.json and the generation and tokenizer files from a source folder (process 0 only)."""
    if like is None or isinstance(like, (list, tuple)) or not Path(like).is_dir():
        return []
    copied = []
    for name in SIDE_FILES:
        src = Path(like) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            if jax.process_index() == 0:
                shutil.copyfile(src, out / name)
            copied.append(name)
    return copied


def write_folder(
    path: str | os.PathLike[str],
    tensors: dict[str, np.ndarray],
    *,
    like: str | os.PathLike[str] | Sequence[str] | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    prefix: str = "model",
    index: bool = True,
) -> list[str]:
    """Writes ``tensors`` (the same on every process) as a Hugging Face folder; returns this process's
    files."""
    from safetensors.numpy import save_file

    limit = parse_size(max_shard_size)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    n, me = jax.process_count(), jax.process_index()
    groups = split_by_size(tensors, limit, at_least=n)
    names = file_names(len(groups), prefix)
    mine = []
    for k, (name, group) in enumerate(zip(names, groups, strict=True)):
        if k % n == me:
            save_file({t: tensors[t] for t in group}, str(out / name), metadata={"format": "pt"})
            mine.append(str(out / name))
    if index and me == 0:
        weight_map = {t: name for name, group in zip(names, groups, strict=True) for t in group}
        total = sum(int(t.nbytes) for t in tensors.values())
        text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        (out / f"{prefix}.safetensors.index.json").write_text(text + "\n")
    copy_side_files(like, out)
    return mine
