"""reshard: runs a plan, window by window; plan_reshard says what it will do first."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from nnx_shard._base import (
    Block,
    assemble,
    block_of_shard,
    blocks,
    flatten_with_paths,
    holder,
    is_key,
    itemsize,
    relative,
)
from nnx_shard._reshard import _collective, _copy
from nnx_shard._reshard._host import from_host
from nnx_shard._reshard._planner import ReshardPlan, Route, plan_leaf, schedule_jobs, traffic
from nnx_shard.errors import ReshardError


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and is_key(x)


def _pairs(tree: Any, target: Any) -> tuple[list[tuple[str, Any, Sharding | None]], Any]:
    """Leaves of ``tree`` with the target sharding of each (``target`` may be a prefix)."""
    flat, treedef = flatten_with_paths(tree, is_leaf=None)
    is_sharding_leaf = lambda x: isinstance(x, Sharding) or x is None
    if isinstance(target, Sharding):
        targets = [target] * len(flat)
    else:
        try:
            expanded = jax.tree_util.tree_map(
                lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub),
                target,
                tree,
                is_leaf=is_sharding_leaf,
            )
        except ValueError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            raise ReshardError(
                f"the target shardings are not a prefix of the tree ({' '.join(lines[:1] + lines[-3:])}). "
                f"Build them from the same state, e.g. with infer_sharding."
            ) from None
        targets = jax.tree_util.tree_leaves(expanded, is_leaf=is_sharding_leaf)
    return [(p, x, t) for (p, x), t in zip(flat, targets, strict=True)], treedef


def _movable(x: Any, target: Sharding | None) -> bool:
    return target is not None and (hasattr(x, "shape") or np.isscalar(x))


def _prepare(
    tree: Any, target: Any
) -> tuple[Any, list[int], list[str], list[Any], list[Sharding], list[Any]]:
    """Flattens, keeps the leaves that move, and stands typed keys in for their key data."""
    pairs, treedef = _pairs(tree, target)
    idx, paths, xs, ts, impls = [], [], [], [], []
    for i, (path, x, t) in enumerate(pairs):
        if not _movable(x, t):
            continue
        impl = None
        if _is_key(x):
            impl = jax.random.key_impl(x)
            x = jax.random.key_data(x)
        idx.append(i)
        paths.append(path)
        xs.append(x)
        ts.append(t)
        impls.append(impl)
    return (pairs, treedef), idx, paths, xs, ts, impls


def _plan(paths: Sequence[str], xs: Sequence[Any], ts: Sequence[Sharding]) -> ReshardPlan:
    leaves = [plan_leaf(p, x, t) for p, x, t in zip(paths, xs, ts, strict=True)]
    return ReshardPlan(leaves, schedule_jobs(leaves, xs, ts))


def _add_traffic(plan: ReshardPlan, xs: Sequence[Any], ts: Sequence[Sharding]) -> ReshardPlan:
    """Each device's bytes sent and received, and the sharded leaves a device would hold whole: for the
    plan a user reads (``plan_reshard``), not on the path of a ``reshard`` itself."""
    for x, t, leaf in zip(xs, ts, plan.leaves, strict=True):
        src = getattr(x, "sharding", None)
        if src is not None and leaf.route is not Route.KEEP:
            traffic(leaf.shape, itemsize(x.dtype), src, t, plan.traffic)
            # a device holds at most its source and its target block of a leaf (pieces move, never a gather)
            own = math.prod(src.shard_shape(leaf.shape)) + math.prod(t.shard_shape(leaf.shape))
            if not src.is_fully_replicated and own >= math.prod(leaf.shape):
                plan.held_whole.append(leaf.path)
    return plan


def plan_reshard(tree: Any, target_shardings: Any) -> ReshardPlan:
    """The steps :func:`reshard` will take per leaf, with bytes moved, the ideal and the peak per device.

    Planning compiles the collective programs the reshard will run (cached), so
    each peak includes the temporaries XLA reports for them.

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp", None))
    >>> dst = NamedSharding(Mesh(np.array(devs[:4]), ("tp",)), PartitionSpec(None, "tp"))
    >>> x = jax.device_put(jnp.zeros((1024, 1024)), src)
    >>> plan = plan_reshard({"w": x}, {"w": dst})
    >>> str(plan.leaves[0].route), plan.bytes_moved == plan.ideal_bytes == 7 * 2**20 // 2
    ('collective', True)
    """
    _, _, paths, xs, ts, _ = _prepare(tree, target_shardings)
    return _add_traffic(_plan(paths, xs, ts), xs, ts)


def _keep(x: jax.Array, target: Sharding) -> jax.Array:
    if x.sharding == target:
        return x
    by_device = {s.device: s.data for s in x.addressable_shards}  # same blocks: relabel the buffers
    return jax.make_array_from_single_device_arrays(
        x.shape, target, [by_device[d] for d in target.addressable_devices], dtype=x.dtype
    )


def _slice(data: jax.Array, rel: tuple[slice, ...]) -> jax.Array:
    starts, stops = tuple(r.start for r in rel), tuple(r.stop for r in rel)
    return jax.jit(jax.lax.slice, static_argnums=(1, 2))(data, starts, stops)


def _piece(shards: dict[Any, jax.Array], src: dict[Any, Block], block: Block, device: Any) -> jax.Array:
    h = holder(block, device, src)
    if h is None:
        raise ReshardError(f"no source shard this process holds contains the block {block} of {device}.")
    data = shards[h]
    if src[h] != block:
        data = _slice(data, relative(block, src[h]))
    return jax.device_put(data, device, may_alias=False)


def _pieces(x: jax.Array, target: Sharding) -> jax.Array:
    """0-d and uneven arrays: each target block from whole shards, or from pieces concatenated on its
    device."""
    shape = tuple(x.shape)
    src = {s.device: block_of_shard(s.index, shape) for s in x.addressable_shards}
    shards = {s.device: s.data for s in x.addressable_shards}
    dst = blocks(target, shape)
    out = []
    for d in target.addressable_devices:
        block = dst[d]
        if not block or holder(block, d, src) is not None:
            out.append(_piece(shards, src, block, d))
            continue
        cuts = [
            sorted({lo, hi} | {p for b in src.values() for p in b[i] if lo < p < hi})
            for i, (lo, hi) in enumerate(block)
        ]

        def piece(position: tuple[int, ...], d: Any = d, cuts: list = cuts) -> jax.Array:
            return _piece(
                shards, src, tuple((c[i], c[i + 1]) for c, i in zip(cuts, position, strict=True)), d
            )

        out.append(assemble([len(c) - 1 for c in cuts], piece))
    return jax.make_array_from_single_device_arrays(shape, target, out, dtype=x.dtype)


def _reaches_other_processes(src: Sharding, dst: Sharding) -> bool:
    """Whether ``dst`` has devices in a process where ``src`` has none (the same answer in every process)."""
    return bool({d.process_index for d in dst.device_set} - {d.process_index for d in src.device_set})


def _move_collectively(xs: list[jax.Array], target: Sharding, fills: dict[Any, Any]) -> list[jax.Array]:
    """``xs`` (one shape, dtype and sharding) onto ``target`` by the collective route; the placeholder blocks
    for union devices outside the source are made once per signature and kept in ``fills``."""
    first = xs[0]
    schedule = _collective.build_schedule(tuple(first.shape), first.sharding, target)
    outside = tuple(d for d in schedule.union if d not in first.sharding.device_set)
    key = (schedule.src_block, first.dtype, outside)
    if key not in fills:
        fills[key] = _collective.placeholders(schedule.src_block, first.dtype, outside)
    return _collective.run(xs, target, fills[key])


def _scalar_to_other_processes(x: jax.Array, target: Sharding, fills: dict[Any, Any]) -> jax.Array:
    """A 0-d array onto devices of processes that hold none of it: moved as a one-element array by the
    collective route (one program over both device sets), each device's copy reshaped where it lies."""

    def flat(sharding: Sharding) -> NamedSharding:
        devices = sorted(sharding.device_set, key=lambda d: d.id)
        return NamedSharding(Mesh(np.array(devices), ("one",)), PartitionSpec())

    one = jax.make_array_from_single_device_arrays(
        (1,), flat(x.sharding), [s.data.reshape(1) for s in x.addressable_shards], dtype=x.dtype
    )
    (moved,) = _move_collectively([one], flat(target), fills)
    by_device = {s.device: s.data.reshape(()) for s in moved.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        (), target, [by_device[d] for d in target.addressable_devices], dtype=x.dtype
    )


