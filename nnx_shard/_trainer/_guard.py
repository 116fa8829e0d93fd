"""Non-finite steps: the step decides on the devices whether to apply itself; the host reads why it stopped.

The check rides on values the step computes anyway (the loss and the global
gradient norm, one reduction over every gradient): a step whose loss or norm
is NaN or Inf keeps the state it was given, decided inside the same program,
so the host never has to wait on a step to protect the state. The Trainer's
own step (:meth:`Trainer.apply_gradients`) puts the update under a
``lax.cond``, which costs nothing measurable; a ``train_step`` override that
updates by itself gets a select between the new and the given state (about
8% of a step on a CPU, where it is a pass over the whole state). A small
replicated counter travels with the state: ``bad``, the non-finite steps in a
row, and ``skipped``, all the steps not applied. With ``"stop"``, once a step
is not applied no later step is either, so the state stays the one before the
first bad step even though the host learns of it a step late.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def new_guard(mesh: Mesh) -> dict[str, jax.Array]:
    """Zero counters, replicated over ``mesh``."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return {k: jax.device_put(jnp.zeros((), jnp.int32), sharding) for k in ("bad", "skipped")}


@dataclasses.dataclass
class Gate:
    """While a step is traced: whether it may apply at all, and the flag the update recorded (if it used
    one)."""

    allow: Any = True
    applied: Any = None


_GATE: contextvars.ContextVar[Gate | None] = contextvars.ContextVar("nnx_shard_gate", default=None)


@contextlib.contextmanager
def gate(counters: dict[str, Any], mode: str) -> Iterator[Gate]:
    """The gate of the step being traced: with ``"stop"``, no step applies after a non-finite one."""
    current = Gate(allow=(counters["bad"] == 0) if mode == "stop" else True)
    token = _GATE.set(current)
    try:
        yield current
    finally:
        _GATE.reset(token)


def current() -> Gate | None:
    return _GATE.get()


def apply_if_finite(model: Any, optimizer: Any, ema: Any, grads: Any, *, loss: Any, grad_norm: Any) -> Any:
    """(traced) ``optimizer.update`` and ``ema.update`` under a ``cond`` on finiteness (and the step's
    gate)."""
    gate = current()
    ok = finite({"loss": loss, "grad_norm": grad_norm}) & (True if gate is None else gate.allow)

    def update(model: Any, optimizer: Any, ema: Any, grads: Any) -> None:
        optimizer.update(model, grads)
        if ema is not None:
            ema.update(model)

    nnx.cond(ok, update, lambda *_: None, model, optimizer, ema, grads)
    if gate is not None:
        gate.applied = ok
    return ok


def count(counters: dict[str, Any], applied: Any) -> dict[str, Any]:
    """(traced) The counters after a step that was applied or not."""
    return {
        "bad": jnp.where(applied, 0, counters["bad"] + 1).astype(jnp.int32),
        "skipped": (counters["skipped"] + jnp.where(applied, 0, 1)).astype(jnp.int32),
    }


def finite(metrics: dict[str, Any]) -> Any:
    ok = jnp.isfinite(metrics["loss"])
    if "grad_norm" in metrics:
        ok &= jnp.isfinite(metrics["grad_norm"])
    return ok


def guarded(
    new: Any, old: Any, guard: dict[str, Any], metrics: dict[str, Any], allow: Any
) -> tuple[Any, dict[str, Any]]:
    """(traced) ``new`` where the step is finite and its gate ``allow``s it, else ``old``.

    For a step that updated without :meth:`Trainer.apply_gradients`: a select over the whole state.
    """
    apply = finite(metrics) & allow
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old), count(guard, apply)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the counters after ``step`` say: keep going, or stop with the state of ``resume_step``."""

    stop: bool
    reason: str | None = None
    resume_step: int | None = None  # the step the live state belongs to, when stopping


def read(guard: dict[str, Any], step: int, mode: str, max_consecutive: int) -> Verdict:
    """Reads the counters after ``step`` on the host (a scalar each, from this process's copy)."""
    bad = int(np.asarray(guard["bad"].addressable_data(0)))
    if bad == 0:
        return Verdict(False)
    first = step - bad + 1
    if mode == "stop":
        return Verdict(True, f"non-finite loss at step {first}", first - 1)
    if bad >= max_consecutive:  # skipped steps left the state as it was: the run ends where it is
        return Verdict(
            True,
            f"non-finite loss at steps {first}-{step} ({bad} in a row, "
            f"max_consecutive_nonfinite={max_consecutive})",
        )
    return Verdict(False)
