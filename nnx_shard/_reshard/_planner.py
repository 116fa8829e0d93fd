"""The reshard plan: a typed route per leaf, its cost, and the order the work runs in."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from nnx_shard._base import (
    Block,
    block_size,
    blocks,
    cached,
    device_order,
    format_bytes,
    format_table,
    holder,
    intersect,
    itemsize,
    missing_elements,
)
from nnx_shard._reshard import _collective, _copy

# Arrays of at most this many bytes share one program with others of the same
# signature (up to STACK of them), so a deep model of many small leaves pays for
# a few dispatches, not one per leaf.
STACK_BYTES = 2**20
STACK = 64


class Route(enum.StrEnum):
    """How one leaf gets to its target.

    KEEP: already there (same blocks on the same devices). COPY: each missing
    piece cut out on its holder (one program over the source devices), copied once (one batched
    ``device_put``) and assembled on its target (one program over the target devices); within a process.
    COLLECTIVE: one SPMD program over the source and target devices moves each missing piece once with
    ``ppermute``; for pieces that cross processes, and for transpositions (pieces both cut and assembled),
    which it writes in place. PIECES: device-to-device copies of whole shards or of their pieces, concatenated
    on the target device (0-d and uneven arrays).
    HOST: the input is host data, placed shard by shard.
    """

    KEEP = "keep"
    COPY = "copy"
    COLLECTIVE = "collective"
    PIECES = "pieces"
    HOST = "host"


@dataclasses.dataclass(frozen=True)
class LeafReshard:
    """How one array gets from its sharding to the target.

    Attributes:
      path: the leaf's path.
      shape, dtype: the array's.
      route: a :class:`Route`.
      steps: the steps, in words.
      bytes_moved: bytes copied from one device to another.
      ideal_bytes: bytes each target device lacks at the start, summed: no
        plan can move less.
      peak_bytes_per_device: the most bytes the leaf's step holds on any
        device while it runs (source block, result, placeholders and XLA's
        temporaries), for a step shared by stacked leaves the whole step's.
      host: whether a step goes through host memory, and why.
      piece: for the collective route, the block of the intermediate sharding
        (the common refinement of source and target) that travels.
      stacked: how many leaves share the leaf's program.

    >>> from nnx_shard.resharding import plan_reshard
    >>> devs = jax.devices()
    >>> x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(Mesh(np.array(devs), ("f",)), PartitionSpec("f")))
    >>> leaf = plan_reshard(x, NamedSharding(Mesh(np.array(devs[:4]), ("f",)), PartitionSpec("f"))).leaves[0]
    >>> str(leaf.route), leaf.bytes_moved, leaf.host
    ('copy', 112, None)
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    route: Route
    steps: tuple[str, ...]
    bytes_moved: int
    ideal_bytes: int
    peak_bytes_per_device: int
    host: str | None = None
    piece: tuple[int, ...] | None = None
    stacked: int = 1


@dataclasses.dataclass(frozen=True)
class Job:
    """One unit of work: a route and the leaves (indices into the plan) it moves together."""

    route: Route
    leaves: tuple[int, ...]
    peak: int