def reshard(tree: Any, target_shardings: Any, *, donate: bool = False) -> Any:
    """Moves every array of ``tree`` onto ``target_shardings`` without gathering or touching the host.

    Works on pytrees and ``nnx.State``; ``target_shardings`` may be one
    sharding, one per leaf, or a tree prefix (``infer_sharding``'s output).
    Every dtype works, typed PRNG keys included. Each leaf moves by one SPMD
    program over its source and target devices that sends each missing piece
    once (small leaves of one signature share a program); results are bitwise
    equal to the input, on exactly the target sharding, and own their buffers,
    so a jitted step can donate them. Steps run one at a time; with
    ``donate``, each step's inputs are freed before the next step starts, so
    the state is never resident twice.

    Args:
      tree: the arrays (jax arrays on any devices, or host data, which is
        placed from the host as the plan says).
      target_shardings: where they go.
      donate: give up the input arrays (deleted once moved).

    Returns:
      ``tree`` with every array on its target sharding.

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp"))
    >>> dst = NamedSharding(Mesh(np.array(devs[4:]), ("fsdp",)), PartitionSpec("fsdp"))
    >>> y = reshard(jax.device_put(jnp.arange(16), src), dst)
    >>> y.sharding == dst, y.tolist() == list(range(16))
    (True, True)
    """
    (pairs, treedef), idx, paths, xs, ts, impls = _prepare(tree, target_shardings)
    plan = _plan(paths, xs, ts)
    results: list[Any] = list(xs)
    reused: set[int] = set()
    fills: dict[Any, dict[Any, jax.Array]] = {}
    for job in plan.jobs:
        if job.route is Route.COPY:
            moved = _copy.run([xs[i] for i in job.leaves], ts[job.leaves[0]], donate)
            for i, y in zip(job.leaves, moved, strict=True):
                results[i] = y
        elif job.route is Route.COLLECTIVE:
            moved = _move_collectively([xs[i] for i in job.leaves], ts[job.leaves[0]], fills)
            for i, y in zip(job.leaves, moved, strict=True):
                results[i] = y
        else:
            (i,) = job.leaves
            route, x, t = job.route, xs[i], ts[i]
            results[i] = (
                _keep(x, t)
                if route is Route.KEEP
                else from_host(x, t)
                if route is Route.HOST
                else _scalar_to_other_processes(x, t, fills)
                if x.ndim == 0 and _reaches_other_processes(x.sharding, t)
                else _pieces(x, t)
            )
        # One step at a time: XLA's CPU collectives must not interleave, and the peak stays the plan's.
        jax.block_until_ready([results[i] for i in job.leaves])
        if donate:
            for i in job.leaves:
                x = xs[i]
                if isinstance(x, jax.Array) and (results[i] is x or _shares_buffers(x, results[i])):
                    reused.add(i)  # the result is built on the input's own buffers
                elif isinstance(x, jax.Array):
                    x.delete()
    leaves = [x for _, x, _ in pairs]
    for i, impl, y in zip(idx, impls, results, strict=True):
        leaves[i] = jax.random.wrap_key_data(y, impl=impl) if impl is not None else y
    if donate:
        for n, (i, impl) in enumerate(zip(idx, impls, strict=True)):
            original = pairs[i][1]
            if (
                impl is not None
                and n not in reused
                and isinstance(original, jax.Array)
                and not original.is_deleted()
            ):
                original.delete()
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _shares_buffers(x: jax.Array, y: Any) -> bool:
    if not isinstance(y, jax.Array):
        return False
    mine = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in mine for s in y.addressable_shards)
