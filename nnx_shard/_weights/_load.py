"""Pretrained safetensors weights streamed into a live sharded NNX model: each process reads only its shards'
bytes.

A key map is an ordered list of ``(regex over file tensor names, target,
transform)`` rules, first match wins, like the sharding rules. The target is
a path template using the regex's groups (``layers/\\1/mlp/up/kernel``); one
ending in ``[\\1]`` (or ``[\\1, \\2]``) fills those indices of a stacked
leaf's leading axes. A rule may give a list of ``(target, transform)`` pairs
instead (``split(0, 3, i)`` takes one third of a fused qkv tensor each).
Every leaf is rebuilt with ``jax.make_array_from_callback`` on its own
sharding: a device's callback takes only the part of each file tensor under
its shard (see ``_transforms``), as a view of the file's memory map
(``_file_views``), and the transfer copies it once, transposed where the map
says so, from the file's pages into the shard.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnx_shard._base import Block, block_of_shard, storage
from nnx_shard._weights._file_views import file_views
from nnx_shard._weights._keys import Rule, key_rules, mismatches, model_leaves, resolve_files, targets_of
from nnx_shard._weights._peft import is_peft_folder, load_peft_adapters
from nnx_shard._weights._transforms import Op, aligned_empty, apply, copy_tiled, full_ops, source_box
from nnx_shard.errors import WeightsMismatchError
from nnx_shard.key_maps import check_model_config, resolve_key_map


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What :func:`load_safetensors` did.

    ``bytes_read`` is what this process read from the files; ``bytes_needed``
    what its devices hold of the loaded leaves (in the files' dtypes): equal
    when no byte is read twice.

    >>> print(LoadReport(3, 2_000_000, 2_000_000, 0.5, ("cast 1 tensor",)))
    loaded 3 tensors: 2.0 MB read of 2.0 MB needed in 0.500 s (0.00 GB/s); cast 1 tensor
    """

    tensors: int
    bytes_read: int
    bytes_needed: int
    seconds: float
    notes: tuple[str, ...] = ()

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        text = (
            f"loaded {self.tensors} tensors: {self.bytes_read / 1e6:.1f} MB read of "
            f"{self.bytes_needed / 1e6:.1f} MB needed in {self.seconds:.3f} s ({self.gb_per_s:.2f} GB/s)"
        )
        return text + "".join(f"; {n}" for n in self.notes)


#: How ``ignore=`` and ``skip=`` match, said wherever a pattern matched nothing.
PATTERNS = (
    "ignore= and skip= patterns must match a whole tensor name or leaf path (re.fullmatch): "
    "r'lm_head\\..*', not r'^lm_head\\.'"
)
_THREADS = min(4, os.cpu_count() or 1)  # leaves made at once
_AHEAD = 256 * 2**20  # the most bytes of leaves made at once on this process (a larger leaf is made alone)


@dataclasses.dataclass(frozen=True)
class _Fill:
    file: str
    name: str
    index: tuple[int, ...]  # of a stacked leaf's leading axes
    ops: tuple[Op, ...]
    file_shape: tuple[int, ...]


def _required(variable: Any) -> bool:
    """Pretrained files fill parameters and batch statistics; LoRA adapters and RNG state stay as created."""
    return isinstance(variable, (nnx.Param, nnx.BatchStat)) and not isinstance(variable, nnx.LoRAParam)


