"""Resharding across meshes and device counts: an intermediate-sharding planner and executor on plain JAX.

Every step is either a collective inside the source mesh (a ``jax.jit`` with
``out_shardings``, used only when XLA compiles it without rematerializing the
whole array) or device-to-device copies of whole shards or of their pieces,
concatenated on the target device. No step gathers a sharded array onto one
device, and none goes through the host unless the input is on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from nnx_shard.errors import ShardingError
from nnx_shard.paths import path_to_str
from nnx_shard.plan import format_bytes

Block = tuple[tuple[int, int], ...]


class NoIntermediateShardingError(ShardingError):
    """No intermediate sharding helps for this pair of shardings."""


class NoIntermediateShardingNeededError(NoIntermediateShardingError):
    """Every target shard already lies inside one source shard: copy shards directly."""


class ReshardError(ShardingError):
    """A tree that cannot be resharded onto the given target shardings."""


# -- blocks -----------------------------------------------------------------


def _blocks(sharding: Sharding, shape: tuple[int, ...]) -> dict[Any, Block]:
    """Device -> the block of the global array it holds, as (start, stop) per dim."""
    out = {}
    for device, index in sharding.devices_indices_map(shape).items():
        out[device] = tuple(
            (s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(index, shape, strict=True)
        )
    return out


def _size(block: Block) -> int:
    return math.prod(b - a for a, b in block)


def _intersect(a: Block, b: Block) -> Block | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _contains(outer: Block, inner: Block) -> bool:
    return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(outer, inner, strict=True))


def _relative(inner: Block, outer: Block) -> tuple[slice, ...]:
    """``inner`` as slices of the array holding ``outer``."""
    return tuple(slice(b0 - a0, b1 - a0) for (a0, _), (b0, b1) in zip(outer, inner, strict=True))


def _counts(sharding: NamedSharding, ndim: int) -> tuple[int, ...]:
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    out = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out.append(math.prod(sharding.mesh.shape[a] for a in axes))
    return tuple(out)


def _device_list(sharding: Sharding) -> list[Any]:
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return list(sharding._device_assignment)  # other Sharding kinds: their fixed order


# -- the planner ------------------------------------------------------------


def _divisor_vectors(limits: Sequence[int], budget: int) -> list[tuple[int, ...]]:
    per_dim = [[c for c in range(1, n + 1) if n % c == 0] for n in limits]
    return [v for v in itertools.product(*per_dim) if budget % math.prod(v) == 0]


def find_intermediate_sharding(
    in_sharding: Sharding, out_sharding: Sharding, shape: Sequence[int] | None = None
) -> tuple[NamedSharding, list[str]]:
    """Finds a sharding over the source devices from which every target shard is a whole-shard copy.

    The intermediate lives on ``in_sharding``'s devices in their order (what a
    ``jax.jit`` from the source can produce). Its partition of each dimension
    divides the target's, so every target shard lies inside one intermediate
    shard; among those, the one with the most shards (the least memory per
    device) is chosen, and its devices are arranged so that target devices
    among the source devices already hold their own target block. Dimensions
    may be sharded over several mesh axes, the device count may grow or
    shrink, and device sets and orders may differ.

    Args:
      in_sharding: the source ``NamedSharding``.
      out_sharding: the target ``NamedSharding``.
      shape: the array's shape (default: the smallest shape both divide).

    Returns:
      ``(intermediate, replicated_axes)``: the intermediate ``NamedSharding``
      and the names of its mesh axes that replicate (empty if none).

    Raises:
      NoIntermediateShardingNeededError: every target shard already lies
        inside one source shard.
      NoIntermediateShardingError: not NamedShardings, different ranks, or the
        only intermediate would replicate the whole array on every device.

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp", None))
    >>> dst = NamedSharding(Mesh(np.array(devs[:4]), ("tp",)), PartitionSpec(None, "tp"))
    >>> mid, replicated = find_intermediate_sharding(src, dst)
    >>> mid.spec, dict(mid.mesh.shape), replicated
    (P(None, 'split1'), {'replica': 2, 'split1': 4}, ['replica'])
    """
    if not isinstance(in_sharding, NamedSharding) or not isinstance(out_sharding, NamedSharding):
        raise NoIntermediateShardingError(
            f"only NamedSharding is supported; got {type(in_sharding).__name__} -> {type(out_sharding).__name__}."
        )
    ndim = max(len(in_sharding.spec), len(out_sharding.spec)) if shape is None else len(shape)
    c_in, c_out = _counts(in_sharding, ndim), _counts(out_sharding, ndim)
    if shape is None:
        shape = tuple(math.lcm(a, b) for a, b in zip(c_in, c_out, strict=True))
    shape = tuple(shape)
    src_blocks, dst_blocks = _blocks(in_sharding, shape), _blocks(out_sharding, shape)
    distinct_src = set(src_blocks.values())
    if all(any(_contains(s, b) for s in distinct_src) for b in dst_blocks.values()):
        raise NoIntermediateShardingNeededError(
            f"every target shard of {out_sharding.spec} lies inside one source shard of "
            f"{in_sharding.spec}: copy shards directly."
        )
    devices = _device_list(in_sharding)
    n = len(devices)
    best = None
    for c in _divisor_vectors(c_out, n):
        if math.prod(c) < 2 or any(s % k for s, k in zip(shape, c, strict=True)):
            continue
        cand = _arrange(devices, c, dst_blocks, src_blocks, shape)
        key = (math.prod(c), cand[0])
        if best is None or key > best[0]:
            best = (key, cand[1], cand[2])
    if best is None:
        raise NoIntermediateShardingError(
            f"the only intermediate for {in_sharding.spec} -> {out_sharding.spec} would replicate "
            f"the whole array on every source device; copy the pieces directly instead."
        )
    return best[1], best[2]


def _arrange(
    devices: list[Any],
    counts: tuple[int, ...],
    dst_blocks: dict[Any, Block],
    src_blocks: dict[Any, Block],
    shape: tuple[int, ...],
) -> tuple[tuple[int, int], NamedSharding, list[str]]:
    """The best order of mesh axes for an intermediate with these counts, and its score."""
    axes = [(f"split{d}", k) for d, k in enumerate(counts) if k > 1]
    replica = len(devices) // math.prod(counts)
    if replica > 1:
        axes.append(("replica", replica))
    spec = PartitionSpec(*[f"split{d}" if k > 1 else None for d, k in enumerate(counts)])
    best = None
    for order in itertools.permutations(axes):
        mesh = Mesh(
            np.array(devices, dtype=object).reshape([k for _, k in order]), tuple(a for a, _ in order)
        )
        sharding = NamedSharding(mesh, spec)
        blocks = _blocks(sharding, shape)
        in_place = sum(_size(dst_blocks[d]) for d in dst_blocks if d in blocks and blocks[d] == dst_blocks[d])
        kept = sum(_size(x) for d, b in blocks.items() if (x := _intersect(b, src_blocks[d])) is not None)
        score = (in_place, kept)
        if best is None or score > best[0]:
            best = (score, sharding)
    return best[0], best[1], ["replica"] if replica > 1 else []


# -- per-leaf plans ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafReshard:
    """How one array gets from its sharding to the target.

    Attributes:
      path: the leaf's path.
      shape, dtype: the array's.
      route: ``keep`` (already there), ``copy`` (whole shards or slices of one
        shard each, device to device), ``collective+copy`` (a jit to an
        intermediate inside the source mesh, then copies), ``assemble`` (pieces
        of several source shards copied to each target device and concatenated
        there), or ``host`` (the input is host data).
      steps: the steps, in words.
      bytes_moved: bytes copied between devices (a collective counted by the
        bytes each device receives).
      ideal_bytes: bytes each target device lacks at the start, summed: no
        plan can move less.
      peak_bytes_per_device: the most bytes this leaf occupies on any device
        during the reshard (source shard, what arrives, and the result).
      host: whether a step goes through host memory, and why.

    >>> devs = jax.devices()
    >>> x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(Mesh(np.array(devs), ("f",)), PartitionSpec("f")))
    >>> leaf = plan_reshard(x, NamedSharding(Mesh(np.array(devs[:4]), ("f",)), PartitionSpec("f"))).leaves[0]
    >>> leaf.route, leaf.bytes_moved, leaf.host
    ('assemble', 112, None)
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    route: str
    steps: tuple[str, ...]
    bytes_moved: int
    ideal_bytes: int
    peak_bytes_per_device: int
    host: str | None = None
    intermediate: Sharding | None = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class ReshardPlan:
    """The plan of :func:`reshard`, per leaf and in total; printable as a table.

    >>> devs = jax.devices()
    >>> x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(Mesh(np.array(devs), ("f",)), PartitionSpec("f")))
    >>> plan = plan_reshard({"a": x, "b": x}, NamedSharding(Mesh(np.array(devs[4:]), ("f",)), PartitionSpec(None, "f")))
    >>> plan.bytes_moved == plan.ideal_bytes, plan.through_host
    (True, False)"""

    leaves: list[LeafReshard]

    @property
    def bytes_moved(self) -> int:
        return sum(p.bytes_moved for p in self.leaves)

    @property
    def ideal_bytes(self) -> int:
        return sum(p.ideal_bytes for p in self.leaves)

    @property
    def peak_bytes_per_device(self) -> int:
        """The largest single-leaf peak on any device (leaves are resharded one at a time)."""
        return max((p.peak_bytes_per_device for p in self.leaves), default=0)

    @property
    def through_host(self) -> bool:
        return any(p.host for p in self.leaves)

    def summary(self) -> str:
        routes: dict[str, int] = {}
        for p in self.leaves:
            routes[p.route] = routes.get(p.route, 0) + 1
        ratio = self.bytes_moved / self.ideal_bytes if self.ideal_bytes else 1.0
        return (
            f"{len(self.leaves)} leaves ({', '.join(f'{k} {v}' for k, v in sorted(routes.items()))}); "
            f"moves {format_bytes(self.bytes_moved)} (ideal {format_bytes(self.ideal_bytes)}, "
            f"{ratio:.2f}x); peak per device {format_bytes(self.peak_bytes_per_device)}; "
            f"through host: {'yes' if self.through_host else 'no'}"
        )

    def table(self, max_rows: int | None = None) -> str:
        rows = [("path", "shape", "route", "moved", "ideal", "peak/device", "steps")]
        for p in self.leaves[:max_rows]:
            rows.append(
                (
                    p.path,
                    "x".join(map(str, p.shape)) or "()",
                    p.route,
                    format_bytes(p.bytes_moved),
                    format_bytes(p.ideal_bytes),
                    format_bytes(p.peak_bytes_per_device),
                    "; ".join(p.steps) + (f" [host: {p.host}]" if p.host else ""),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join(
            ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]).rstrip()
            for r in rows
        )

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()


