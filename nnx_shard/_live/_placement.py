"""Placing state: place_like_target, and sharded init that never materializes a full array."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, Sharding

from nnx_shard._base import (
    TrainingState,
    abstract_construction,
    as_state,
    flatten_with_paths,
    format_spec,
    is_graph_object,
    spec_problems,
    threefry_kernel,
    visible,
)
from nnx_shard._reshard import from_host, reshard
from nnx_shard._sharding import ShardingPlan, logical_rules_of, parse_tactic, plan_sharding
from nnx_shard.errors import PlacementError

log = logging.getLogger("nnx_shard")


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (nnx.Variable, Sharding)) or x is None


def _target_sharding(ref: Any) -> tuple[Sharding | None, tuple[int, ...] | None, Any]:
    """The sharding, shape and dtype a target leaf asks for (shape/dtype None when unknown)."""
    if isinstance(ref, nnx.Variable):
        ref = ref.get_value()
    if isinstance(ref, Sharding):
        return ref, None, None
    sharding = getattr(ref, "sharding", None)
    shape = getattr(ref, "shape", None)
    return sharding, None if shape is None else tuple(shape), getattr(ref, "dtype", None)


def _flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    flat, treedef = flatten_with_paths(tree, is_leaf=_is_leaf)
    return dict(flat), treedef


def _indivisible(sharding: Sharding, shape: tuple[int, ...]) -> str | None:
    """How ``sharding`` fails to divide ``shape`` evenly, in words; None when it does."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if len(spec) > len(shape):
            return f"{format_spec(spec)}: the spec has more entries than the array has dimensions"
        for p in spec_problems(spec, shape, sharding.mesh.shape):
            if p.kind == "indivisible":
                return (
                    f"{format_spec(spec)}: dim {p.dim} of size {p.size} is not divisible by the "
                    f"{p.shards} shards of {p.axis!r}"
                )
        return None
    try:
        sharding.shard_shape(shape)
    except ValueError as e:
        return f"{sharding}: {str(e).splitlines()[0]}"
    return None


def _move_device_arrays(plan: list[tuple[str, Any, Sharding | None]]) -> list[jax.Array]:
    """The plan's device arrays on their targets, in order, through the reshard engine: each piece sent once,
    no whole array gathered on one device (``jax.device_put`` may), the inputs left as they were."""
    raws = [(v.get_value() if isinstance(v, nnx.Variable) else v, s) for _, v, s in plan if s is not None]
    arrays = [(raw, s) for raw, s in raws if isinstance(raw, jax.Array)]
    return reshard([raw for raw, _ in arrays], [s for _, s in arrays]) if arrays else []


def _check_leaf(path: str, raw: Any, sharding: Sharding, shape: Any, dtype: Any) -> None:
    """PlacementError when ``raw`` does not fit its target (shape, dtype, divisibility, addressable
    devices)."""
    got_shape = tuple(np.shape(raw))
    if shape is not None and got_shape != shape:
        raise PlacementError(
            f"{path!r} has shape {got_shape} but its target has {shape}; the first "
            f"differing leaf. Check the model config (sizes) matches the target's."
        )
    got_dtype = getattr(raw, "dtype", None)
    if dtype is not None and got_dtype is not None and np.dtype(got_dtype) != np.dtype(dtype):
        raise PlacementError(
            f"{path!r} has dtype {got_dtype} but its target has {dtype}. Cast it first (nothing is cast "
            "silently)."
        )
    problem = _indivisible(sharding, got_shape)
    if problem:
        raise PlacementError(
            f"{path!r} of shape {got_shape} cannot be placed on {problem}. Pad the array, pick "
            f"a sharding whose shards divide it, or infer one with infer_sharding (fsdp skips "
            f"dimensions it cannot divide)."
        )
    if not sharding.addressable_devices:
        devices = sorted(d.id for d in sharding.device_set)
        raise PlacementError(
            f"the target of {path!r} is on devices {devices[:8]}{'...' if len(devices) > 8 else ''}, "
            f"none of which process {jax.process_index()} can address, so it cannot contribute "
            f"its data. Build targets on a mesh over jax.devices() (all processes' devices)."
        )