def plan_fills(
    headers: dict[str, dict[str, tuple[int, ...]]],
    leaves: dict[str, Any],
    key_map: Sequence[Rule],
    skip: Sequence[str],
    ignore: Sequence[str],
    strict: bool,
) -> tuple[dict[str, list[_Fill]], list[str]]:
    """``{leaf path: fills}`` and notes; WeightsMismatchError listing every problem before anything is
    written."""
    rules = key_rules(key_map)
    fills: dict[str, list[_Fill]] = {}
    unmapped, problems, ignored = [], [], 0
    used = {p: False for p in (*ignore, *skip)}
    for file, tensors in headers.items():
        for name, shape in tensors.items():
            match = next(((m, outs, regex) for regex, outs in rules if (m := regex.fullmatch(name))), None)
            if match is None:
                hit = [p for p in ignore if re.fullmatch(p, name)]
                used.update(dict.fromkeys(hit, True))
                if hit:
                    ignored += 1
                else:
                    unmapped.append(f"{name} {tuple(shape)}")
                continue
            m, outs, regex = match
            for target, index, ops in targets_of(m, outs):
                if target not in leaves:
                    problems.append(f"{name} {tuple(shape)} -> {target}: the model has no such leaf")
                    continue
                full = tuple(leaves[target].get_value().shape)
                try:
                    done = full_ops(ops, shape, full[len(index) :])
                except WeightsMismatchError as e:
                    problems.append(
                        f"{name} -> {target}{list(index) if index else ''} (rule r'{regex.pattern}'): {e}"
                    )
                    continue
                if any(not 0 <= i < d for i, d in zip(index, full, strict=False)):
                    problems.append(f"{name} -> {target}{list(index)}: index outside {full}")
                    continue
                fills.setdefault(target, []).append(_Fill(file, name, index, done, tuple(shape)))
    unfilled, skipping = _unfilled(leaves, fills, skip)
    used.update(dict.fromkeys(skipping, True))
    idle = [f"{'ignore' if p in ignore else 'skip'}={p!r}" for p, hit in used.items() if not hit]
    if strict and (unmapped or unfilled or problems):
        text = mismatches(
            [
                ("file tensors no key map rule maps (add a rule, or an ignore= pattern)", unmapped),
                ("model parameters no file tensor fills (add a rule, or a skip= pattern)", unfilled),
                ("tensors that do not fit their target", problems),
                (f"patterns that matched nothing ({PATTERNS})", idle),
            ]
        )
        raise WeightsMismatchError("the pretrained weights do not fit the model; nothing was written." + text)
    notes = [f"{ignored} file tensors ignored"] if ignored else []
    notes += [f"{p} matched nothing ({PATTERNS})" for p in idle]
    lora = sum(isinstance(v, nnx.LoRAParam) for v in leaves.values())
    if lora:
        notes.append(f"{lora} LoRA parameters left as created")
    return fills, notes


def _unfilled(
    leaves: dict[str, Any], fills: dict[str, list[_Fill]], skip: Sequence[str]
) -> tuple[list[str], set[str]]:
    """The required leaves no fill covers whole, and the ``skip`` patterns that matched a leaf."""
    out, matched = [], set()
    for path, v in leaves.items():
        hit = {p for p in skip if re.fullmatch(p, path)}
        matched |= hit
        if not _required(v) or hit:
            continue
        got = fills.get(path, [])
        depth = len(got[0].index) if got else 0
        need = math.prod(v.get_value().shape[:depth]) if depth else 1
        if len({f.index for f in got}) < need:
            out.append(
                f"{path} {tuple(v.get_value().shape)}" + (f" ({len(got)} of {need} filled)" if got else "")
            )
    return out, matched


