"""A plan as a picture: bytes per device by part of the state against a budget, and the largest leaves'
layouts."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._base import Kind, format_bytes, storage
from nnx_shard.errors import MissingExtraError

PARTS = ("model (trainable)", "model (frozen)", "model", "optimizer", "EMA", "other")
COLORS = {
    "model (trainable)": "#4c72b0",
    "model (frozen)": "#8fa8d0",
    "model": "#4c72b0",
    "optimizer": "#dd8452",
}
COLORS |= {"EMA": "#55a868", "other": "#8c8c8c"}


def _part(leaf: Any) -> str:
    if leaf.kind is Kind.MODEL:
        return f"model ({leaf.label})" if leaf.label in ("trainable", "frozen") else "model"
    return {Kind.OPTIMIZER: "optimizer", Kind.EMA: "EMA"}.get(leaf.kind, "other")


def _shard_ids(leaf: Any, mesh: Any) -> np.ndarray:
    """For each device of the mesh (in its own shape, folded to 2-D), which block of ``leaf`` it holds."""
    sharding = NamedSharding(mesh, leaf.spec if leaf.spec is not None else PartitionSpec())
    index = sharding.devices_indices_map(tuple(leaf.shape))
    blocks: dict[Any, int] = {}
    ids = np.zeros(mesh.devices.shape, int)
    for pos, device in np.ndenumerate(mesh.devices):
        key = tuple((s.start, s.stop) for s in index[device])
        ids[pos] = blocks.setdefault(key, len(blocks))
    return ids.reshape(ids.shape[0] if ids.ndim > 1 else 1, -1)


def plot_plan(plan: Any, path: str, *, budget: int | None = None, top: int = 6) -> str:
    """Draws ``plan`` into ``path`` (a PNG, 1200x500 pixels); see :meth:`nnx_shard.ShardingPlan.plot`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingExtraError(
            "plan.plot draws with matplotlib, which is not installed: pip install 'nnx-shard[plot]'."
        ) from e
    fig = Figure(figsize=(12, 5), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 1 + (top + 1) // 2, width_ratios=[2.2] + [1] * ((top + 1) // 2))
    bars = fig.add_subplot(grid[:, 0])
    totals = dict.fromkeys(PARTS, 0)
    for leaf in plan.leaves:
        totals[_part(leaf)] += leaf.bytes_per_device
    left = 0
    for part, nbytes in totals.items():
        if nbytes:
            bars.barh(
                [0],
                [nbytes / 2**20],
                left=left / 2**20,
                color=COLORS[part],
                label=f"{part} {format_bytes(nbytes)}",
            )
            left += nbytes
    if budget is not None:
        bars.axvline(budget / 2**20, color="#c44e52", linestyle="--", label=f"budget {format_bytes(budget)}")
    bars.set_yticks([])
    bars.set_xlabel("MiB on the fullest device")
    bars.set_title(f"{format_bytes(plan.bytes_per_device)} per device of {format_bytes(plan.total_bytes)}")
    bars.legend(loc="upper left", fontsize=8)
    shown = [p for p in plan.leaves if p.shape and p.path.startswith("model/")] or [
        p for p in plan.leaves if p.shape
    ]
    largest = sorted(shown, key=lambda p: -p.total_bytes)[:top]  # the model's: its state is laid out alike
    for k, leaf in enumerate(largest):
        ax = fig.add_subplot(grid[k % 2, 1 + k // 2])
        ax.imshow(_shard_ids(leaf, plan.mesh), cmap="tab20", vmin=0, vmax=19)
        ax.set_xticks([])
        ax.set_yticks([])
        rule = (
            "no rule"
            if leaf.rule_index is None
            else f"rule {leaf.rule_index}: {plan.rules[leaf.rule_index][0]}"
        )
        name = leaf.path if len(leaf.path) <= 28 else "..." + leaf.path[-25:]
        spec = "replicated" if not leaf.sharded else str(tuple(leaf.spec))
        ax.set_title(f"{name}\n{spec}\n{rule}", fontsize=7)
    fig.suptitle(f"sharding plan on {plan.mesh.devices.size} devices: one colour per block held", fontsize=10)
    if storage.is_uri(path):  # a bucket: drawn in memory, written as one object
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        storage.write_bytes(storage.location(path), buffer.getvalue())
    else:
        fig.savefig(path)
    return path