def _itemsize(dtype: Any) -> int:
    return jnp.dtype(dtype).itemsize


def _ideal(src: dict[Any, Block], dst: dict[Any, Block]) -> int:
    missing = 0
    for d, b in dst.items():
        have = src.get(d)
        inter = _intersect(have, b) if have is not None else None
        missing += _size(b) - (_size(inter) if inter is not None else 0)  # () is a 0-d block
    return missing


def _holder(block: Block, device: Any, src: dict[Any, Block]) -> Any:
    """A source device whose shard contains ``block``, preferring ``device`` itself."""
    if device in src and _contains(src[device], block):
        return device
    return next((d for d, b in src.items() if _contains(b, block)), None)


@functools.lru_cache(maxsize=512)
def _collective_is_cheap(
    src: Sharding, mid: Sharding, shape: tuple[int, ...], dtype: Any
) -> tuple[bool, int]:
    """Compiles source -> intermediate and checks XLA did not rematerialize the whole array."""
    aval = jax.ShapeDtypeStruct(shape, dtype, sharding=src)
    compiled = jax.jit(lambda x: x, out_shardings=mid).lower(aval).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    shard = _size(next(iter(_blocks(mid, shape).values()))) * _itemsize(dtype)
    return temp < max(shard, 1) * 2 and temp < math.prod(shape) * _itemsize(dtype), temp


