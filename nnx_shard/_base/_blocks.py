"""Block arithmetic, the one block type of the package: which part of a global array each device holds,
and how blocks meet. Resharding, snapshots and weight loading all count in blocks.

A block is a tuple of ``(start, stop)`` per dimension; a 0-d array's block is ``()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

Block = tuple[tuple[int, int], ...]


def blocks(sharding: Sharding, shape: tuple[int, ...]) -> dict[Any, Block]:
    """Device -> the block of the global array it holds, for every device of ``sharding``."""
    return {
        device: block_of_shard(index, shape) for device, index in sharding.devices_indices_map(shape).items()
    }


def block_of_shard(index: tuple[slice, ...], shape: tuple[int, ...]) -> Block:
    """The block of one addressable shard, from its ``index``."""
    return tuple(
        (s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(index, shape, strict=True)
    )


def assemble(
    counts: Sequence[int], piece: Callable[[tuple[int, ...]], jax.Array], offset: int = 0
) -> jax.Array:
    """Pieces on a grid of ``counts`` per dimension, concatenated in grid order: ``piece(position)``
    gives each; grid dimension ``i`` is array axis ``i + offset`` (after leading batch axes)."""

    def build(prefix: tuple[int, ...]) -> jax.Array:
        dim = len(prefix)
        if dim == len(counts):
            return piece(prefix)
        parts = [build((*prefix, i)) for i in range(counts[dim])]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=dim + offset)

    return build(())


def block_shape(block: Block) -> tuple[int, ...]:
    return tuple(b - a for a, b in block)


def block_size(block: Block) -> int:
    return math.prod(b - a for a, b in block)


def intersect(a: Block, b: Block) -> Block | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def contains(outer: Block, inner: Block) -> bool:
    return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(outer, inner, strict=True))


def relative(inner: Block, outer: Block) -> tuple[slice, ...]:
    """``inner`` as slices of the array holding ``outer``."""
    return tuple(slice(b0 - a0, b1 - a0) for (a0, _), (b0, b1) in zip(outer, inner, strict=True))


def missing_elements(src: Mapping[Any, Block], dst: Mapping[Any, Block]) -> int:
    """Elements each target device lacks at the start, summed: the least any reshard must move."""
    missing = 0
    for device, block in dst.items():
        have = src.get(device)
        inter = intersect(have, block) if have is not None else None
        missing += block_size(block) - (block_size(inter) if inter is not None else 0)  # () is a 0-d block
    return missing


def holder(block: Block, device: Any, src: Mapping[Any, Block]) -> Any:
    """A device whose source block contains ``block``, preferring ``device`` itself; None if none does."""
    if device in src and contains(src[device], block):
        return device
    return next((d for d, b in src.items() if contains(b, block)), None)


def device_order(sharding: Sharding) -> list[Any]:
    """The devices of a sharding in a fixed order: the mesh order for a NamedSharding, else by id."""
    mesh = getattr(sharding, "mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return list(devices.flat)
    return sorted(sharding.device_set, key=lambda d: d.id)
