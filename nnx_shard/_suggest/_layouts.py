"""Candidate layouts as rule lists (replicated, EMA or ZeRO-1 sharded, fsdp by size, tensor axes), each
costed.

Bytes are exact: each layout is planned with :func:`nnx_shard.plan_sharding`.
Traffic is a model of the step, per device, ring collectives over the ``n``
devices of the data axes: a replicated trainable parameter of ``B`` bytes
all-reduces its gradient (``2(n-1)/n B``); a sharded one all-gathers its
parameter and reduce-scatters its gradient (``(n-1)/n B`` each, the same
total); a replicated parameter whose optimizer state is sharded (ZeRO-1)
all-reduces its gradient and all-gathers the updated parameter; a kernel over
``t`` tensor devices moves activations, ``4 (t-1)/t x tokens per data shard x
its other dimension`` bytes forward and backward. The compiler can rank
layouts otherwise: :meth:`nnx_shard.Trainer.suggest` checks the ranking by
compiling the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from nnx_shard._base import Kind, entry_axes, flatten_leaves, format_bytes, normalize_spec
from nnx_shard._cluster import DATA_AXES
from nnx_shard._sharding import ShardingPlan, plan_sharding, quiet_planning

ACTIVATION_RESERVE = 0.25  # of a chip's memory kept for activations when the budget is the chip's
TRAFFIC_KINDS = ("gradient all-reduce", "parameter all-gathers", "gradient reduce-scatters", "activations")


@dataclasses.dataclass
class Layout:
    """One candidate: its rules (each with why), its plan, bytes on the fullest device and traffic per
    step."""

    name: str
    rules: list[tuple[str, str]]
    plan: ShardingPlan
    traffic: dict[str, int]
    why: list[str] = dataclasses.field(default_factory=list)

    @property
    def state_bytes(self) -> int:
        return self.plan.bytes_per_device

    @property
    def traffic_bytes(self) -> int:
        return sum(self.traffic.values())

    def describe(self, budget: int | None) -> str:
        over = "" if budget is None or self.state_bytes <= budget else " (over the budget)"
        state, sends = format_bytes(self.state_bytes), format_bytes(self.traffic_bytes)
        return f"{self.name}: {state} per device{over}, sends ~{sends} per step"


def _axes_text(axes: Sequence[str]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def _groups(plan: ShardingPlan) -> dict[Kind, list[str]]:
    """The names of the training state's parts, by kind (``{Kind.EMA: ["ema"], ...}``)."""
    out: dict[Kind, list[str]] = {}
    for p in plan.leaves:
        name = p.path.split("/", 1)[0]
        if name not in out.setdefault(p.kind, []):
            out[p.kind].append(name)
    return out


def _prefix(names: list[str]) -> str:
    """A regex of paths under any of ``names``: ``^ema/``, ``^(optimizer|ema)/``."""
    return f"^{names[0]}/" if len(names) == 1 else f"^({'|'.join(names)})/"


def state_roles(state: Any) -> tuple[set[str], dict[str, str]]:
    """The model's trained parameters (those an optimizer's state mirrors; all, without an optimizer), and
    for each optimizer leaf the parameter it mirrors."""
    leaves = flatten_leaves(state)[0]
    models = [leaf.path.split("/", 1)[0] for leaf in leaves if leaf.kind is Kind.MODEL]
    grouped = bool(models)
    param = lambda mirror: f"{models[0]}/{mirror}" if grouped else mirror
    optimizer = {
        leaf.path: param(leaf.mirror) for leaf in leaves if leaf.mirror and leaf.kind is Kind.OPTIMIZER
    }
    model = [leaf.path for leaf in leaves if not grouped or leaf.kind is Kind.MODEL]
    trained = {p for p in model if p in set(optimizer.values())} if optimizer else set(model)
    return trained, optimizer


def _traffic(
    plan: ShardingPlan, roles: tuple[set[str], dict[str, str]], data: Sequence[str], tokens: int | None
) -> dict[str, int]:
    """The modelled bytes each device sends per step, by kind (see the module's docstring)."""
    mesh, (trained, mirrors) = plan.mesh, roles
    n = math.prod(mesh.shape[a] for a in data)
    out = dict.fromkeys(TRAFFIC_KINDS, 0)
    sharded_state = {  # parameters whose optimizer state is sharded over the data axes
        mirrors[p.path]
        for p in plan.leaves
        if p.path in mirrors and p.spec is not None and _over(p.spec, data, len(p.shape or ()))
    }
    for p in plan.leaves:
        if p.path not in trained or p.shape is None or n == 1:
            continue
        spec = normalize_spec(p.spec or (), len(p.shape), p.path)
        sharded = _over(spec, data, len(p.shape))
        ring = (n - 1) / n * p.bytes_per_device * (n if sharded else 1)
        if sharded:
            out["parameter all-gathers"] += int(ring)
            out["gradient reduce-scatters"] += int(ring)
        else:
            out["gradient all-reduce"] += int(2 * ring)
            if p.path in sharded_state:
                out["parameter all-gathers"] += int(ring)
        t = math.prod(mesh.shape[a] for e in spec for a in entry_axes(e) if a not in data)
        if t > 1 and tokens and len(p.shape) >= 2:
            other = p.shape[-1] if not any(a not in data for a in entry_axes(spec[-1])) else p.shape[-2]
            itemsize = p.total_bytes // math.prod(p.shape)
            out["activations"] += int(4 * (t - 1) / t * tokens / n * other * itemsize)
    return out


