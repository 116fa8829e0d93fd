"""Non-finite steps: the step decides on the devices whether to apply itself; the host reads why it stopped.

The check rides on values the step computes anyway (the loss and the global
gradient norm, one reduction over every gradient): a step whose loss or norm
is NaN or Inf keeps the state it was given, selected inside the same program,
so the host never has to wait on a step to protect the state. A small
replicated counter travels with the state: ``bad``, the non-finite steps in a
row, and ``skipped``, all the steps not applied. With ``"stop"``, once a step
is not applied no later step is either, so the state stays the one before the
first bad step even though the host learns of it a step late.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def new_guard(mesh: Mesh) -> dict[str, jax.Array]:
    """Zero counters, replicated over ``mesh``."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return {k: jax.device_put(jnp.zeros((), jnp.int32), sharding) for k in ("bad", "skipped")}


def guarded(
    new: Any, old: Any, guard: dict[str, Any], metrics: dict[str, Any], mode: str
) -> tuple[Any, dict[str, Any]]:
    """(traced) ``new`` where the step is finite (and, with ``"stop"``, no earlier one failed), else ``old``."""
    finite = jnp.isfinite(metrics["loss"])
    if "grad_norm" in metrics:
        finite &= jnp.isfinite(metrics["grad_norm"])
    apply = finite & (guard["bad"] == 0) if mode == "stop" else finite
    state = jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
    counters = {
        "bad": jnp.where(apply, 0, guard["bad"] + 1).astype(jnp.int32),
        "skipped": (guard["skipped"] + jnp.where(apply, 0, 1)).astype(jnp.int32),
    }
    return state, counters


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the counters after ``step`` say: keep going, or stop with the state of ``resume_step``."""

    stop: bool
    reason: str | None = None
    resume_step: int | None = None  # the step the live state belongs to, when stopping


def read(guard: dict[str, Any], step: int, mode: str, max_consecutive: int) -> Verdict:
    """Reads the counters after ``step`` on the host (a scalar each, from this process's copy)."""
    bad = int(jax.device_get(guard["bad"].addressable_shards[0].data))
    if bad == 0:
        return Verdict(False)
    first = step - bad + 1
    if mode == "stop":
        return Verdict(True, f"non-finite loss at step {first}", first - 1)
    if bad >= max_consecutive:  # skipped steps left the state as it was: the run ends where it is
        return Verdict(
            True,
            f"non-finite loss at steps {first}-{step} ({bad} in a row, max_consecutive_nonfinite={max_consecutive})",
        )
    return Verdict(False)