def _plan_array(path: str, x: Any, target: Sharding) -> LeafReshard:
    shape = tuple(np.shape(x))
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    item = _itemsize(dtype) if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else 8
    dst = _blocks(target, shape)
    dst_shard = max((_size(b) for b in dst.values()), default=0) * item
    base = dict(path=path, shape=shape, dtype=str(dtype))
    if not isinstance(x, jax.Array):
        return LeafReshard(
            **base,
            route="host",
            steps=("host -> target shards",),
            bytes_moved=_size(tuple((0, n) for n in shape)) * item,
            ideal_bytes=0,
            peak_bytes_per_device=dst_shard,
            host="the input is host data",
        )
    src_sharding = x.sharding
    src = _blocks(src_sharding, shape)
    src_shard = max(_size(b) for b in src.values()) * item
    ideal = _ideal(src, dst) * item
    if src_sharding.is_equivalent_to(target, len(shape)) and _device_list(src_sharding) == _device_list(
        target
    ):
        return LeafReshard(
            **base,
            route="keep",
            steps=("already on the target",),
            bytes_moved=0,
            ideal_bytes=0,
            peak_bytes_per_device=src_shard,
        )
    if all(_holder(b, d, src) is not None for d, b in dst.items()):
        moved = sum(_size(b) for d, b in dst.items() if _holder(b, d, src) != d) * item
        return LeafReshard(
            **base,
            route="copy",
            steps=("copy whole shards device to device",),
            bytes_moved=moved,
            ideal_bytes=ideal,
            peak_bytes_per_device=src_shard + dst_shard,
        )
    try:
        mid, _ = find_intermediate_sharding(src_sharding, target, shape)
        cheap, temp = _collective_is_cheap(src_sharding, mid, shape, dtype)
    except NoIntermediateShardingError:
        cheap, mid, temp = False, None, 0
    if cheap and mid is not None:
        mid_blocks = _blocks(mid, shape)
        into_mid = _ideal(src, mid_blocks) * item
        then = sum(_size(b) for d, b in dst.items() if _holder(b, d, mid_blocks) != d) * item
        mid_shard = max(_size(b) for b in mid_blocks.values()) * item
    # The collective fills replica devices too; take it only when it moves no
    # more than copying the pieces would (on a CPU, pieces were 5x faster).
    if cheap and mid is not None and into_mid + then <= ideal:
        return LeafReshard(
            **base,
            route="collective+copy",
            steps=(f"jit to {mid.spec} on the source mesh", "copy whole shards device to device"),
            bytes_moved=into_mid + then,
            ideal_bytes=ideal,
            peak_bytes_per_device=src_shard + mid_shard + temp + dst_shard,
            intermediate=mid,
        )
    pieces = max(sum(1 for s in set(src.values()) if _intersect(s, b)) for b in dst.values())
    return LeafReshard(
        **base,
        route="assemble",
        steps=(f"copy up to {pieces} pieces per target device and concatenate there",),
        bytes_moved=ideal,
        ideal_bytes=ideal,
        peak_bytes_per_device=src_shard + 2 * dst_shard,
    )


