"""A Trainer's own train step compiled ahead of time for other devices (a TPU pod from a laptop), on abstract state."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import abstract_construction, mesh_from_string
from nnx_shard._checkpoint import abstract_target
from nnx_shard._cluster import CompileReport, compile_program, data_sharding
from nnx_shard._sharding import ShardingPlan, on_mesh, plan_sharding
from nnx_shard._trainer._step import CompiledSteps


@dataclasses.dataclass
class _AbstractHooks:
    """What the step reads of a Trainer's hooks, for a mesh of devices that hold nothing."""

    mesh: Mesh
    plan: ShardingPlan

    @property
    def shardings(self) -> Any:
        return self.plan.shardings


def mesh_over(mesh: Any, devices: Sequence[Any]) -> Mesh:
    """The config's mesh (a string, or a Mesh whose axis names and sizes are reused) over ``devices``."""
    if isinstance(mesh, Mesh):
        sizes = [-1 if k == 0 else v for k, v in enumerate(mesh.shape.values())]
        return mesh_from_string(
            ",".join(f"{n}:{s}" for n, s in zip(mesh.axis_names, sizes, strict=True)), devices=list(devices)
        )
    return mesh_from_string(str(mesh), devices=list(devices))


class AheadOfTime:
    """The Trainer's ahead-of-time compile (a base class of :class:`nnx_shard.Trainer`).

    What it uses of the Trainer is declared here; the Trainer defines each.
    """

    config: ml_collections.ConfigDict
    hooks: Any  # ShardingHooks; swapped for abstract ones while compiling
    _param_shardings: dict[str, Any] | None

    def _create(self) -> dict[str, Any]:
        raise NotImplementedError

    def train_step(
        self, model: nnx.Module, optimizer: Any, ema: nnx.EMA | None, batch: Any
    ) -> dict[str, Any]:
        raise NotImplementedError

    def compile_report(self, devices: Sequence[Any], batch: Any) -> CompileReport:
        """Compiles this Trainer's own train step for ``devices`` and reports what each holds and sends.

        The model, optimizer, EMA, strategy and mesh config are laid over
        ``devices`` on abstract state: nothing is created or run, so the devices
        may be a TPU pod's (:func:`nnx_shard.tpu_devices`) on a laptop.

        Args:
          devices: the devices to compile for; ``config.mesh`` is laid over them.
          batch: a global batch of ``jax.ShapeDtypeStruct`` (or arrays: their shapes alone are used).

        Returns:
          A :class:`nnx_shard.CompileReport`; ``fits`` is False, with the compiler's
          figures, when XLA's TPU compiler refuses the step for memory.

        >>> import jax, numpy as np, optax, nnx_shard as ns
        >>> from flax import nnx
        >>> class Tiny(ns.Trainer):
        ...     def create_model(self, rngs): return nnx.Linear(16, 16, rngs=rngs)
        ...     def create_optimizer(self): return optax.adam(1e-3)
        ...     def loss_fn(self, model, batch): return (model(batch["x"]) ** 2).mean()
        >>> report = Tiny({"mesh": "fsdp:-1"}).compile_report(jax.devices(), {"x": jax.ShapeDtypeStruct((64, 16), np.float32)})
        >>> report.devices, report.state_bytes > 0, "all-reduce" in report.collectives
        (8, True, True)
        """
        mesh = mesh_over(self.config.mesh, devices)
        with abstract_construction():
            objects = nnx.eval_shape(self._create)
        graphdefs = {k: nnx.graphdef(v) for k, v in objects.items()}
        states = {k: nnx.state(v) for k, v in objects.items()}
        plan = plan_sharding(states, list(self.config.sharding_strategy), mesh)
        target = {k: abstract_target(states[k], plan.shardings[k]) for k in states}
        rows = data_sharding(mesh)
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=rows), batch)
        replicated = NamedSharding(mesh, PartitionSpec())
        counters = {k: jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated) for k in ("bad", "skipped")}
        hooks = _AbstractHooks(mesh, plan)
        steps = CompiledSteps(hooks, self.train_step, self.config.on_nonfinite)  # type: ignore[arg-type]
        steps.graphdefs.update(graphdefs)
        with self._hooks_swapped(hooks), on_mesh(mesh):
            fn, kwargs = steps.program(batch)
            report = compile_program(fn, (target, counters, batch), list(devices), plan=plan, **kwargs)
        report.batch_bytes = sum(
            int(np.prod(rows.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(batch)
        )
        return report

    @contextlib.contextmanager
    def _hooks_swapped(self, hooks: _AbstractHooks) -> Iterator[None]:
        live, shardings = self.hooks, self._param_shardings
        self.hooks, self._param_shardings = hooks, None
        try:
            yield
        finally:
            self.hooks, self._param_shardings = live, shardings