def place_like_target(tree: Any, target: Any) -> Any:
    """Puts every leaf of ``tree`` onto the sharding of the matching leaf of ``target``.

    ``tree`` holds numpy arrays, Python scalars or jax arrays on any devices;
    ``target`` holds jax arrays, abstract arrays carrying ``.sharding``
    (``jax.ShapeDtypeStruct(..., sharding=...)``) or shardings. Leaves whose
    value or target has no sharding pass through unchanged. Host data goes
    through ``jax.make_array_from_callback``, so in a multi-process run each
    process builds only the shards its own devices hold. Device arrays move
    through :func:`nnx_shard.reshard` (each piece sent once, never a whole
    array on one device; the inputs stay valid). Everything is checked before
    the first transfer, so a mismatch places nothing.

    Args:
      tree: an ``nnx.State``, a Module (updated in place and returned) or a pytree.
      target: the same structure, as described above.

    Returns:
      ``tree`` with its arrays on the target shardings.

    Raises:
      PlacementError: the structures differ (the first differing paths are
        named), a leaf's shape or dtype differs from its target's, a target
        sharding does not divide the leaf's shape, or a target lies only on
        devices this process cannot address; all checked before any transfer.

    >>> import numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> target = {"w": NamedSharding(mesh, P("fsdp")), "n": None}
    >>> out = place_like_target({"w": np.ones((16, 4)), "n": "tag"}, target)
    >>> out["w"].sharding.spec, out["n"]
    (P('fsdp',), 'tag')
    """
    module = tree if is_graph_object(tree) else None
    values_tree, _ = as_state(tree)
    target_tree, _ = as_state(target)
    values, treedef = _flatten(values_tree)
    targets, _ = _flatten(target_tree)
    if list(values) != list(targets):
        missing = [p for p in targets if p not in values][:5]
        extra = [p for p in values if p not in targets][:5]
        raise PlacementError(
            "the tree does not have the target's structure: "
            + (f"missing {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"not in the target {extra}" if extra else "")
            + ("the same paths in another order" if not missing and not extra else "")
            + ". Build the target from the same model, optimizer and EMA classes and config."
        )
    plan: list[tuple[str, Any, Sharding | None]] = []
    for path, value in values.items():
        raw = value.get_value() if isinstance(value, nnx.Variable) else value
        sharding, shape, dtype = _target_sharding(targets[path])
        if sharding is None or (
            not hasattr(raw, "shape") and not isinstance(raw, (int, float, bool, complex))
        ):
            plan.append((path, value, None))
            continue
        _check_leaf(path, raw, sharding, shape, dtype)
        plan.append((path, value, sharding))
    placed: list[Any] = []
    try:
        moved = iter(_move_device_arrays(plan))
        for _, value, sharding in plan:
            if sharding is None:
                placed.append(value)
                continue
            raw = value.get_value() if isinstance(value, nnx.Variable) else value
            array = next(moved) if isinstance(raw, jax.Array) else from_host(raw, sharding)
            placed.append(value.replace(array) if isinstance(value, nnx.Variable) else array)
    except Exception:
        for x in placed:  # leave nothing half-placed behind
            arr = x.get_value() if isinstance(x, nnx.Variable) else x
            if isinstance(arr, jax.Array) and not any(arr is v for _, v, _ in plan):
                arr.delete()
        raise
    out = jax.tree_util.tree_unflatten(treedef, placed)
    if module is not None:
        nnx.update(module, out)
        return module
    return out


def create_sharded(
    factory: Callable[[], Any],
    strategy: Sequence[tuple[str, Any]],
    mesh: Mesh,
    *,
    strict: bool = True,
) -> tuple[Any, ShardingPlan]:
    """Creates a Module, Optimizer and EMA (or a dict/tuple of them) directly in their shardings.

    The factory runs once abstractly (``nnx.eval_shape``) to infer shardings,
    then under ``jax.jit(..., out_shardings=...)``, so XLA computes each shard
    on its own device: no device ever holds an unsharded copy of a sharded
    array, and the values are bitwise those of an unsharded init.

    Args:
      factory: builds the objects, e.g. ``lambda: {"model": m, "optimizer": ..., "ema": ...}``.
      strategy: ``[(regex, tactic), ...]`` as for :func:`nnx_shard.infer_sharding`.
      mesh: the mesh.
      strict: as for :func:`nnx_shard.infer_sharding`.

    Returns:
      ``(objects, plan)``: what ``factory`` returns, placed, and the sharding plan.

    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> model, plan = create_sharded(lambda: nnx.Linear(8, 64, rngs=nnx.Rngs(0)),
    ...                              [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh)
    >>> model.kernel.get_value().sharding.spec
    P(None, 'fsdp')
    """
    init, abstract, plan = sharded_init_fn(factory, strategy, mesh, strict=strict)
    return _merge(abstract, init()), plan


def sharded_init_fn(
    factory: Callable[[], Any],
    strategy: Sequence[tuple[str, Any]],
    mesh: Mesh,
    *,
    strict: bool = True,
) -> tuple[Any, Any, ShardingPlan]:
    """The jitted init behind :func:`create_sharded`, for inspection.

    Returns ``(init, abstract, plan)``: ``init()`` returns the states (lower
    and compile it to read XLA's ``memory_analysis()``), ``abstract`` is
    ``nnx.eval_shape(factory)``.

    >>> from nnx_shard import create_mesh
    >>> init, abstract, plan = sharded_init_fn(lambda: nnx.Linear(8, 64, rngs=nnx.Rngs(0)),
    ...     [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], create_mesh((8,), ("fsdp",)))
    >>> memory = init.lower().compile().memory_analysis()
    >>> memory.output_size_in_bytes - plan.bytes_per_device  # one 8-byte pointer per output
    16
    """
    tactics = [parse_tactic(t) if isinstance(t, str) else t for _, t in strategy]
    rules = logical_rules_of(tactics)
    eager: bool | None = None  # Flax's own setting
    try:
        with _creation(mesh, rules, eager):
            with abstract_construction():
                abstract = nnx.eval_shape(factory)
    except ValueError as first:
        # Flax could not place an annotation on this mesh (an axis the mesh lacks, a logical name
        # no rule maps, a mesh of mixed axis types). ``nnx.eval_shape`` attaches shardings whenever
        # a mesh is in context, even with eager sharding turned off globally (google-tunix does so
        # on import), so this is retried with no mesh in context whatever Flax's flags say: the
        # plan places every leaf. A factory's own ValueError raises again from the retry.
        eager = False
        log.debug("creation under the mesh failed (%s); retrying with no mesh in context", first)
        with _creation(mesh, rules, eager):
            with abstract_construction():
                abstract = nnx.eval_shape(factory)
        log.info("created with Flax's eager sharding off: an annotation does not name this mesh's axes")
    plan = plan_sharding(abstract, strategy, mesh, strict=strict)

    def init() -> Any:
        with _creation(mesh, rules, eager):
            return _states(factory())

    return ShardedInit(jax.jit(init, out_shardings=plan.shardings), mesh), abstract, plan


class ShardedInit:
    """The jitted init of :func:`sharded_init_fn`: call it, or ``lower()`` it to compile and inspect.

    On GPUs it is lowered with JAX's threefry kernel (``jax.random`` bits
    unchanged): XLA compiles the inlined hash of a model's 200 arrays for
    minutes, the kernel in seconds. The setting holds inside the call only.
    """

    def __init__(self, jitted: Any, mesh: Mesh):
        self.jitted = jitted
        self.platform = mesh.devices.flat[0].platform

    def __call__(self) -> Any:
        with threefry_kernel(self.platform):
            return self.jitted()

    def lower(self) -> Any:
        """``jax.jit``'s ``lower()``, under the same threefry setting as a call (``.compile()`` next)."""
        with threefry_kernel(self.platform):
            return self.jitted.lower()


@contextlib.contextmanager
def _creation(mesh: Mesh, rules: Any, eager: bool | None) -> Iterator[None]:
    """What Flax's eager sharding needs while a model is created: ``mesh`` in context, the strategy's logical
    rules in force.

    With ``eager`` False, Flax's eager sharding is off and no mesh is in
    context (``nnx.eval_shape`` would place the annotations on it): the plan
    alone places the leaves.
    """
    with contextlib.ExitStack() as stack:
        if eager is False:
            stack.enter_context(nnx.use_eager_sharding(False))
            stack.enter_context(jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())))
        else:
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
            if rules:
                stack.enter_context(nnx.logical_axis_rules(rules))
        yield


def _states(objects: Any) -> Any:
    state, _ = as_state(visible(objects))
    return state


def _merge(abstract: Any, states: Any) -> Any:
    if is_graph_object(abstract):
        return nnx.merge(nnx.graphdef(abstract), states)
    if isinstance(abstract, TrainingState):
        return TrainingState.of({k: _merge(v, states[k]) for k, v in abstract.items()})
    if isinstance(abstract, dict):
        return {k: _merge(v, states[k]) for k, v in abstract.items()}
    if isinstance(abstract, (list, tuple)):
        return type(abstract)(_merge(v, s) for v, s in zip(abstract, states, strict=True))
    return states