@dataclasses.dataclass
class ReshardPlan:
    """The plan of :func:`reshard`, per leaf and in total; printable as a table.

    >>> from nnx_shard.resharding import plan_reshard
    >>> devs = jax.devices()
    >>> x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(Mesh(np.array(devs), ("f",)), PartitionSpec("f")))
    >>> half = NamedSharding(Mesh(np.array(devs[4:]), ("f",)), PartitionSpec(None, "f"))
    >>> plan = plan_reshard({"a": x, "b": x}, half)
    >>> plan.bytes_moved == plan.ideal_bytes, plan.through_host
    (True, False)
    """

    leaves: list[LeafReshard]
    jobs: list[Job] = dataclasses.field(default_factory=list, repr=False)
    # bytes each device sends and receives, by device id; the sharded leaves some device holds whole
    traffic: dict[int, list[int]] = dataclasses.field(default_factory=dict, repr=False)
    held_whole: list[str] = dataclasses.field(default_factory=list, repr=False)

    @property
    def most_sent_per_device(self) -> int:
        return max((t[0] for t in self.traffic.values()), default=0)

    @property
    def most_received_per_device(self) -> int:
        return max((t[1] for t in self.traffic.values()), default=0)

    @property
    def never_whole(self) -> bool:
        """No device holds the whole of a sharded array at any step (each leaf's peak is below its size)."""
        return not self.held_whole

    @property
    def bytes_moved(self) -> int:
        return sum(p.bytes_moved for p in self.leaves)

    @property
    def ideal_bytes(self) -> int:
        return sum(p.ideal_bytes for p in self.leaves)

    @property
    def peak_bytes_per_device(self) -> int:
        """The most one step holds on a device (steps run one at a time, each waited for)."""
        return max((job.peak for job in self.jobs), default=0)

    @property
    def through_host(self) -> bool:
        return any(p.host for p in self.leaves)

    def summary(self) -> str:
        routes: dict[str, int] = {}
        for p in self.leaves:
            routes[str(p.route)] = routes.get(str(p.route), 0) + 1
        ratio = self.bytes_moved / self.ideal_bytes if self.ideal_bytes else 1.0
        return (
            f"{len(self.leaves)} leaves ({', '.join(f'{k} {v}' for k, v in sorted(routes.items()))}) in "
            f"{len(self.jobs)} steps; moves {format_bytes(self.bytes_moved)} (ideal "
            f"{format_bytes(self.ideal_bytes)}, {ratio:.2f}x); peak per device "
            f"{format_bytes(self.peak_bytes_per_device)}; through host: "
            f"{'yes' if self.through_host else 'no'}"
        ) + (
            f"\nper device: sends up to {format_bytes(self.most_sent_per_device)}, receives up to "
            f"{format_bytes(self.most_received_per_device)}; "
            + (
                "no device ever holds a whole sharded array"
                if self.never_whole
                else f"a device holds these sharded arrays whole: {self.held_whole[:4]}"
            )
            if self.traffic
            else ""
        )

    def table(self, max_rows: int | None = None) -> str:
        rows = [("path", "shape", "route", "moved", "ideal", "peak/device", "steps")]
        for p in self.leaves[:max_rows]:
            rows.append(
                (
                    p.path,
                    "x".join(map(str, p.shape)) or "()",
                    str(p.route),
                    format_bytes(p.bytes_moved),
                    format_bytes(p.ideal_bytes),
                    format_bytes(p.peak_bytes_per_device),
                    "; ".join(p.steps) + (f" [host: {p.host}]" if p.host else ""),
                )
            )
        return format_table(rows)

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()


@cached(maxsize=4096)
def _plan_signature(shape: tuple[int, ...], dtype: Any, src: Sharding | None, dst: Sharding) -> LeafReshard:
    """The plan of one leaf without its path, cached: deep models repeat a few signatures many times."""
    item = itemsize(dtype)
    dst_blocks = blocks(dst, shape)
    dst_shard = max((block_size(b) for b in dst_blocks.values()), default=0) * item
    base = dict(path="", shape=shape, dtype=str(dtype))
    if src is None:
        return LeafReshard(
            **base,
            route=Route.HOST,
            steps=("host -> target shards",),
            bytes_moved=math.prod(shape) * item,
            ideal_bytes=0,
            peak_bytes_per_device=dst_shard,
            host="the input is host data",
        )
    src_blocks = blocks(src, shape)
    src_shard = max(block_size(b) for b in src_blocks.values()) * item
    ideal = missing_elements(src_blocks, dst_blocks) * item
    if src.is_equivalent_to(dst, len(shape)) and device_order(src) == device_order(dst):
        return LeafReshard(
            **base,
            route=Route.KEEP,
            steps=("already on the target",),
            bytes_moved=0,
            ideal_bytes=0,
            peak_bytes_per_device=src_shard,
        )
    schedule = _collective.build_schedule(shape, src, dst)
    # Pieces that must be both cut and assembled (a transposition) go through the collective
    # route, which writes them in place with one piece in flight: less memory than holding them.
    cut_and_join = (
        schedule is not None and schedule.piece != schedule.src_block and _copy.needs_assembly(schedule, 1)
    )
    if schedule is not None and _copy.within_process(schedule) and not cut_and_join:
        return _copy_route(base, schedule, item, ideal, src_shard, dst_shard)
    if schedule is not None:
        return _collective_route(base, schedule, item, ideal, src_shard + dst_shard, (shape, src, dst, dtype))
    pieces = max(sum(1 for s in set(src_blocks.values()) if intersect(s, b)) for b in dst_blocks.values())
    whole = all(holder(b, d, src_blocks) is not None for d, b in dst_blocks.items())
    return LeafReshard(
        **base,
        route=Route.PIECES,
        steps=(
            "copy whole shards device to device"
            if whole
            else f"copy up to {pieces} pieces per target device and concatenate there",
        ),
        bytes_moved=ideal,
        ideal_bytes=ideal,
        peak_bytes_per_device=src_shard + 2 * dst_shard,
    )


def _copy_route(
    base: dict[str, Any], schedule: Any, item: int, ideal: int, src_shard: int, dst_shard: int
) -> LeafReshard:
    """Pieces copied device to device within this process (cut first, assembled after, when needed)."""
    piece = math.prod(schedule.piece) * item
    slicing = schedule.piece != schedule.src_block
    assembling = _copy.needs_assembly(schedule, 1)
    cut = f"cut pieces of {'x'.join(map(str, schedule.piece))} on the source devices; " if slicing else ""
    return LeafReshard(
        **base,
        route=Route.COPY,
        steps=(
            cut
            + f"copy {schedule.remote} pieces to their targets"
            + ("; assemble each target block" if assembling else ""),
        ),
        bytes_moved=schedule.remote * piece,
        ideal_bytes=ideal,
        peak_bytes_per_device=src_shard * (2 if slicing else 1) + dst_shard * (2 if assembling else 1),
        piece=schedule.piece,
    )


