"""Explicit mesh axes: running code written for Auto meshes (a model, an optimizer update) over state placed
on them.

On an Explicit axis every traced value carries its sharding in its type, and
an op whose result sharding is ambiguous (a matmul over a sharded contracting
dimension, as fsdp makes) is refused. A model written for Auto meshes runs
unchanged inside ``jax.sharding.auto_axes``, which turns the Explicit axes
Auto for its body and puts the outputs back in the shardings given: that is
what the Trainer does with its steps, and what :func:`auto_axes` does for a
step of your own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from nnx_shard._base import is_graph_object

F = TypeVar("F", bound=Callable[..., Any])


def explicit_axes(mesh: Any) -> tuple[str, ...]:
    """The names of ``mesh``'s Explicit axes (a Mesh or an AbstractMesh); ``()`` when it has none.

    >>> from nnx_shard import create_mesh
    >>> explicit_axes(create_mesh((2, 4), ("dp", "fsdp"), axis_types="explicit"))
    ('dp', 'fsdp')
    """
    explicit = jax.sharding.AxisType.Explicit
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == explicit)


@contextlib.contextmanager
def on_mesh(mesh: Mesh) -> Iterator[None]:
    """``jax.set_mesh(mesh)`` for a mesh with Explicit axes (their types need it in context); else nothing."""
    if explicit_axes(mesh):
        with jax.set_mesh(mesh):
            yield
    else:
        yield


def spec_of(x: Any) -> PartitionSpec:
    """The PartitionSpec a traced or concrete array carries (``P()`` when it carries none)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec if isinstance(spec, PartitionSpec) else PartitionSpec()


def auto_axes_on(mesh: Mesh, fn: F, out_sharding: Any) -> F:
    """``fn`` under ``jax.sharding.auto_axes`` over ``mesh``'s Explicit axes, outputs in ``out_sharding``;
    else ``fn``."""
    axes = explicit_axes(mesh)
    if not axes:
        return fn
    return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_sharding)  # type: ignore[return-value]


def auto_axes(fn: F | None = None, *, out_sharding: Any = None) -> Any:
    """Runs a step written for Auto meshes over NNX state on Explicit mesh axes.

    Use it inside ``nnx.jit`` (or ``jax.jit``) under ``jax.set_mesh(mesh)``:
    the body sees the mesh's Explicit axes as Auto (XLA chooses how to shard
    each op, as before Explicit meshes), and every Variable of the Modules
    and Optimizers it is given, updated in place as NNX does, keeps the
    sharding it came in with. The function's own outputs take
    ``out_sharding`` (a PartitionSpec or a tree of them matching the outputs;
    default: replicated, right for losses and metrics). On a mesh without
    Explicit axes, or with no mesh in context, it calls ``fn`` unchanged.

    It is ``jax.sharding.auto_axes`` with the state's own shardings as
    outputs, which works on plain arrays as well.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import nnx_shard as ns
    >>> mesh = ns.create_mesh((8,), ("fsdp",), axis_types="explicit")
    >>> model, _ = ns.create_sharded(lambda: nnx.Linear(16, 8, rngs=nnx.Rngs(0)),
    ...                              [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")], mesh)
    >>> @nnx.jit
    ... @ns.sharding.auto_axes
    ... def loss(model, x):
    ...     return jnp.mean(model(x) ** 2)
    >>> with jax.set_mesh(mesh):
    ...     value = loss(model, jnp.ones((8, 16)))
    >>> value.shape, model.kernel.get_value().sharding.spec
    ((), P('fsdp', None))
    """
    if fn is None:
        return functools.partial(auto_axes, out_sharding=out_sharding)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        axes = explicit_axes(jax.sharding.get_abstract_mesh())
        if not axes:
            return fn(*args, **kwargs)
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_graph_object)
        where = [i for i, leaf in enumerate(leaves) if is_graph_object(leaf)]
        objects = [leaves[i] for i in where]
        graphdef, state = nnx.split(objects)
        specs = jax.tree.map(spec_of, state)

        arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

        def body(state: Any, values: list[Any]) -> tuple[Any, Any]:
            merged = nnx.merge(graphdef, state)
            full = list(leaves)  # anything not an array or an NNX object is passed as it is
            for i, obj in zip(where, merged, strict=True):
                full[i] = obj
            for i, value in zip(arrays, values, strict=True):
                full[i] = value
            a, k = jax.tree.unflatten(treedef, full)
            out = fn(*a, **k)
            return nnx.state(merged), out

        outs = PartitionSpec() if out_sharding is None else out_sharding
        new, out = jax.sharding.auto_axes(body, axes=axes, out_sharding=(specs, outs))(
            state, [leaves[i] for i in arrays]
        )
        nnx.update(objects, new)
        return out

    return wrapper