def load_safetensors(
    model: Any,
    files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    key_map: Sequence[Rule] | None = None,
    *,
    skip: Sequence[str] = (),
    ignore: Sequence[str] = (),
    strict: bool = True,
) -> LoadReport:
    """Writes pretrained tensors into a live sharded NNX module (or state) in place, keeping every sharding.

    Args:
      model: an ``nnx.Module`` (or ``nnx.State``) already placed, e.g. by
        :func:`nnx_shard.create_sharded` or a Trainer.
      files: a path, a glob, a list, or a folder with ``model.safetensors.index.json``.
      key_map: ordered ``(regex over file tensor names, target path template, transform)``
        rules; the first that matches a name wins. Without it, the map shipped for
        the folder's ``config.json`` architecture, or for the model's class
        (google-tunix's Llama 3, Qwen 2 and 3: :mod:`nnx_shard.key_maps`), named in
        the report. A PEFT folder (``adapter_config.json``) loads into the
        model's LoRA adapters (flax's or qwix's) through the same map. The transform (optional) chains
        ``T``, ``transpose(...)``, ``reshape(...)`` and ``split(axis, n, i)`` with
        ``|``; a tensor whose element count then matches its target is reshaped to it.
      skip: regexes of model leaves that no file fills on purpose.
      ignore: regexes of file tensors to leave out.
      strict: with False, mismatches are left out instead of raising.

    Returns:
      A :class:`LoadReport`.

    Raises:
      WeightsMismatchError: file tensors no rule maps, parameters nothing fills, or
        shapes that do not fit, all listed, before any value is written.

    >>> import tempfile, numpy as np, jax, nnx_shard as ns
    >>> from flax import nnx
    >>> from safetensors.numpy import save_file
    >>> folder = tempfile.mkdtemp()
    >>> w = np.arange(6, dtype=np.float32).reshape(3, 2)  # (out, in), as PyTorch stores it
    >>> save_file({"fc.weight": w, "fc.bias": np.ones(3, np.float32)}, f"{folder}/model.safetensors")
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> report = ns.load_safetensors(model, folder, [(r"fc\\.weight", "kernel", "T"), (r"fc\\.bias", "bias")])
    >>> np.asarray(model.kernel.get_value()).tolist(), report.tensors
    ([[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]], 2)
    """
    from safetensors import SafetensorError, safe_open

    if isinstance(files, (str, os.PathLike)) and storage.is_uri(files):  # safetensors maps local files
        with storage.fetched_folder(files) as local:
            return load_safetensors(model, local, key_map, skip=skip, ignore=ignore, strict=strict)
    start = time.perf_counter()
    key_map, chosen = resolve_key_map(key_map, model, files)
    if is_peft_folder(files):
        count, peft_notes = load_peft_adapters(model, files, key_map)
        notes = ["PEFT adapters", *([chosen] if chosen else []), *peft_notes]
        return LoadReport(count, 0, 0, time.perf_counter() - start, tuple(notes))
    if isinstance(files, (str, os.PathLike)):
        check_model_config(model, files)  # a tunix model built unlike the checkpoint: named, nothing read
    paths = resolve_files(files)
    leaves = model_leaves(model)
    counts = [0, 0]  # bytes read, bytes the shards need (in the files' dtypes)
    casts: set[str] = set()
    over: list[str] = []  # leaves whose shards read more bytes than they hold
    with contextlib.ExitStack() as stack:
        handles = {}
        headers: dict[str, dict[str, tuple[int, ...]]] = {}
        for p in paths:
            try:
                handles[p] = stack.enter_context(safe_open(p, framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise WeightsMismatchError(f"{p} is not a readable safetensors file: {e}") from e
            headers[p] = {k: tuple(handles[p].get_slice(k).get_shape()) for k in handles[p].keys()}
        views = {p: file_views(p) for p in paths}
        fills, notes = plan_fills(headers, leaves, key_map, skip, ignore, strict)
        # Leaves are made by a few threads at once (the transfers' copies let go of the GIL) and set in order
        # as they come; a leaf joins those under way only while they hold at most _AHEAD bytes here together,
        # so new values live beside their old ones for one leaf or _AHEAD bytes at most.
        pending: collections.deque[tuple[str, int, Future]] = collections.deque()

        def settle() -> None:
            path, _, future = pending.popleft()
            new, (read, held, cast) = future.result()
            leaves[path].set_value(new)  # in place: the old value is freed here
            counts[0] += read
            counts[1] += held
            casts.update(cast)
            if read > held:
                over.append(path)

        x64 = bool(jax.config.jax_enable_x64)  # the caller's: maybe a `with jax.enable_x64()` of its thread
        with ThreadPoolExecutor(_THREADS, thread_name_prefix="nnx-shard-load") as pool:
            for path, group in fills.items():
                x = leaves[path].get_value()
                size = _local_bytes(x)
                while pending and (len(pending) >= _THREADS or size + sum(n for _, n, _ in pending) > _AHEAD):
                    settle()
                pending.append((path, size, pool.submit(_make_leaf, x, group, handles, views, x64)))
            while pending:
                settle()
    notes = [*([chosen] if chosen else []), *notes, *_read_notes(casts, over, counts[0] - counts[1])]
    tensors = sum(len(g) for g in fills.values())
    return LoadReport(tensors, counts[0], counts[1], time.perf_counter() - start, tuple(notes))


def _read_notes(casts: set[str], over: list[str], extra: int) -> list[str]:
    """The report's notes on the values read: casts, and bytes read beyond what the shards hold (and why)."""
    notes = ["cast " + ", ".join(sorted(casts))] if casts else []
    if over:
        notes.append(
            f"read {extra:,} bytes more than the shards hold, for {len(over)} leaves (first {over[0]}): a "
            f"reshape in their rule splits the sharded axis, so a shard reads whole units of it"
        )
    return notes


def _make_leaf(
    x: Any, group: list[_Fill], handles: dict, views: dict, x64: bool
) -> tuple[jax.Array, tuple[int, int, set]]:
    """Leaf ``x`` made anew from its file tensors on its own sharding, with the bytes read, the bytes its
    blocks hold in the files' dtypes and the casts made; each distinct block is read once."""
    blocks: dict[Block, np.ndarray] = {}
    tally = [0, 0, set()]

    def shard(index: Any) -> np.ndarray:
        box = block_of_shard(index, x.shape)
        if box not in blocks:
            blocks[box] = _fill_box(box, x, group, handles, views, tally)
        return blocks[box]

    with jax.enable_x64(x64):
        return jax.make_array_from_callback(x.shape, x.sharding, shard), tuple(tally)


def _local_bytes(x: Any) -> int:
    """The bytes of ``x``'s distinct blocks on this process's devices."""
    boxes = {block_of_shard(i, x.shape) for i in x.sharding.addressable_devices_indices_map(x.shape).values()}
    return sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * x.dtype.itemsize


def _fill_box(box: Block, x: Any, group: list[_Fill], handles: dict, views: dict, tally: list) -> np.ndarray:
    """The block ``box`` of leaf ``x`` from the file tensors that fill it, each read only where it overlaps.

    A block filled by one tensor is returned as a view of the file where it is one in another layout: the
    transfer to the device copies it once, transposing in tiles (numpy's own copy of a transposed view
    reads a cache line per element). A block in the file's layout is copied into memory the device can
    take without a second copy (a CPU device keeps a 64-byte-aligned buffer as it is)."""
    out = None  # allocated only when several tensors fill the block
    for fill in group:
        depth = len(fill.index)
        if any(not lo <= i < hi for i, (lo, hi) in zip(fill.index, box, strict=False)):
            continue
        want = box[depth:]
        src = source_box(fill.ops, fill.file_shape, want)
        cut = tuple(slice(lo, hi) for lo, hi in src)
        view = views[fill.file].get(fill.name)
        data = view[cut] if view is not None else _fill_copy(handles[fill.file], fill.name, cut)
        piece = apply(fill.ops, fill.file_shape, data, src, want)
        tally[0] += data.nbytes
        tally[1] += piece.size * data.itemsize
        if piece.dtype != x.dtype:
            tally[2].add(f"{piece.dtype} -> {x.dtype}")
        if not fill.index and len(group) == 1:  # the whole block: no copy into ``out``
            if not piece.flags.c_contiguous:  # the transfer transposes it (no device can keep it as it is)
                return piece.astype(x.dtype, copy=False)
            if view is None and piece.dtype == x.dtype:  # already a copy of its own
                return piece
        if out is None:
            out = aligned_empty([hi - lo for lo, hi in box], x.dtype)
        copy_tiled(out[tuple(i - lo for i, (lo, _) in zip(fill.index, box, strict=False))], piece)
    if out is None:
        raise WeightsMismatchError(f"no file tensor fills the block {box} of a {x.shape} leaf")
    return out


def _fill_copy(handle: Any, name: str, cut: tuple[slice, ...]) -> np.ndarray:
    """A copy of part of a tensor whose dtype NumPy does not know, through safetensors itself."""
    return np.asarray(handle.get_slice(name)[cut])
