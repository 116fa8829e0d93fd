"""The copy route: pieces sliced on their holders, copied device to device once, assembled on their targets.

The same schedule as the collective route (the common refinement of source
and target blocks, each piece a target device lacks sent once), run in three
steps that each touch only the devices they need: one program over the
source devices cuts the pieces out of their blocks (skipped when a piece is a
whole block), one batched ``jax.device_put`` copies every piece to its target
device, and one program over the target devices concatenates each block's
pieces (skipped when a block is one piece). On the CPU backend, where every
device's memory is the host's, a piece that no caller holds changes device
by aliasing its buffer instead of copying it: each moved byte is then copied
once (cut or assembled), not twice. Nothing runs on a device outside
the source or target, so nothing is computed or allocated there; transfers
must stay within the process (across processes the collective route runs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from nnx_shard._base import assemble, cached
from nnx_shard._reshard._collective import AXIS, Schedule, Transfer, build_schedule, line_sharding


def within_process(schedule: Schedule) -> bool:
    """True when every piece moves between devices of one process (device_put can copy it)."""
    union = schedule.union
    return all(union[t.src].process_index == union[t.dst].process_index for t in schedule.transfers)


def _mesh(devices: list[Any]) -> NamedSharding:
    return line_sharding(sorted(devices, key=lambda d: d.id))


@cached(maxsize=256)
def _plan(shape: tuple[int, ...], src: Sharding, dst: Sharding) -> dict[str, Any]:
    """Rounds of slices per source device, and which round's piece fills each (target, position)."""
    schedule = build_schedule(shape, src, dst)
    union = schedule.union
    by_source: dict[int, list[Transfer]] = {}
    for t in schedule.transfers:
        by_source.setdefault(t.src, []).append(t)
    slicing = schedule.piece != schedule.src_block
    rounds = max(len(v) for v in by_source.values()) if slicing else 1
    where: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # (dst, position) -> (round, src)
    offsets: list[dict[int, tuple[int, ...]]] = [{} for _ in range(rounds)]
    for s, ts in by_source.items():
        for r, t in enumerate(ts):
            r = r if slicing else 0
            where[(t.dst, t.position)] = (r, s)
            offsets[r][s] = t.offset
    sources = sorted({union[s] for s in by_source}, key=lambda d: d.id)
    targets = sorted(dst.device_set, key=lambda d: d.id)
    return dict(
        schedule=schedule, slicing=slicing, offsets=offsets, where=where, sources=sources, targets=targets
    )


@cached(maxsize=256)
def _slicer(shape: tuple[int, ...], src: Sharding, dst: Sharding, dtype: Any, k: int) -> Any:
    """One program over the source devices: round r's piece of each block (by a per-device offset).

    With ``k`` leaves of one signature, their blocks are stacked first and each
    piece carries all ``k`` (one copy per piece instead of ``k``).
    """
    plan = _plan(shape, src, dst)
    schedule, index = plan["schedule"], {d: i for i, d in enumerate(plan["sources"])}
    union = schedule.union
    piece, ndim, batch = schedule.piece, len(schedule.piece), (() if k == 1 else (k,))

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:
        x = xs[0] if k == 1 else jnp.stack(xs)
        if not plan["slicing"]:
            return (x,)
        me = jax.lax.axis_index(AXIS)
        out = []
        for offsets in plan["offsets"]:
            table = np.zeros((len(index), ndim), np.int32)
            for s, off in offsets.items():
                table[index[union[s]]] = off
            start = (0,) * len(batch) + tuple(jnp.asarray(table)[me, i] for i in range(ndim))
            out.append(jax.lax.dynamic_slice(x, start, batch + piece))
        return tuple(out)

    sharding = _mesh(plan["sources"])
    spec = PartitionSpec(AXIS)
    rounds = len(plan["offsets"]) if plan["slicing"] else 1
    fn = jax.jit(
        jax.shard_map(
            body, mesh=sharding.mesh, in_specs=(spec,) * k, out_specs=(spec,) * rounds, check_vma=False
        )
    )
    aval = jax.ShapeDtypeStruct(
        (len(index) * schedule.src_block[0], *schedule.src_block[1:]), dtype, sharding=sharding
    )
    with jax.set_mesh(sharding.mesh):
        return fn.lower(*([aval] * k)).compile()


@cached(maxsize=256)
def assembler(shape: tuple[int, ...], src: Sharding, dst: Sharding, dtype: Any, k: int) -> Any:
    """One program over the target devices: each block's pieces concatenated in grid order (and unstacked)."""
    plan = _plan(shape, src, dst)
    schedule = plan["schedule"]
    grid, batch = schedule.grid, (() if k == 1 else (k,))
    positions = [p.position for p in schedule.positions] or sorted({t.position for t in schedule.transfers})

    def body(*pieces: jax.Array) -> tuple[jax.Array, ...]:
        out = assemble(grid, dict(zip(positions, pieces, strict=True)).__getitem__, len(batch))
        return (out,) if k == 1 else tuple(out[i] for i in range(k))

    sharding = _mesh(plan["targets"])
    spec = PartitionSpec(AXIS)
    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=sharding.mesh,
            in_specs=(spec,) * len(positions),
            out_specs=(spec,) * k,
            check_vma=False,
        )
    )
    n = len(plan["targets"])
    shape_in = (n * (batch + schedule.piece)[0], *(batch + schedule.piece)[1:])
    aval = jax.ShapeDtypeStruct(shape_in, dtype, sharding=sharding)
    with jax.set_mesh(sharding.mesh):
        return fn.lower(*([aval] * len(positions))).compile(), positions


