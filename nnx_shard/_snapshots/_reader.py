"""Restoring from in-memory snapshots onto whatever mesh is left: each process reads its own folder, every
byte a new shard needs is sent once from its holder through one JAX ``all_to_all``, and the state is checked
against the fingerprints; a failure on any process makes every process return None."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nnx_shard._base import Block, block_of_shard, intersect, relative
from nnx_shard._checkpoint import leaf_paths, map_leaves, storable, tree_fingerprints
from nnx_shard._cluster import all_to_all, gather_json
from nnx_shard._snapshots._file import unpack

logger = logging.getLogger("nnx_shard")


@dataclasses.dataclass
class Restored:
    """A state read from snapshots (on the live shardings), its step, each old process's data state."""

    states: dict[str, Any]
    step: int
    data_states: list[Any]


def held(folder: Path | None) -> dict[int, dict[int, Path]]:
    """``{step: {previous process: file}}`` of the complete snapshots in ``folder`` (a process's own)."""
    if folder is None or not folder.is_dir():
        return {}
    me, out = int(folder.name.split("-")[1]), {}
    for step_dir in folder.glob("step-*"):
        files = {int(p.stem.split("-")[1]): p for p in step_dir.glob("peer-*.bin")}
        if (step_dir / "own.bin").exists():
            files[me] = step_dir / "own.bin"
        out[int(step_dir.name.split("-")[1])] = files
    return out


def choose(holdings: list[list[list[int]]], previous: int, after: int) -> tuple[int | None, dict[int, int]]:
    """The newest step after ``after`` whose snapshots cover all ``previous`` processes, and who serves each
    (``holdings[q]``: ``[step, old process, own]`` of new process ``q``; an own copy preferred).

    >>> choose([[[5, 0, 1], [5, 1, 0]], [[4, 1, 1]]], previous=2, after=3)
    (5, {0: 0, 1: 0})
    >>> choose([[[5, 0, 1]], [[4, 1, 1]]], previous=2, after=3)
    (None, {})
    """
    by_step: dict[int, dict[int, tuple[int, int]]] = {}
    for q, rows in enumerate(holdings):
        for step, old, own in rows:
            best = by_step.setdefault(step, {}).get(old)
            if best is None or (own, -q) > best:
                by_step[step][old] = (own, -q)
    for step in sorted(by_step, reverse=True):
        if step > after and set(by_step[step]) >= set(range(previous)):
            return step, {old: -by_step[step][old][1] for old in range(previous)}
    return None, {}


def _moves(pieces: list[list[Any]], targets: dict[str, Any]) -> Iterator[tuple[int, int, int, Block, Block]]:
    """``(server, new process, piece number, piece box, overlap)`` of each block a new shard needs, alike."""
    regions: dict[str, set[tuple[int, Block]]] = {}
    for path, x in targets.items():
        for device, index in x.sharding.devices_indices_map(x.shape).items():
            regions.setdefault(path, set()).add((device.process_index, block_of_shard(index, x.shape)))
    for k, (server, path, box) in enumerate(pieces):
        piece = tuple(tuple(b) for b in box)
        for q, region in sorted(regions.get(path, [])):
            if (common := intersect(piece, region)) is not None:
                yield server, q, k, piece, common


