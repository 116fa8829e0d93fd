"""find_intermediate_sharding: pathwaysutils' planner, general and bounded, on plain JAX."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax  # noqa: F401  (the doctests use it)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from nnx_shard._base import (
    Block,
    block_size,
    blocks,
    contains,
    device_order,
    entry_size,
    intersect,
    normalize_spec,
)
from nnx_shard.errors import NoIntermediateShardingError, NoIntermediateShardingNeededError

# The search is bounded: at most this many partitions with the most shards are
# arranged, each in at most this many axis orders.
MAX_PARTITIONS = 8
MAX_ORDERS = 24


def _counts(sharding: NamedSharding, ndim: int) -> tuple[int, ...]:
    return tuple(entry_size(sharding.mesh.shape, e) for e in normalize_spec(sharding.spec, ndim))


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
    shrink, and device sets and orders may differ. The search is bounded
    (:data:`MAX_PARTITIONS` partitions x :data:`MAX_ORDERS` axis orders).

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
      NoIntermediateShardingError: not NamedShardings, or the only
        intermediate would replicate the whole array on every device.

    >>> devs = jax.devices()
    >>> src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), PartitionSpec("fsdp", None))
    >>> dst = NamedSharding(Mesh(np.array(devs[:4]), ("tp",)), PartitionSpec(None, "tp"))
    >>> mid, replicated = find_intermediate_sharding(src, dst)
    >>> mid.spec, dict(mid.mesh.shape), replicated
    (P(None, 'split1'), {'replica': 2, 'split1': 4}, ['replica'])
    """
    if not isinstance(in_sharding, NamedSharding) or not isinstance(out_sharding, NamedSharding):
        raise NoIntermediateShardingError(
            f"only NamedSharding is supported; got {type(in_sharding).__name__} -> "
            f"{type(out_sharding).__name__}."
        )
    ndim = max(len(in_sharding.spec), len(out_sharding.spec)) if shape is None else len(shape)
    c_in, c_out = _counts(in_sharding, ndim), _counts(out_sharding, ndim)
    if shape is None:
        shape = tuple(math.lcm(a, b) for a, b in zip(c_in, c_out, strict=True))
    shape = tuple(shape)
    src_blocks, dst_blocks = blocks(in_sharding, shape), blocks(out_sharding, shape)
    distinct_src = set(src_blocks.values())
    if all(any(contains(s, b) for s in distinct_src) for b in dst_blocks.values()):
        raise NoIntermediateShardingNeededError(
            f"every target shard of {out_sharding.spec} lies inside one source shard of "
            f"{in_sharding.spec}: copy shards directly."
        )
    devices = device_order(in_sharding)
    valid = [
        c
        for c in _divisor_vectors(c_out, len(devices))
        if math.prod(c) >= 2 and not any(s % k for s, k in zip(shape, c, strict=True))
    ]
    if not valid:
        raise NoIntermediateShardingError(
            f"the only intermediate for {in_sharding.spec} -> {out_sharding.spec} would replicate "
            f"the whole array on every source device; copy the pieces directly instead."
        )
    most = max(math.prod(c) for c in valid)
    best = None
    for c in [c for c in valid if math.prod(c) == most][:MAX_PARTITIONS]:
        score, sharding, replicated = _arrange(devices, c, dst_blocks, src_blocks, shape)
        if best is None or score > best[0]:
            best = (score, sharding, replicated)
    return best[1], best[2]


def _arrange(
    devices: list[Any],
    counts: tuple[int, ...],
    dst_blocks: dict[Any, Block],
    src_blocks: dict[Any, Block],
    shape: tuple[int, ...],
) -> tuple[tuple[int, int], NamedSharding, list[str]]:
    """The best of a bounded number of mesh-axis orders for an intermediate with these counts, and its
    score."""
    axes = [(f"split{d}", k) for d, k in enumerate(counts) if k > 1]
    replica = len(devices) // math.prod(counts)
    if replica > 1:
        axes.append(("replica", replica))
    spec = PartitionSpec(*[f"split{d}" if k > 1 else None for d, k in enumerate(counts)])
    best = None
    for order in itertools.islice(itertools.permutations(axes), MAX_ORDERS):
        mesh = Mesh(
            np.array(devices, dtype=object).reshape([k for _, k in order]), tuple(a for a, _ in order)
        )
        sharding = NamedSharding(mesh, spec)
        mid = blocks(sharding, shape)
        in_place = sum(block_size(dst_blocks[d]) for d in dst_blocks if d in mid and mid[d] == dst_blocks[d])
        kept = sum(block_size(x) for d, b in mid.items() if (x := intersect(b, src_blocks[d])) is not None)
        if best is None or (in_place, kept) > best[0]:
            best = ((in_place, kept), sharding)
    return best[0], best[1], ["replica"] if replica > 1 else []