# -- execution --------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _slicer(starts: tuple[int, ...], stops: tuple[int, ...]) -> Any:
    """A jitted static slice: its bounds are compiled in, so nothing crosses from the host."""
    return jax.jit(lambda a: jax.lax.slice(a, starts, stops))


@functools.lru_cache(maxsize=64)
def _concatenator(axis: int) -> Any:
    return jax.jit(lambda *parts: jnp.concatenate(parts, axis=axis))


def _copy_on(x: jax.Array, device: Any) -> jax.Array:
    return jax.device_put(x, device, may_alias=False)


def _piece(
    src_shards: dict[Any, jax.Array],
    src: dict[Any, Block],
    holder: Any,
    block: Block,
    device: Any,
    donate: bool,
) -> jax.Array:
    data = src_shards[holder]
    if src[holder] != block:
        rel = _relative(block, src[holder])
        data = _slicer(tuple(r.start for r in rel), tuple(r.stop for r in rel))(data)
    elif holder == device and donate:
        return data  # reuse the buffer: the input is given up
    return _copy_on(data, device)


def _assemble(
    src_shards: dict[Any, jax.Array], src: dict[Any, Block], block: Block, device: Any
) -> jax.Array:
    """Builds ``block`` on ``device`` from pieces of source shards: a grid, concatenated dim by dim."""
    cuts = []
    for dim, (lo, hi) in enumerate(block):
        points = {lo, hi}
        for b in set(src.values()):
            for p in b[dim]:
                if lo < p < hi:
                    points.add(p)
        cuts.append(sorted(points))

    def build(prefix: tuple[tuple[int, int], ...], dim: int) -> jax.Array:
        if dim == len(block):
            holder = _holder(prefix, device, src)
            return _piece(src_shards, src, holder, prefix, device, donate=False)
        parts = [build((*prefix, (a, b)), dim + 1) for a, b in itertools.pairwise(cuts[dim])]
        return parts[0] if len(parts) == 1 else _concatenator(dim)(*parts)

    if not block:
        return _piece(src_shards, src, _holder(block, device, src), block, device, donate=False)
    return build((), 0)