def _over(spec: Any, axes: Sequence[str], ndim: int) -> bool:
    return any(a in axes for e in normalize_spec(spec, ndim, "") for a in entry_axes(e))


def layouts(state: Any, mesh: Mesh, *, tokens_per_step: int | None = None) -> list[Layout]:
    """Every candidate layout of ``state`` on ``mesh``, planned and costed, replicated first."""
    data = [a for a in mesh.axis_names if a in DATA_AXES] or list(mesh.axis_names)
    tensor = [a for a in mesh.axis_names if a not in data]
    D, every = _axes_text(data), _axes_text([*data, *tensor])
    roles = state_roles(state)
    replicated = plan_sharding(state, [(".*", "replicate()")], mesh)  # the first candidate's plan too
    groups = _groups(replicated)
    candidates: list[tuple[str, list[tuple[str, str]], list[str]]] = [
        (
            "everything replicated",
            [(".*", "replicate()")],
            ["everything replicated: its gradients all-reduced"],
        )
    ]
    ema, optimizer = groups.get(Kind.EMA, []), groups.get(Kind.OPTIMIZER, [])
    sharded = f"fsdp(axis={D}, min_size_to_shard_mb=0)"
    if ema:
        notes = [
            f"EMA state sharded over {D}: each device averages its own slice, no communication per step",
            "the rest replicated: gradients all-reduced",
        ]
        candidates.append(("EMA sharded", [(_prefix(ema), sharded), (".*", "replicate()")], notes))
    if ema and optimizer:
        notes = [
            f"optimizer and EMA state sharded over {D}: the updated parameters all-gathered each step",
            "parameters replicated: gradients all-reduced",
        ]
        candidates.append(("ZeRO-1", [(_prefix(optimizer + ema), sharded), (".*", "replicate()")], notes))
    candidates += _fsdp_candidates(replicated, D, every, tensor, tokens_per_step)
    out = []
    for name, rules, why in candidates:
        if rules == replicated.rules:
            plan = replicated
        else:
            with quiet_planning():  # the candidates' notes are not about rules the user wrote
                plan = plan_sharding(state, rules, mesh, strict=False)
        out.append(Layout(name, rules, plan, _traffic(plan, roles, data, tokens_per_step), why))
    return out


def _fsdp_candidates(
    replicated: ShardingPlan, D: str, every: str, tensor: list[str], tokens_per_step: int | None
) -> list[tuple[str, list[tuple[str, str]], list[str]]]:
    """The fsdp candidates: above a few size thresholds, with the tensor axes, over every axis."""
    out = []
    sizes = sorted({p.total_bytes for p in replicated.leaves}, reverse=True)
    thresholds = sorted({_round_mb(s) for s in sizes[: max(1, len(sizes) // 2)]} | {0.0}, reverse=True)[:5]
    for mb in thresholds:
        which = f"parameters above {mb:g} MiB (and their" if mb else "every parameter (and its"
        why = (
            f"{which} optimizer and EMA state) sharded over {D}: parameters all-gathered and gradients "
            "reduce-scattered instead of all-reduced, the same bytes"
        )
        name = f"fsdp above {mb:g} MiB" if mb else "full fsdp"
        out.append((name, [(".*", f"fsdp(axis={D}, min_size_to_shard_mb={mb:g})")], [why]))
    if tensor and tokens_per_step:
        T = _axes_text(tensor)
        why = f"parameters sharded over {D} and, on another dimension, over the tensor axes {T}: "
        why += "activations move"
        rule = f"fsdp(axis={D}, min_size_to_shard_mb=0)|fsdp(axis={T}, min_size_to_shard_mb=0)"
        out.append(("fsdp with tensor axes", [(".*", rule)], [why]))
    if tensor:
        why = f"every parameter and its state sharded over every mesh axis {every}: the least memory"
        out.append(("fsdp over every axis", [(".*", f"fsdp(axis={every}, min_size_to_shard_mb=0)")], [why]))
    return out


def _round_mb(nbytes: int) -> float:
    """A threshold below a leaf's size, a power of two in MiB (that leaf and those above it are sharded)."""
    mb = nbytes / 2**20
    return 0.0 if mb < 1 / 64 else float(2.0 ** (math.floor(math.log2(mb)) - 1))
