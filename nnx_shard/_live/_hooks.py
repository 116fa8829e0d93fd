"""ShardingHooks: the one owner of (strategy, mesh, plan, live objects); places them on init, restore and
resize."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from nnx_shard._base import TrainingState, as_state
from nnx_shard._checkpoint import (
    Checkpointer,
    LoadedState,
    RestoreOptions,
    RestoreReport,
    check_keys,
    restore_onto,
)
from nnx_shard._cluster import barrier_sync
from nnx_shard._live._placement import create_sharded
from nnx_shard._live._resize import ResizeReport, move
from nnx_shard._live._restore_objects import read_arguments, write_states
from nnx_shard._reshard import reshard
from nnx_shard._sharding import ShardingPlan, plan_sharding
from nnx_shard.errors import LifecycleError

logger = logging.getLogger("nnx_shard")


class LiveObjects(Mapping[str, Any]):
    """The live training state that :meth:`ShardingHooks.on_init` returns: every read (``objects.model``, or
    ``objects["model"]`` as a mapping) syncs it with the last :meth:`ShardingHooks.update` first, so it is
    never stale (an object taken out of it earlier is brought up to date by the next read, or by
    ``hooks.sync()``)."""

    def __init__(self, hooks: ShardingHooks):
        self._hooks = hooks

    def __getitem__(self, key: str) -> Any:
        return self._hooks.training_state[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._hooks.training_state, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._hooks.training_state)

    def __len__(self) -> int:
        return len(self._hooks.training_state)

    def __repr__(self) -> str:
        return f"LiveObjects({sorted(self._hooks.training_state)})"


class ShardingHooks:
    """Keeps a model, its ``nnx.Optimizer`` and its EMA on the shardings one strategy infers.

    The hooks own the strategy, the mesh, the plan and the live objects;
    everything that changes where the objects live goes through them.
    ``on_init`` creates the objects already sharded (or moves given ones into
    place); ``on_restore`` brings state that Orbax (or anything else) loaded,
    on any mesh, on the host or as numpy, onto the current mesh, donatable,
    and updates the live objects; :meth:`restore_and_reshard` reads a
    checkpoint straight into the current shardings. Each ends with a named
    :func:`barrier_sync`. The EMA and every optimizer slot follow their
    parameter's sharding. A functional loop takes :meth:`states` and gives
    the new ones back with :meth:`update`.

    Args:
      strategy: ``[(regex, tactic), ...]`` written against the model's parameter paths.
      mesh: the current mesh.
      strict: as for :func:`nnx_shard.infer_sharding`.
      barrier_timeout: seconds for the barriers after init and restore.

    >>> import optax
    >>> from nnx_shard import create_mesh
    >>> strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
    >>> hooks = ShardingHooks(strategy, create_mesh((8,), ("fsdp",)))
    >>> from nnx_shard import TrainingState
    >>> def create():
    ...     model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
    ...     return TrainingState(model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param),
    ...                          nnx.EMA(model, decay=0.9))
    >>> state = hooks.on_init(create)
    >>> state.ema.params["kernel"].get_value().sharding.spec
    P(None, 'fsdp')
    """

    def __init__(
        self,
        strategy: Sequence[tuple[str, Any]],
        mesh: Mesh,
        *,
        strict: bool = True,
        barrier_timeout: float = 200.0,
    ):
        self._strategy = list(strategy)
        self._mesh = mesh
        self._strict = strict
        self.barrier_timeout = barrier_timeout
        self._objects: TrainingState | None = None
        self._pending: dict[str, Any] | None = None
        self._plan: ShardingPlan | None = None

    # -- what the hooks own --------------------------------------------------------

    @property
    def strategy(self) -> list[tuple[str, Any]]:
        return self._strategy

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def initialized(self) -> bool:
        return self._objects is not None

    @property
    def plan(self) -> ShardingPlan:
        """The sharding plan of the live objects."""
        self._require("a plan")
        return self._plan

    @property
    def shardings(self) -> Any:
        """The inferred shardings of the live objects (a dict of States)."""
        return self.plan.shardings

    @property
    def training_state(self) -> TrainingState:
        """The live training state (``.model``, ``.optimizer``, ``.ema`` and any other parts), up to date with
        the last :meth:`update` (reading it calls :meth:`sync`)."""
        self.sync()
        return self._objects

    @property
    def objects(self) -> dict[str, Any]:
        """Deprecated: :attr:`training_state`, which reads as the same mapping."""
        warnings.warn(
            "ShardingHooks.objects is now ShardingHooks.training_state (a TrainingState: .model, .optimizer, "
            ".ema; it reads as the same mapping).",
            DeprecationWarning,
            stacklevel=2,
        )
        return dict(self.training_state)

    def sync(self) -> None:
        """Writes the states given to :meth:`update` into the live objects the user holds."""
        self._require("live objects")
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None

    def _require(self, what: str) -> None:
        if self._objects is None:
            raise LifecycleError(
                f"the hooks have no {what} yet: call on_init(create) or adopt(objects) first."
            )

    def states(self) -> dict[str, Any]:
        """The live state of each object (``nnx.State``), as a jitted step takes it."""
        self._require("live objects")
        return dict(self._pending) if self._pending is not None else as_state(self._objects)[0]

    def update(self, states: Mapping[str, Any]) -> None:
        """Takes new states (a jitted step's output) for the live objects.

        They reach the objects on :meth:`sync` (or when :attr:`objects` is read),
        so a loop that passes states from step to step pays nothing per step.
        """
        self._require("live objects")
        if set(states) == set(self._objects):  # a step's output: every object (the loop's case)
            self._pending = dict(states)
            return
        check_keys(states, self._objects, "states for {unknown}, which are not among the objects {objects}.")
        self._pending = {**self.states(), **states}

    def _write(self, states: Mapping[str, Any]) -> None:
        write_states(self._objects, states)

    # -- init ------------------------------------------------------------------------

    def on_init(
        self,
        create: Callable[[], Mapping[str, Any]] | None = None,
        *,
        objects: Mapping[str, Any] | None = None,
    ) -> Mapping[str, Any]:
        """Creates the objects sharded from ``create()``, or moves existing ``objects`` into place.

        Args:
          create: returns a :class:`~nnx_shard.TrainingState` (or ``{"model": ..., "optimizer": ..., "ema":
            ...}``); run abstractly, then under jit so no device holds an unsharded array.
          objects: existing objects to move onto the inferred shardings instead.

        Returns:
          The live objects, as a mapping that stays current: each read brings the
          objects up to date with the last :meth:`update` first (as :attr:`objects` does).
        """
        if (create is None) == (objects is None):
            raise LifecycleError(
                "on_init takes exactly one of create= (a factory) or objects= (live objects)."
            )
        if create is not None:
            made, plan = create_sharded(create, self._strategy, self._mesh, strict=self._strict)
            self._objects, self._plan, self._pending = TrainingState.of(made), plan, None
        else:
            self.adopt(objects)
            self._write(reshard(self.states(), self._plan.shardings, donate=True))
        barrier_sync("nnx_shard/on_init", timeout=self.barrier_timeout)
        return LiveObjects(self)

    def adopt(self, objects: Mapping[str, Any]) -> Mapping[str, Any]:
        """Takes ``objects`` (live or abstract) as they are and plans their shardings; moves nothing.

        Use it to restore into objects built elsewhere (the restore then puts
        every array in place).
        """
        self._objects, self._pending = TrainingState.of(objects), None
        self._plan = plan_sharding(self._objects, self._strategy, self._mesh, strict=self._strict)
        return LiveObjects(self)

    # -- restore -------------------------------------------------------------------------

    def on_restore(self, restored: Mapping[str, Any]) -> RestoreReport:
        """Puts loaded state onto the current shardings and into the live objects.

        ``restored`` maps the same keys as the objects to States, pure dicts
        (``nnx.to_pure_dict``) or numpy trees, on any mesh or on the host.
        Arrays on devices are resharded (no host round trip); host data is
        placed shard by shard. The results own their buffers, so the next
        jitted step can donate them. The same as ``restore_and_reshard(restored)``.
        """
        return self.restore_and_reshard(LoadedState(restored))

    def restore_and_reshard(
        self,
        source: Any = None,
        *,
        step: int | None = None,
        options: RestoreOptions | None = None,
        only: Sequence[str] | None = None,
        orbax_item: str | None = None,
        ema_as_model: bool = False,
        free_live: bool = False,
        max_host_bytes: int | None = None,
        frozen: Any = None,
        **old: Any,
    ) -> RestoreReport:
        """Restores ``step`` (default: the latest) of ``source`` onto the current devices.

        The read goes straight into the shardings inferred for the current
        mesh, whatever the device and process counts were at save time. A
        restore that fails leaves the live objects as they were, unless
        ``free_live`` asked to free them first (to keep the peak low).

        Args:
          source: a :class:`Checkpointer`, or a directory: nnx_shard's own,
            or one written by plain Orbax (``CheckpointManager`` items,
            ``StandardCheckpointer``, ``ocp.v1.save``), whose item that
            fits each object is read (see :mod:`nnx_shard._checkpoint._plain`);
            a safetensors folder (into the model); states already loaded (as
            :meth:`on_restore` takes them); or any registered source.
          step: the step (default: the latest).
          options: the keywords below as one :class:`RestoreOptions` (then none of them is given:
            giving both raises :class:`~nnx_shard.errors.ConflictingArgumentsError`).
          only: restore only these objects (default: all the hooks own); the
            checkpoint's other objects are not read. Within an object the structure
            must match exactly.
          orbax_item: for a plain Orbax checkpoint, the name of its item to read.
          ema_as_model: load the checkpoint's EMA parameters into the model's
            parameters (the model's other state, such as batch statistics and
            RNG counters, from the checkpoint's model); the EMA object itself
            is not restored.
          free_live: free the live arrays being restored before the read, so the
            restored state is never resident beside them.
          max_host_bytes: bound the host memory the read holds at once (Orbax's
            restore byte limiter); with ``free_live`` the peak stays near the
            state's own size.
          frozen: an nnx filter of model parameters the checkpoint does not hold
            (saved without them): they keep their live values.

        ``items=``, ``item=`` and ``checkpointer=`` are the old names of ``only=``,
        ``orbax_item=`` and ``source`` (they warn).
        """
        keywords = {
            "only": only,
            "orbax_item": orbax_item,
            "ema_as_model": ema_as_model,
            "free_live": free_live,
        }
        keywords |= {"max_host_bytes": max_host_bytes, "frozen": frozen}
        source, opts = read_arguments("ShardingHooks.restore_and_reshard", source, options, keywords, old)
        self._require("live objects to restore into")
        restored, report = restore_onto(
            source, self.states(), self.shardings, self._mesh, step=step, options=opts
        )
        self.update(restored)  # the restored arrays own their buffers: donatable (tested)
        barrier_sync("nnx_shard/restore_and_reshard", timeout=self.barrier_timeout)
        logger.info("%s", report)
        return report

    def on_mesh_change(self, mesh: Mesh, *, donate: bool = True) -> ResizeReport:
        """Moves the live objects onto ``mesh``: the shardings the strategy infers there.

        Model, optimizer and EMA (RNG state and statistics included) move with
        :func:`nnx_shard.reshard`: one program per step over the old and new
        devices sends each piece a new device lacks once, nothing goes through
        the host. The objects the user holds are the live ones afterwards, and
        with ``donate`` the old layout's buffers are freed as each step
        completes. With several processes, every process calls it together;
        it ends with a named barrier. The mesh may leave processes out, or take
        them back: a process with no device in ``mesh`` then holds arrays with
        no shard of its own, and the others run the steps on their devices.

        Returns:
          A :class:`ResizeReport`, e.g. ``moved from 8 devices (fsdp=8) to 4
          devices (fsdp=4): 1.12 GiB moved of 1.12 GiB ideal, peak 24.0 MiB per
          device, 0.40 s``.

        >>> import optax
        >>> from nnx_shard import create_mesh
        >>> strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
        >>> hooks = ShardingHooks(strategy, create_mesh((8,), ("fsdp",)))
        >>> objects = hooks.on_init(lambda: {"model": nnx.Linear(4, 64, rngs=nnx.Rngs(0))})
        >>> report = hooks.on_mesh_change(create_mesh((4,), ("fsdp",), devices=jax.devices()[:4]))
        >>> str(report).startswith("moved from 8 devices (fsdp=8) to 4 devices (fsdp=4)")
        True
        >>> objects["model"].kernel.get_value().sharding.spec, hooks.mesh.devices.size
        (P(None, 'fsdp'), 4)
        """
        self._require("live objects to move")
        barrier_sync("nnx_shard/on_mesh_change/start", timeout=self.barrier_timeout)
        moved, plan, report = move(
            self.states(), self._strategy, self._mesh, mesh, strict=self._strict, donate=donate
        )
        self._mesh, self._plan = mesh, plan
        self.update(moved)
        self.sync()  # the objects the user holds now hold the moved arrays
        barrier_sync("nnx_shard/on_mesh_change", timeout=self.barrier_timeout)
        logger.info("%s", report)
        return report

    def states_on(self, mesh: Mesh) -> dict[str, Any]:
        """A copy of the live states on the shardings the strategy infers for ``mesh``; the live ones stay.

        Moved like :meth:`on_mesh_change` (each piece sent once, nothing through the host), without
        freeing anything: e.g. the state written from every process while the live mesh leaves some
        out (a Trainer's saves after such a :meth:`nnx_shard.Trainer.resize`). Every process calls it.
        """
        self._require("live objects to copy")
        copy, _, _ = move(self.states(), self._strategy, self._mesh, mesh, strict=self._strict, donate=False)
        return copy

    def save(
        self, checkpointer: Checkpointer, step: int, *, metrics: Mapping[str, float] | None = None
    ) -> bool:
        """Saves the live objects with this mesh and strategy in the metadata."""
        self._require("live objects to save")
        return checkpointer.save(
            step, self.states(), metrics=metrics, mesh=self._mesh, strategy=self._strategy
        )