def _reshard_array(x: Any, target: Sharding, plan: LeafReshard, donate: bool) -> jax.Array:
    if plan.route == "host":
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, target, lambda index: host[index])
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = _reshard_array(
            jax.random.key_data(x),
            target,
            dataclasses.replace(plan, route=plan.route if plan.route != "collective+copy" else "assemble"),
            donate,
        )
        return jax.random.wrap_key_data(data, impl=impl)
    if plan.route == "keep":
        if x.sharding == target:
            return x
        # Equivalent layout under another name: relabel the same buffers.
        by_device = {sh.device: sh.data for sh in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            x.shape, target, [by_device[d] for d in target.addressable_devices]
        )
    if plan.route == "collective+copy":
        mid = plan.intermediate  # found while planning
        with warnings.catch_warnings():  # CPU ignores donation and says so; we free x below
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            y = jax.jit(lambda a: a, out_shardings=mid, donate_argnums=0 if donate else ())(x)
        if donate and not x.is_deleted():
            x.delete()  # backends that ignore donation (CPU) still free it now
        return _reshard_array(y, target, dataclasses.replace(plan, route="copy"), donate=True)
    shape = tuple(x.shape)
    src = {
        s.device: b
        for s, b in (
            (
                s,
                tuple(
                    (i.start or 0, i.stop if i.stop is not None else n)
                    for i, n in zip(s.index, shape, strict=True)
                ),
            )
            for s in x.addressable_shards
        )
    }
    src_shards = {s.device: s.data for s in x.addressable_shards}
    dst = _blocks(target, shape)
    missing = [
        d
        for d in dst
        if d.process_index == jax.process_index() and _holder(dst[d], d, src) is None and plan.route == "copy"
    ]
    if missing:
        raise ReshardError(f"{plan.path!r}: no addressable source shard holds the block of {missing[0]}.")
    pieces = []
    for d in target.addressable_devices:
        if plan.route == "copy":
            pieces.append(_piece(src_shards, src, _holder(dst[d], d, src), dst[d], d, donate))
        else:
            pieces.append(_assemble(src_shards, src, dst[d], d))
    out = jax.make_array_from_single_device_arrays(shape, target, pieces)
    if donate and not any(any(p is s for s in src_shards.values()) for p in pieces):
        x.delete()  # nothing of it was reused in place: free it now
    return out