def _collective_route(
    base: dict[str, Any], schedule: Any, item: int, ideal: int, shards: int, program: tuple[Any, ...]
) -> LeafReshard:
    """One SPMD program of ppermutes over the source and target devices."""
    shape, src, dst, dtype = program
    piece = math.prod(schedule.piece) * item
    # Small arrays run stacked; their step's peak comes from the stacked program.
    stackable = math.prod(shape) * item <= STACK_BYTES
    temp = 0 if stackable else _collective.compiled_program(shape, src, dst, dtype, 1)[1]
    return LeafReshard(
        **base,
        route=Route.COLLECTIVE,
        steps=(
            f"one program on {len(schedule.union)} devices: {schedule.remote} pieces of "
            f"{'x'.join(map(str, schedule.piece))} by {schedule.permutation_count} ppermutes",
        ),
        bytes_moved=schedule.remote * piece,
        ideal_bytes=ideal,
        peak_bytes_per_device=shards + temp,
        piece=schedule.piece,
    )


def plan_leaf(path: str, x: Any, target: Sharding) -> LeafReshard:
    """The plan of one array: a jax array on any devices of this process, a ``jax.ShapeDtypeStruct`` with a
    sharding (planned, and its programs compiled, for devices that hold nothing: a TPU pod's), or host
    data."""
    shape = tuple(np.shape(x))
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    src = x.sharding if isinstance(x, jax.Array) or getattr(x, "sharding", None) is not None else None
    return dataclasses.replace(_plan_signature(shape, dtype, src, target), path=path)


def schedule_jobs(leaves: list[LeafReshard], inputs: Sequence[Any], targets: Sequence[Sharding]) -> list[Job]:
    """Groups small leaves of one signature and route into shared steps, in tree order.

    Updates ``leaves`` in place with the peak and stack size of the step each one runs in.
    """
    jobs: list[Job] = []
    open_groups: dict[Any, list[int]] = {}
    order: list[Any] = []
    for i, (leaf, x, t) in enumerate(zip(leaves, inputs, targets, strict=True)):
        small = math.prod(leaf.shape) * itemsize(x.dtype) <= STACK_BYTES
        if leaf.route in (Route.COPY, Route.COLLECTIVE) and small:
            key = (leaf.route, leaf.shape, leaf.dtype, x.sharding, t)
            if key not in open_groups:
                open_groups[key] = []
                order.append(key)
            open_groups[key].append(i)
        else:
            order.append(i)
    for entry in order:
        if isinstance(entry, int):
            jobs.append(Job(leaves[entry].route, (entry,), leaves[entry].peak_bytes_per_device))
            continue
        members = open_groups[entry]
        route, shape, _, src, dst = entry
        while members:
            k = 1 << min(len(members), STACK).bit_length() - 1  # powers of two: few distinct programs
            chunk, members = tuple(members[:k]), members[k:]
            one = leaves[chunk[0]].peak_bytes_per_device
            if route is Route.COLLECTIVE:
                _, temp = _collective.compiled_program(shape, src, dst, inputs[chunk[0]].dtype, k)
                peak = k * one + temp  # its blocks, k times, + XLA's temp
            else:
                peak = 2 * k * one  # the leaves' own steps, plus the stacked copies
            for i in chunk:
                leaves[i] = dataclasses.replace(leaves[i], peak_bytes_per_device=peak, stacked=k)
            jobs.append(Job(route, chunk, peak))
    return jobs


def traffic(
    shape: tuple[int, ...], item: int, src: Sharding, dst: Sharding, into: dict[int, list[int]]
) -> None:
    """Adds the bytes each device sends and receives when ``src`` becomes ``dst``: every element a target
    device lacks comes once from the first source device holding it (``into``: id -> [sent, received])."""
    src_blocks, dst_blocks = blocks(src, shape), blocks(dst, shape)
    first: dict[Block, Any] = {}
    for device, block in sorted(src_blocks.items(), key=lambda kv: kv[0].id):
        first.setdefault(block, device)
    for device, block in dst_blocks.items():
        own = src_blocks.get(device)
        for sblock, holder_device in first.items():
            common = intersect(block, sblock)
            if (
                common is None
                or holder_device == device
                or (own is not None and intersect(common, own) == common)
            ):
                continue
            n = block_size(common) * item
            into.setdefault(holder_device.id, [0, 0])[0] += n
            into.setdefault(device.id, [0, 0])[1] += n