def restore_from_snapshots(
    folder: Path | None, previous: int, target: dict[str, Any], *, after: int
) -> Restored | None:
    """The newest snapshot state after step ``after`` (the newest checkpoint's), placed onto ``target``'s
    shardings from this process's ``folder`` of the previous run of ``previous`` processes (None: new to
    the job); None when there is none or any piece fails to read or verify, on every process alike."""
    me, files = jax.process_index(), held(folder)
    own = int(folder.name.split("-")[1]) if folder is not None else -1
    rows = [[s, old, int(old == own)] for s, by_old in files.items() for old in by_old]
    step, serves = choose(gather_json(rows, site="snapshot.read.held"), previous, after)
    if step is None:
        logger.info("no complete snapshot newer than step %d: restoring from a checkpoint", after)
        return None
    headers, pieces, problem = [], {}, ""
    try:
        for old in sorted(old for old, q in serves.items() if q == me):
            header, data = unpack(np.fromfile(files[step][old], np.uint8))
            if header.step != step:
                raise ValueError(f"{files[step][old]} holds step {header.step}, not {step}")
            headers.append(header)
            pieces.update(data)
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        problem = f"process {me}: {e}"
    if _failed(problem, "snapshot.read.problems", step, "does not read"):
        return None
    mine = {
        "pieces": [[me, path, json.loads(index)] for path, index in pieces],
        "shares": [[p.path, p.share] for h in headers for p in h.pieces],
        "data": {str(h.process): h.data_state for h in headers},
    }
    shared = gather_json(mine, site="snapshot.read.catalogue", step=step)
    sums: dict[str, int] = {}  # each array's fingerprint: the shares of its pieces, every process's once
    for path, share in (row for s in shared for row in s["shares"]):
        sums[path] = (sums.get(path, 0) + share) % 2**32
    states, keys = storable(target)
    targets = {p: x for p, x in leaf_paths(states).items() if isinstance(x, jax.Array)}
    blocks = _exchange([p for s in shared for p in s["pieces"]], list(pieces.values()), targets)
    try:
        placed, problem = {path: _place(path, x, blocks.get(path, [])) for path, x in targets.items()}, ""
    except ValueError as e:
        placed, problem = {}, f"process {me}: {e}"
    if _failed(problem, "snapshot.read.placed", step, "is incomplete"):
        return None
    restored = map_leaves(lambda path, v: placed.get(path.removesuffix("/value"), v), states)
    if tree_fingerprints(restored) != {p: f"{sums[p]:08x}" if p in sums else None for p in placed}:
        logger.warning(
            "the snapshot of step %d does not match its fingerprints: restoring a checkpoint", step
        )
        return None
    restored = map_leaves(
        lambda p, v: jax.random.wrap_key_data(v, impl=keys[p]) if p in keys else v, restored
    )
    data = {int(k): v for s in shared for k, v in s["data"].items()}
    return Restored(restored, step, [data.get(old) for old in range(previous)])


def _failed(problem: str, site: str, step: int, what: str) -> bool:
    """Whether any process has a ``problem`` (a collective: every process answers the same), logged."""
    problems = [p for p in gather_json(problem, site=site, step=step) if p]
    if problems:
        logger.warning("the snapshot of step %d %s (%s): restoring from a checkpoint", step, what, problems)
    return bool(problems)


def _exchange(
    catalogue: list[list[Any]], local: list[np.ndarray], targets: dict[str, Any]
) -> dict[str, list]:
    """``{leaf path: [(box, data), ...]}``: the blocks this process's new shards need, its own cut here and
    the others' received through one ``all_to_all``."""
    me = jax.process_index()
    first = next((k for k, p in enumerate(catalogue) if p[0] == me), 0)  # where ``local`` starts in it
    outgoing: list[list[bytes]] = [[] for _ in range(jax.process_count())]
    blocks: dict[str, list[tuple[Block, np.ndarray]]] = {}
    moves = list(_moves(catalogue, targets))
    for _, q, k, piece, common in (m for m in moves if m[0] == me):
        part = np.array(local[k - first][relative(common, piece)], order="C")
        if q == me:
            blocks.setdefault(catalogue[k][1], []).append((common, part))
        else:
            outgoing[q].append(part.tobytes())
    received = all_to_all([b"".join(c) for c in outgoing], site="snapshot.read.pieces")
    at = [0] * len(received)
    for server, _, k, _, common in (m for m in moves if m[1] == me and m[0] != me):
        dtype, shape = targets[catalogue[k][1]].dtype, [hi - lo for lo, hi in common]
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw, at[server] = received[server][at[server] : at[server] + n], at[server] + n
        blocks.setdefault(catalogue[k][1], []).append((common, raw.view(dtype).reshape(shape)))
    return blocks


def _place(path: str, x: jax.Array, blocks: list[tuple[Block, np.ndarray]]) -> jax.Array:
    """``x``'s shards for this process's devices, each filled from the blocks (of ``path``) inside it."""
    parts, per_device = {}, []
    for device, index in x.sharding.addressable_devices_indices_map(x.shape).items():
        region = block_of_shard(index, x.shape)
        if region not in parts:
            out, filled = np.empty([hi - lo for lo, hi in region], x.dtype), 0
            for common, data in blocks:
                if intersect(common, region) == common:
                    out[relative(common, region)] = data
                    filled += data.size
            if filled != out.size:
                raise ValueError(f"snapshot pieces cover {filled} of {out.size} elements of {path} {region}")
            parts[region] = out
        per_device.append(jax.device_put(parts[region], device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, per_device)
