"""Restoring the survivors of a lost process from in-memory snapshots, onto whatever mesh is left.

Every process of the new run reads only its own folder of the previous run (its own shards, and the copy
of one peer's). The processes agree on the newest step whose snapshots cover every process of the previous
run, each unpacks the pieces it serves (each checked against its share of the fingerprint), and every byte
a new shard needs is sent once, straight from the process that holds it, through one JAX ``all_to_all``
over one device per process: no process ever holds a whole array. The placed state is checked against the
fingerprints; anything that does not read or verify on any process makes every process return None, and
the caller falls back to a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._base import Block, block_of_shard, intersect, relative
from nnx_shard._checkpoint import leaf_paths, map_leaves, storable, tree_fingerprints
from nnx_shard._cluster import all_to_all, gather_json
from nnx_shard._snapshots._file import Header, unpack

logger = logging.getLogger("nnx_shard")


@dataclasses.dataclass
class Restored:
    """A state read from snapshots: the states (onto the live shardings), its step, each old process's data
    state."""

    states: dict[str, Any]
    step: int
    data_states: list[Any]


def held(folder: Path | None) -> dict[int, dict[int, Path]]:
    """``{step: {previous process: file}}`` of the complete snapshots in ``folder`` (a process's own)."""
    out: dict[int, dict[int, Path]] = {}
    if folder is None or not folder.is_dir():
        return out
    me = int(folder.name.split("-")[1])
    for step_dir in folder.glob("step-*"):
        step = int(step_dir.name.split("-")[1])
        files = {me: step_dir / "own.bin"} if (step_dir / "own.bin").exists() else {}
        for peer in step_dir.glob("peer-*.bin"):
            files[int(peer.stem.split("-")[1])] = peer
        out[step] = files
    return out


def choose(holdings: list[list[list[int]]], previous: int, after: int) -> tuple[int | None, dict[int, int]]:
    """The newest step after ``after`` whose snapshots cover all ``previous`` processes, and who serves each.

    ``holdings[q]`` lists ``[step, old process, own]`` for new process ``q``;
    a process's own copy is preferred to a peer's copy of it.

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
    """``(server, new process, piece number, piece box, overlap)`` of every block a new shard needs, in one
    order every process computes alike."""
    regions: dict[str, list[tuple[int, Block]]] = {}
    for path, x in targets.items():
        seen = set()
        for device, index in x.sharding.devices_indices_map(x.shape).items():
            key = (device.process_index, block_of_shard(index, x.shape))
            if key not in seen:
                seen.add(key)
                regions.setdefault(path, []).append(key)
    for k, (server, path, box) in enumerate(pieces):
        piece = tuple(tuple(b) for b in box)
        for q, region in sorted(regions.get(path, [])):
            common = intersect(piece, region)
            if common is not None:
                yield server, q, k, piece, common


def _read(files: list[Path], step: int) -> tuple[list[Header], dict[tuple[str, str], np.ndarray]]:
    headers, pieces = [], {}
    for f in files:
        header, data = unpack(np.fromfile(f, np.uint8))
        if header.step != step:
            raise ValueError(f"{f} holds step {header.step}, not {step}")
        headers.append(header)
        pieces.update(data)
    return headers, pieces


def restore_from_snapshots(
    folder: Path | None, previous: int, target: dict[str, Any], *, after: int
) -> Restored | None:
    """The newest snapshot state after step ``after``, placed onto ``target``'s shardings; None when there is
    none, or when any piece does not read or verify (every process returns the same). A collective.

    Args:
      folder: this process's own folder of the previous run (None for a process new to the job).
      previous: how many processes the previous run had.
      target: the live states (their shardings and structure; not changed).
      after: the newest persistent checkpoint's step: older snapshots are not used.
    """
    me = jax.process_index()
    files = held(folder)
    rows = [
        [s, old, int(folder is not None and old == int(folder.name.split("-")[1]))]
        for s, by_old in files.items()
        for old in by_old
    ]
    step, serves = choose(gather_json(rows, site="snapshot.read.held"), previous, after)
    if step is None:
        logger.info("no complete snapshot newer than step %d: restoring from a checkpoint", after)
        return None
    mine = sorted(old for old, q in serves.items() if q == me)
    problem = ""
    try:
        headers, pieces = _read([files[step][old] for old in mine], step)
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        headers, pieces, problem = [], {}, f"process {me}: {e}"
    if _failed(problem, "snapshot.read.problems", step, "does not read"):
        return None
    shared = gather_json(
        {
            "pieces": [[me, path, json.loads(index)] for path, index in pieces],
            "shares": [[p.path, p.share] for h in headers for p in h.pieces],
            "data": {str(h.process): h.data_state for h in headers},
        },
        site="snapshot.read.catalogue",
        step=step,
    )
    catalogue = [p for s in shared for p in s["pieces"]]
    data = {int(k): v for s in shared for k, v in s["data"].items()}
    sums: dict[str, int] = {}  # each array's fingerprint: the shares of its pieces, every process's once
    for path, share in (row for s in shared for row in s["shares"]):
        sums[path] = (sums.get(path, 0) + share) % 2**32
    wanted = {path: f"{total:08x}" for path, total in sums.items()}
    states, keys = storable(target)
    targets = {p: x for p, x in leaf_paths(states).items() if isinstance(x, jax.Array)}
    blocks = _exchange(catalogue, list(pieces.values()), targets)
    try:
        placed, problem = {path: _place(path, x, blocks.get(path, [])) for path, x in targets.items()}, ""
    except ValueError as e:
        placed, problem = {}, f"process {me}: {e}"
    if _failed(problem, "snapshot.read.placed", step, "is incomplete"):
        return None
    restored = map_leaves(lambda path, v: placed.get(path.removesuffix("/value"), v), states)
    if tree_fingerprints(restored) != {p: wanted.get(p) for p in placed}:
        logger.warning(
            "the snapshot of step %d does not match its fingerprints: restoring from a checkpoint", step
        )
        return None
    restored = map_leaves(
        lambda path, v: jax.random.wrap_key_data(v, impl=keys[path]) if path in keys else v, restored
    )
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
    """``{leaf path: [(box, data), ...]}``: the blocks this process's new shards need, its own cut locally and
    the others' received, each sent once by the process holding it through one ``all_to_all``."""
    me = jax.process_index()
    first = next((k for k, p in enumerate(catalogue) if p[0] == me), 0)  # where ``local`` starts in it
    outgoing: list[list[bytes]] = [[] for _ in range(jax.process_count())]
    blocks: dict[str, list[tuple[Block, np.ndarray]]] = {}
    moves = list(_moves(catalogue, targets))
    for server, q, k, piece, common in moves:
        if server == me:
            part = np.array(local[k - first][relative(common, piece)], order="C")
            if q == me:
                blocks.setdefault(catalogue[k][1], []).append((common, part))
            else:
                outgoing[q].append(part.tobytes())
    received = all_to_all([b"".join(c) for c in outgoing], site="snapshot.read.pieces")
    at = [0] * len(received)
    for server, q, k, _, common in moves:
        if q == me and server != me:
            x = targets[catalogue[k][1]]
            shape = [hi - lo for lo, hi in common]
            n = int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
            raw = received[server][at[server] : at[server] + n]
            at[server] += n
            blocks.setdefault(catalogue[k][1], []).append((common, raw.view(x.dtype).reshape(shape)))
    return blocks


def _place(path: str, x: jax.Array, blocks: list[tuple[Block, np.ndarray]]) -> jax.Array:
    """``x``'s shards for this process's devices, each filled from the blocks (of ``path``) inside it."""
    parts = {}
    per_device = []
    for device, index in x.sharding.addressable_devices_indices_map(x.shape).items():
        region = block_of_shard(index, x.shape)
        if region not in parts:
            out = np.empty([hi - lo for lo, hi in region], x.dtype)
            filled = 0
            for common, data in blocks:
                if intersect(common, region) == common:
                    out[relative(common, region)] = data
                    filled += data.size
            if filled != out.size:
                raise ValueError(f"snapshot pieces cover {filled} of {out.size} elements of {path} {region}")
            parts[region] = out
        per_device.append(jax.device_put(parts[region], device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, per_device)