# -- the public API -----------------------------------------------------------


def _pairs(tree: Any, target: Any) -> tuple[list[tuple[str, Any, Sharding | None]], Any]:
    """Leaves of ``tree`` with the target sharding of each (``target`` may be a prefix)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
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
    return [(path_to_str(p), x, t) for (p, x), t in zip(flat, targets, strict=True)], treedef


def plan_reshard(tree: Any, target_shardings: Any) -> ReshardPlan:
    """The steps :func:`reshard` will take per leaf, with bytes moved, the ideal and the peak per device.

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp", None))
    >>> dst = NamedSharding(Mesh(np.array(devs[:4]), ("tp",)), PartitionSpec(None, "tp"))
    >>> x = jax.device_put(jnp.zeros((1024, 1024)), src)
    >>> plan = plan_reshard({"w": x}, {"w": dst})
    >>> plan.leaves[0].route, plan.bytes_moved == plan.ideal_bytes == 7 * 2**20 // 2
    ('assemble', True)
    """
    pairs, _ = _pairs(tree, target_shardings)
    return ReshardPlan(
        [
            _plan_array(p, x, t)
            for p, x, t in pairs
            if t is not None and (hasattr(x, "shape") or np.isscalar(x))
        ]
    )


def reshard(tree: Any, target_shardings: Any, *, donate: bool = False) -> Any:
    """Moves every array of ``tree`` onto ``target_shardings`` without gathering or touching the host.

    Works on pytrees and ``nnx.State``; ``target_shardings`` may be one
    sharding, one per leaf, or a tree prefix (``infer_sharding``'s output).
    Every dtype works, typed PRNG keys included. Results are bitwise equal to
    the input, on exactly the target sharding, and own their buffers, so a
    jitted step can donate them.

    Args:
      tree: the arrays (jax arrays on any devices of this process; host data
        is placed from the host, as the plan says).
      target_shardings: where they go.
      donate: give up the input arrays: their buffers may be reused in place
        and are deleted otherwise.

    Returns:
      ``tree`` with every array on its target sharding.

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp"))
    >>> dst = NamedSharding(Mesh(np.array(devs[4:]), ("fsdp",)), PartitionSpec("fsdp"))
    >>> y = reshard(jax.device_put(jnp.arange(16), src), dst)
    >>> y.sharding == dst, y.tolist() == list(range(16))
    (True, True)
    """
    pairs, treedef = _pairs(tree, target_shardings)
    out = []
    for path, x, target in pairs:
        if target is None or not (hasattr(x, "shape") or np.isscalar(x)):
            out.append(x)
            continue
        out.append(_reshard_array(x, target, _plan_array(path, x, target), donate))
    return jax.tree_util.tree_unflatten(treedef, out)


def reshard_with_intermediate_sharding(
    x: Any, in_sharding: Sharding, out_sharding: Sharding, *, donate: bool = False
) -> Any:
    """Reshards ``x`` (an array or pytree on ``in_sharding``) to ``out_sharding`` through an intermediate.

    The name and signature of pathwaysutils' experimental API, on plain JAX:
    when :func:`find_intermediate_sharding` finds an intermediate and XLA can
    reach it without rematerializing the array, the arrays go there first with
    a jit inside the source mesh; the rest is device-to-device copies.

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp"))
    >>> dst = NamedSharding(Mesh(np.array(devs[:4]), ("tp",)), PartitionSpec("tp"))
    >>> reshard_with_intermediate_sharding(jax.device_put(jnp.arange(8.0), src), src, dst).sharding == dst
    True
    """
    for leaf in jax.tree_util.tree_leaves(x):
        if isinstance(leaf, jax.Array) and not leaf.sharding.is_equivalent_to(in_sharding, leaf.ndim):
            raise ReshardError(f"an input array is on {leaf.sharding}, not on in_sharding {in_sharding}.")
    return reshard(x, out_sharding, donate=donate)
