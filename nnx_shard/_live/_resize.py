"""Moving a live state onto another mesh: the shardings the strategy infers there, the reshard, and its
report."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from jax.sharding import Mesh

from nnx_shard._base import describe_mesh, format_bytes
from nnx_shard._reshard import ReshardPlan, plan_reshard, reshard
from nnx_shard._sharding import ShardingPlan, plan_sharding


@dataclasses.dataclass(frozen=True)
class ResizeReport:
    """What a mesh change did: device counts before and after, bytes moved against the ideal, peak, time.

    >>> print(ResizeReport(8, "fsdp=8", 4, "fsdp=4", 2**30, 2**30, 24 * 2**20, 0.4))
    moved from 8 devices (fsdp=8) to 4 devices (fsdp=4): 1.00 GiB moved of 1.00 GiB ideal, peak 24.0 MiB per
    device, 0.40 s
    """

    devices_before: int
    mesh_before: str
    devices_after: int
    mesh_after: str
    bytes_moved: int
    ideal_bytes: int
    peak_bytes_per_device: int
    seconds: float
    through_host: bool = False
    reshard_plan: ReshardPlan | None = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return (
            f"moved from {_devices(self.devices_before, self.mesh_before)} to "
            f"{_devices(self.devices_after, self.mesh_after)}: {format_bytes(self.bytes_moved)} moved of "
            f"{format_bytes(self.ideal_bytes)} ideal, peak {format_bytes(self.peak_bytes_per_device)} per "
            "device, "
            f"{self.seconds:.2f} s" + (" (through the host)" if self.through_host else "")
        )


def _devices(n: int, mesh: str) -> str:
    return "1 device" if n == 1 else f"{n} devices ({mesh})"


def move(
    states: Any, strategy: Any, old: Mesh, new: Mesh, *, strict: bool, donate: bool
) -> tuple[Any, ShardingPlan, ResizeReport]:
    """``states`` on the shardings ``strategy`` infers for ``new``: ``(moved states, new plan, report)``."""
    start = time.perf_counter()
    plan = plan_sharding(states, strategy, new, strict=strict)
    route = plan_reshard(states, plan.shardings)
    moved = jax.block_until_ready(reshard(states, plan.shardings, donate=donate))
    report = ResizeReport(
        devices_before=int(old.devices.size),
        mesh_before=describe_mesh(old),
        devices_after=int(new.devices.size),
        mesh_after=describe_mesh(new),
        bytes_moved=route.bytes_moved,
        ideal_bytes=route.ideal_bytes,
        peak_bytes_per_device=route.peak_bytes_per_device,
        seconds=time.perf_counter() - start,
        through_host=route.through_host,
        reshard_plan=route,
    )
    return moved, plan, report
