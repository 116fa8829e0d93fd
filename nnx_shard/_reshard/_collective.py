"""The collective route: one SPMD program over the union of source and target devices.

Source and target partitions of an array meet in a common refinement, the
intermediate sharding whose block (the *piece*) divides both a source block
and a target block in every dimension. Each target device needs the pieces
of its block; it takes the ones it holds from its own source block and
receives each other one exactly once, from one holder, through
``jax.lax.ppermute``. Transfers are grouped by the piece's position in the
target block and, within a position, into permutations (each device sends
and receives at most one piece per permutation), so a position is a
``ppermute`` or a few, and the target block is the concatenation of its
positions. Bytes moved are exactly the bytes each target device lacks;
nothing is gathered and nothing leaves the devices.

The program is compiled once per signature (shape, dtype, source and target
sharding, number of stacked leaves), not per device, and runs on every device
of the union at once; devices outside the source get placeholder inputs and
devices outside the target return blocks that are dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from nnx_shard._base import Block, assemble, block_shape, blocks, cached, contains

AXIS = "nnx_shard_devices"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One piece: from the block of union device ``src`` at ``offset`` to union device ``dst`` at
    ``position``."""

    src: int
    offset: tuple[int, ...]
    dst: int
    position: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Position:
    """The pieces that fill one grid position of the target blocks: local copies, then permutations."""

    position: tuple[int, ...]
    local: tuple[Transfer, ...]
    permutations: tuple[tuple[Transfer, ...], ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Who sends which piece to whom, for one (shape, source sharding, target sharding).

    Attributes:
      union: the devices the program runs on (source and target, by id).
      src_block, dst_block: the shape of every source and target block.
      piece: the shape of the common refinement's block (the intermediate).
      grid: how many pieces a target block holds along each dimension.
      positions: per grid position, the transfers that fill it (when each
        position comes from at most two sources: the block is their concatenation).
      rounds: otherwise, rounds in which each device takes at most one local
        piece or receives at most one piece, each written in place into the
        target block (so no more than one piece is in flight at a time).
      remote: the number of pieces that cross from one device to another.
    """

    union: tuple[Any, ...]
    src_block: tuple[int, ...]
    dst_block: tuple[int, ...]
    piece: tuple[int, ...]
    grid: tuple[int, ...]
    positions: tuple[Position, ...]
    rounds: tuple[tuple[Transfer, ...], ...]
    remote: int

    @property
    def transfers(self) -> list[Transfer]:
        """Every transfer: the positions' local ones, their permutations', then the rounds'."""
        out = [t for p in self.positions for t in p.local]
        out += [t for p in self.positions for m in p.permutations for t in m]
        out += [t for r in self.rounds for t in r]
        return out

    @property
    def permutation_count(self) -> int:
        by_rounds = sum(1 for r in self.rounds if r and r[0].src != r[0].dst)
        return by_rounds or sum(len(p.permutations) for p in self.positions)


def _matchings(transfers: Sequence[Transfer]) -> list[list[Transfer]]:
    """Greedy rounds in which each device sends at most one piece and receives at most one."""
    rounds: list[list[Transfer]] = []
    for t in transfers:
        free = next((r for r in rounds if all(u.src != t.src and u.dst != t.dst for u in r)), None)
        if free is None:
            rounds.append([t])
        else:
            free.append(t)
    return rounds


def _uniform(block_map: dict[Any, Block]) -> tuple[int, ...] | None:
    shapes = {block_shape(b) for b in block_map.values()}
    return shapes.pop() if len(shapes) == 1 else None


@cached(maxsize=1024)
def build_schedule(shape: tuple[int, ...], src: Sharding, dst: Sharding) -> Schedule | None:
    """The collective schedule, or None when blocks differ in shape (uneven shardings) or the array is 0-d."""
    if not shape:
        return None
    src_blocks, dst_blocks = blocks(src, shape), blocks(dst, shape)
    sa, sb = _uniform(src_blocks), _uniform(dst_blocks)
    if sa is None or sb is None or 0 in sa:
        return None
    union = tuple(sorted(set(src_blocks) | set(dst_blocks), key=lambda d: d.id))
    index = {d: i for i, d in enumerate(union)}
    piece = tuple(math.gcd(a, b) for a, b in zip(sa, sb, strict=True))
    grid = tuple(b // p for b, p in zip(sb, piece, strict=True))
    load = dict.fromkeys(src_blocks, 0)
    by_position: dict[tuple[int, ...], tuple[list[Transfer], list[Transfer]]] = {}
    for d in sorted(dst_blocks, key=lambda d: index[d]):
        start = tuple(lo for lo, _ in dst_blocks[d])
        for q in itertools.product(*(range(k) for k in grid)):
            lo = tuple(s + i * p for s, i, p in zip(start, q, piece, strict=True))
            want = tuple((a, a + p) for a, p in zip(lo, piece, strict=True))
            if d in src_blocks and contains(src_blocks[d], want):
                h = d
            else:  # the least-loaded holder, so senders share the work
                h = min(
                    (h for h, b in src_blocks.items() if contains(b, want)), key=lambda h: (load[h], index[h])
                )
                load[h] += 1
            offset = tuple(a - s for a, (s, _) in zip(lo, src_blocks[h], strict=True))
            local, remote = by_position.setdefault(q, ([], []))
            (local if h == d else remote).append(Transfer(index[h], offset, index[d], q))
    positions = []
    for q, (local, remote) in sorted(by_position.items()):
        perms: list[list[Transfer]] = []
        for t in sorted(remote, key=lambda t: (t.offset, t.src)):
            free = next((p for p in perms if all(u.src != t.src for u in p)), None)
            if free is None:
                perms.append([t])
            else:
                free.append(t)
        positions.append(Position(q, tuple(local), tuple(tuple(p) for p in perms)))
    remote_count = sum(len(p) for pos in positions for p in pos.permutations)
    rounds: tuple[tuple[Transfer, ...], ...] = ()
    if any(bool(p.local) + len(p.permutations) > 2 for p in positions):
        # Many sources per position (a transposition): write pieces in place instead.
        local = [t for p in positions for t in p.local]
        remote = sorted(
            (t for p in positions for p in p.permutations for t in p), key=lambda t: (t.src, t.dst)
        )
        rounds = tuple(tuple(r) for r in _matchings(local) + _matchings(remote))
        positions = []
    return Schedule(union, sa, sb, piece, grid, tuple(positions), rounds, remote_count)


def line_sharding(devices: Sequence[Any]) -> NamedSharding:
    """Dimension 0 split over ``devices`` in their order, one block each: the layout of every program here."""
    return NamedSharding(Mesh(np.array(devices, dtype=object), (AXIS,)), PartitionSpec(AXIS))


def union_sharding(schedule: Schedule) -> NamedSharding:
    """The program's layout: dimension 0 split over the union devices, one block each."""
    return line_sharding(schedule.union)


def _table(values: dict[int, Any], n: int, default: Any) -> np.ndarray:
    return np.array([values.get(i, default) for i in range(n)], dtype=np.int32)


def _take(
    x: jax.Array, offsets: dict[int, tuple[int, ...]], schedule: Schedule, batch: tuple[int, ...]
) -> jax.Array:
    """(traced, per device) The piece at this device's offset in ``offsets`` of its source block."""
    piece, n = schedule.piece, len(schedule.union)
    if piece == schedule.src_block:
        return x
    distinct = set(offsets.values())
    if len(distinct) == 1:
        (off,) = distinct
        start = (0,) * len(batch) + off
        return jax.lax.slice(x, start, tuple(s + p for s, p in zip(start, batch + piece, strict=True)))
    me = jax.lax.axis_index(AXIS)
    table = jnp.asarray(_table(offsets, n, (0,) * len(piece)))
    start = (0,) * len(batch) + tuple(table[me, i] for i in range(len(piece)))
    return jax.lax.dynamic_slice(x, start, batch + piece)


def _in_place(x: jax.Array, schedule: Schedule, batch: tuple[int, ...]) -> jax.Array:
    """(traced, per device) The target block written round by round, one piece in flight."""
    piece, n = schedule.piece, len(schedule.union)
    me = jax.lax.axis_index(AXIS)
    out = jnp.zeros(batch + schedule.dst_block, x.dtype)
    for r in schedule.rounds:
        local = r[0].src == r[0].dst
        sent = _take(x, {t.dst if local else t.src: t.offset for t in r}, schedule, batch)
        got = sent if local else jax.lax.ppermute(sent, AXIS, [(t.src, t.dst) for t in r])
        places = {t.dst: tuple(q * p for q, p in zip(t.position, piece, strict=True)) for t in r}
        where = jnp.asarray(_table(places, n, (0,) * len(piece)))
        start = (0,) * len(batch) + tuple(where[me, i] for i in range(len(piece)))
        mine = jnp.asarray(np.array([i in {t.dst for t in r} for i in range(n)]))[me]
        kept = jax.lax.dynamic_slice(out, start, batch + piece)
        out = jax.lax.dynamic_update_slice(out, jnp.where(mine, got, kept), start)
    return out


def _program(schedule: Schedule, k: int) -> Any:
    """The per-device body: ``k`` source blocks in, ``k`` target blocks out."""
    n = len(schedule.union)
    batch = () if k == 1 else (k,)

    def take(x: jax.Array, offsets: dict[int, tuple[int, ...]]) -> jax.Array:
        return _take(x, offsets, schedule, batch)

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:
        x = xs[0] if k == 1 else jnp.stack(xs)
        if schedule.rounds:
            out = _in_place(x, schedule, batch)
            return (out,) if k == 1 else tuple(out[i] for i in range(k))
        values: dict[tuple[int, ...], jax.Array] = {}
        for pos in schedule.positions:
            candidates, owner = [], {}
            if pos.local:
                owner.update({t.dst: 0 for t in pos.local})
                candidates.append(take(x, {t.dst: t.offset for t in pos.local}))
            for perm in pos.permutations:
                owner.update({t.dst: len(candidates) for t in perm})
                sent = take(x, {t.src: t.offset for t in perm})
                candidates.append(jax.lax.ppermute(sent, AXIS, [(t.src, t.dst) for t in perm]))
            if len(candidates) == 1:
                values[pos.position] = candidates[0]
            else:  # each device takes the one candidate that carries its piece
                which = jnp.asarray(_table(owner, n, 0))[jax.lax.axis_index(AXIS)]
                values[pos.position] = jax.lax.select_n(which, *candidates)
        out = assemble(schedule.grid, values.__getitem__, len(batch))
        return (out,) if k == 1 else tuple(out[i] for i in range(k))

    return body


@cached(maxsize=256)
def compiled_program(
    shape: tuple[int, ...], src: Sharding, dst: Sharding, dtype: Any, k: int
) -> tuple[Any, int]:
    """The compiled program for ``k`` stacked leaves and the temp bytes per device XLA reports."""
    schedule = build_schedule(shape, src, dst)
    sharding = union_sharding(schedule)
    n = len(schedule.union)
    spec = PartitionSpec(AXIS)
    fn = jax.jit(
        jax.shard_map(
            _program(schedule, k),
            mesh=sharding.mesh,
            in_specs=(spec,) * k,
            out_specs=(spec,) * k,
            check_vma=False,
        )
    )
    aval = jax.ShapeDtypeStruct(
        (n * schedule.src_block[0], *schedule.src_block[1:]), dtype, sharding=sharding
    )
    with jax.set_mesh(sharding.mesh):  # the program's own mesh, whatever the caller set
        compiled = fn.lower(*([aval] * k)).compile()
    return compiled, int(compiled.memory_analysis().temp_size_in_bytes)


@cached(maxsize=64)
def _zeros_fn(shape: tuple[int, ...], dtype: Any, devices: tuple[Any, ...]) -> Any:
    sharding = line_sharding(devices)
    return jax.jit(lambda: jnp.zeros((len(devices) * shape[0], *shape[1:]), dtype), out_shardings=sharding)


def placeholders(shape: tuple[int, ...], dtype: Any, devices: Sequence[Any]) -> dict[Any, jax.Array]:
    """Zero blocks on ``devices`` (one program for all of them), standing in for source blocks they lack."""
    devices = tuple(d for d in devices if d.process_index == jax.process_index())
    if not devices:
        return {}
    out = _zeros_fn(tuple(shape), dtype, devices)()
    return {s.device: s.data for s in out.addressable_shards}


def run(inputs: Sequence[jax.Array], target: Sharding, fill: dict[Any, jax.Array]) -> list[jax.Array]:
    """Runs the program on ``inputs`` (one shape, dtype and sharding) and returns them on ``target``.

    ``fill`` holds placeholder blocks for the union devices outside the source.
    """
    x0 = inputs[0]
    shape = tuple(x0.shape)
    schedule = build_schedule(shape, x0.sharding, target)
    compiled, _ = compiled_program(shape, x0.sharding, target, x0.dtype, len(inputs))
    sharding = union_sharding(schedule)
    n = len(schedule.union)
    global_in = (n * schedule.src_block[0], *schedule.src_block[1:])
    mine = [d for d in schedule.union if d.process_index == jax.process_index()]
    args = []
    for x in inputs:
        held = {s.device: s.data for s in x.addressable_shards}
        args.append(
            jax.make_array_from_single_device_arrays(
                global_in, sharding, [held.get(d, fill.get(d)) for d in mine], dtype=x.dtype
            )
        )
    outs = compiled(*args)
    result = []
    for x, y in zip(inputs, outs, strict=True):
        by_device = {s.device: s.data for s in y.addressable_shards}
        result.append(
            jax.make_array_from_single_device_arrays(
                x.shape, target, [by_device[d] for d in target.addressable_devices], dtype=x.dtype
            )
        )
    return result