def _aliasable(piece: jax.Array, device: Any) -> bool:
    """Whether ``piece`` can change device without a copy: both CPUs (one host memory), whole bytes."""
    (here,) = piece.devices()
    return here.platform == device.platform == "cpu" and jax.dtypes.itemsize_bits(piece.dtype) % 8 == 0


def _alias(pieces: list[jax.Array], devices: list[Any]) -> list[jax.Array]:
    """Each CPU buffer as an array of another CPU device, sharing its memory (no byte copied).

    On the CPU backend every device's memory is the host's: a NumPy view of the
    buffer placed with ``may_alias=True`` is the same memory on the other
    device. The view holds a reference, so the memory outlives the source array
    when that is deleted. This is no host transfer (nothing is copied), so the
    transfer guard is lifted for these two calls only.
    """
    with jax.transfer_guard("allow"):
        return [
            jax.device_put(np.asarray(p), d, may_alias=True) for p, d in zip(pieces, devices, strict=True)
        ]


def _place(
    needed: list[tuple[Any, tuple[int, ...], int, int]],
    pieces: list[dict[Any, jax.Array]],
    union: Sequence[Any],
    fresh: bool,
    internal: bool,
    delete_sent: bool,
) -> dict[tuple[Any, tuple[int, ...]], jax.Array]:
    """Every (target device, position)'s piece on its device: kept, aliased (CPU) or copied.

    A piece aliases only when it is ``internal`` (no caller holds it) and goes
    to one place: two arrays on one memory would let a donated step write both.
    With ``delete_sent``, the aliased pieces' source arrays are deleted at once
    (the memory stays with the alias), so no device counts it twice.
    """
    uses = Counter((r, s) for _, _, r, s in needed)
    at: dict[tuple[Any, tuple[int, ...]], jax.Array] = {}
    aliased, copied = [], []
    for d, q, r, s in needed:
        piece = pieces[r][union[s]]
        if union[s] == d:
            at[(d, q)] = piece if fresh else jax.device_put(piece, d, may_alias=False)
        elif internal and uses[(r, s)] == 1 and _aliasable(piece, d):
            aliased.append((d, q, piece))
        else:
            copied.append((d, q, piece))
    moved = _alias([p for _, _, p in aliased], [d for d, _, _ in aliased]) if aliased else []
    moved += (
        jax.device_put([p for _, _, p in copied], [d for d, _, _ in copied], may_alias=False)
        if copied
        else []
    )
    for (d, q, _), y in zip(aliased + copied, moved, strict=True):
        at[(d, q)] = y
    if delete_sent:
        for _, _, piece in aliased:
            piece.delete()
    return at


def needs_assembly(schedule: Schedule, k: int) -> bool:
    return k > 1 or any(g > 1 for g in schedule.grid)


def run(xs: list[jax.Array], target: Sharding, donate: bool) -> list[jax.Array]:
    """Moves ``xs`` (one shape, dtype and sharding) onto ``target``: slice, copy, assemble, within this
    process."""
    x0, k = xs[0], len(xs)
    shape = tuple(x0.shape)
    plan = _plan(shape, x0.sharding, target)
    schedule, union = plan["schedule"], plan["schedule"].union
    mine = jax.process_index()
    if plan["slicing"] or k > 1:  # cut (and stack) on the source devices
        sharding = _mesh(plan["sources"])
        global_in = (len(plan["sources"]) * schedule.src_block[0], *schedule.src_block[1:])
        inputs = []
        for x in xs:
            held = {s.device: s.data for s in x.addressable_shards}
            blocks = [held[d] for d in sharding.mesh.devices.flat if d.process_index == mine]
            inputs.append(
                jax.make_array_from_single_device_arrays(global_in, sharding, blocks, dtype=x0.dtype)
            )
        cut = _slicer(shape, x0.sharding, target, x0.dtype, k)(*inputs)
        pieces = [{s.device: s.data for s in out.addressable_shards} for out in cut]
        fresh = True
    else:
        pieces = [{s.device: s.data for s in x0.addressable_shards}]
        fresh = donate  # the input's own buffers, reusable only when it is given up
    # Every (target device, position): its piece, copied there in one batched device_put when elsewhere.
    needed = [
        (union[i], q, *plan["where"][(i, q)]) for (i, q) in plan["where"] if union[i].process_index == mine
    ]
    # Internal pieces (cut here, or given up and assembled next) may alias on a CPU instead of copying.
    internal = fresh and (plan["slicing"] or k > 1 or needs_assembly(schedule, k))
    at = _place(needed, pieces, union, fresh, internal, delete_sent=plan["slicing"] or k > 1)
    if not needs_assembly(schedule, k):
        blocks_out = [
            {d: at[(d, (0,) * len(schedule.grid))] for d in plan["targets"] if d.process_index == mine}
        ]
    else:
        compiled, positions = assembler(shape, x0.sharding, target, x0.dtype, k)
        sharding = _mesh(plan["targets"])
        piece = ((k,) if k > 1 else ()) + schedule.piece
        global_piece = (len(plan["targets"]) * piece[0], *piece[1:])
        local = [d for d in sharding.mesh.devices.flat if d.process_index == mine]
        inputs = [
            jax.make_array_from_single_device_arrays(
                global_piece, sharding, [at[(d, q)] for d in local], dtype=x0.dtype
            )
            for q in positions
        ]
        blocks_out = [{s.device: s.data for s in out.addressable_shards} for out in compiled(*inputs)]
    return [
        jax.make_array_from_single_device_arrays(
            shape, target, [b[d] for d in target.addressable_devices], dtype=x0.dtype
        )
        for b in blocks_out
    ]
