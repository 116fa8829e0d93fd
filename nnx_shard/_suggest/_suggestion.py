"""``ns.suggest``: the candidate layout that fits a memory budget and sends least, as rules ready to paste."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from nnx_shard._base import describe_mesh, format_bytes, parse_bytes
from nnx_shard._cluster import hbm_bytes
from nnx_shard._sharding import ShardingPlan
from nnx_shard._suggest._layouts import ACTIVATION_RESERVE, Layout, layouts
from nnx_shard.errors import NoLayoutFitsError


@dataclasses.dataclass
class Suggestion:
    """Rules for a memory budget, the plan they give, and what the step costs with them.

    Attributes:
      rules: ``[(regex, tactic), ...]`` in the tactic language, ready for :func:`nnx_shard.infer_sharding`.
      plan: exactly ``plan_sharding(state, rules, mesh)``.
      budget: the bytes per device the state had to fit in (None: no budget).
      state_bytes: the state's bytes on the fullest device.
      traffic: the bytes each device sends per step, by kind (modelled; compiled when ``compiled``).
      why: one reason per rule.
      layout: the name of the layout chosen; ``considered`` every candidate, one line each.
      attempts: :meth:`nnx_shard.Trainer.suggest`'s compiles, one line each (empty for ``ns.suggest``).
      compiled: whether ``traffic`` comes from the compiled step.
    """

    rules: list[tuple[str, str]]
    plan: ShardingPlan
    budget: int | None
    state_bytes: int
    traffic: dict[str, int]
    why: list[str]
    layout: str
    considered: list[str]
    attempts: list[str] = dataclasses.field(default_factory=list)
    compiled: bool = False

    @classmethod
    def of(cls, chosen: Layout, budget: int | None, candidates: list[Layout], **kwargs: Any) -> Suggestion:
        """The suggestion of ``chosen`` among ``candidates`` (``kwargs``: ``attempts``, ``compiled``,
        ``traffic``)."""
        kwargs.setdefault("traffic", dict(chosen.traffic))
        return cls(
            rules=list(chosen.rules),
            plan=chosen.plan,
            budget=budget,
            state_bytes=chosen.state_bytes,
            why=list(chosen.why),
            layout=chosen.name,
            considered=[c.describe(budget) for c in candidates],
            **kwargs,
        )

    def plot(self, path: str, **kwargs: Any) -> str:
        """Draws the plan against the budget (see :meth:`nnx_shard.ShardingPlan.plot`); returns ``path``."""
        return self.plan.plot(path, budget=self.budget, **kwargs)

    def __str__(self) -> str:
        budget = f" (budget {format_bytes(self.budget)})" if self.budget is not None else ""
        mesh = self.plan.mesh
        head = (
            f"# nnx_shard.suggest: {self.layout}, {format_bytes(self.state_bytes)} of state per "
            f"device{budget} "
            f"on {mesh.devices.size} devices ({describe_mesh(mesh)})"
        )
        lines = [head, "rules = ["]
        for index, ((pattern, tactic), why) in enumerate(zip(self.rules, self.why, strict=True)):
            saved = _saved(self.plan, index)
            lines.append(f"    ({pattern!r}, {tactic!r}),  # {why}{saved}")
        lines.append("]")
        how = "compiled" if self.compiled else "modelled"
        sent = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.traffic.items() if v) or "nothing"
        lines.append(f"# sent per device per step ({how}): {sent}")
        lines += [f"# considered: {c}" for c in self.considered]
        lines += [f"# compiled: {a}" for a in self.attempts]
        return "\n".join(lines)


def _saved(plan: ShardingPlan, rule: int) -> str:
    """``; saves 9.1 GiB per device`` for the leaves a rule placed sharded (nothing when none)."""
    saved = sum(p.total_bytes - p.bytes_per_device for p in plan.leaves if p.rule_index == rule)
    return f"; saves {format_bytes(saved)} per device" if saved else ""


def default_budget(mesh: Mesh) -> int | None:
    """The chip's memory less :data:`ACTIVATION_RESERVE` for activations (None where the chip says
    nothing)."""
    hbm = hbm_bytes(mesh.devices.flat[0])
    return None if hbm is None else int(hbm * (1 - ACTIVATION_RESERVE))


def choose(candidates: list[Layout], budget: int | None, key: Any = None) -> Layout:
    """The fitting layout that sends least (the first, the simplest, among equals); NoLayoutFitsError if none
    fits."""
    fitting = [c for c in candidates if budget is None or c.state_bytes <= budget]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.state_bytes)
        largest = sorted(smallest.plan.leaves, key=lambda p: -p.bytes_per_device)[:5]
        shown = ", ".join(f"{p.path} {format_bytes(p.bytes_per_device)}" for p in largest)
        raise NoLayoutFitsError(
            f"no layout fits {format_bytes(budget)} per device: the smallest any reaches is "
            f"{format_bytes(smallest.state_bytes)} ({smallest.name}); the largest leaves per device are "
            f"{shown}. "
            f"Give a larger budget, more devices, or a lower-precision optimizer state."
        )
    return min(fitting, key=key or (lambda c: c.traffic_bytes))


def suggest(
    state: Any, mesh: Mesh, budget: int | str | None = None, *, tokens_per_step: int | None = None
) -> Suggestion:
    """Rules that fit ``state`` into ``budget`` bytes per device and send the least per step.

    ``state`` is abstract or live, as :func:`nnx_shard.infer_sharding` takes it
    (``{"model": ..., "optimizer": ..., "ema": ...}``). The candidates: everything
    replicated, the EMA sharded, ZeRO-1 (optimizer and EMA state sharded,
    parameters replicated: the first matching rule wins), fsdp above a size,
    and with ``tokens_per_step`` the mesh's tensor axes; each is planned
    exactly, its traffic modelled (see :mod:`nnx_shard._suggest._layouts`).
    ``budget`` is bytes or a size (``"16GiB"``); None on a TPU or GPU is the
    chip's memory less :data:`ACTIVATION_RESERVE`, elsewhere no limit.

    Raises:
      NoLayoutFitsError: no candidate fits; names the smallest bytes per device reached and the largest
        leaves.

    >>> import optax
    >>> from nnx_shard import create_mesh, suggest
    >>> def build():
    ...     model = nnx.Linear(1024, 1024, rngs=nnx.Rngs(0))
    ...     return {"model": model, "optimizer": nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
    ...             "ema": nnx.EMA(model, decay=0.99)}
    >>> s = suggest(nnx.eval_shape(build), create_mesh((8,), ("fsdp",)), budget="13MiB")
    >>> s.layout, s.rules[0], s.state_bytes <= 13 * 2**20
    ('EMA sharded', ('^ema/', "fsdp(axis='fsdp', min_size_to_shard_mb=0)"), True)
    """
    limit = parse_bytes(budget) if budget is not None else default_budget(mesh)
    candidates = layouts(state, mesh, tokens_per_step=tokens_per_step)
    return Suggestion.of(choose(candidates, limit), limit, candidates)
