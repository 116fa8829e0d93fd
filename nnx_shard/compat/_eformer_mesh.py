"""The seeds' mesh helpers: ``parse_mesh_from_string``, ``create_device_mesh``, CPU meshes and contexts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from nnx_shard._base import DEFAULT_AXIS_DIMS, DEFAULT_AXIS_NAMES, create_mesh, parse_mesh_dims
from nnx_shard.errors import MeshError


def parse_mesh_from_string(axis_dims: str, names: Sequence[str] = DEFAULT_AXIS_NAMES, **kwargs: Any) -> Mesh:
    """Builds a mesh from ``"dp:2,tp:4"`` (named) or ``"2,4"`` (positional), as eformer does.

    Keyword arguments go to :func:`nnx_shard.create_mesh`.

    >>> mesh = parse_mesh_from_string("dp:2,tp:4", ["dp", "tp"])
    >>> dict(mesh.shape)
    {'dp': 2, 'tp': 4}
    """
    dims, names = parse_mesh_dims(axis_dims, names)
    return create_mesh(dims, names, **kwargs)


def create_device_mesh(
    config_mesh: Sequence[tuple[str, int]],
    *,
    allow_split_physical_axes: bool = False,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """Builds a mesh from ``[(name, size), ...]``, as in big_vision; one size may be -1.

    >>> mesh = create_device_mesh([("data", -1), ("model", 2)])
    >>> dict(mesh.shape)
    {'data': 4, 'model': 2}
    """
    pairs = list(config_mesh)
    if not pairs or any(not isinstance(p, (tuple, list)) or len(p) != 2 for p in pairs):
        raise MeshError(f"expected a list of (axis_name, size) pairs; got {config_mesh!r}.")
    names, dims = zip(*pairs, strict=True)
    return create_mesh(dims, names, devices=devices, allow_split_physical_axes=allow_split_physical_axes)


def create_cpu_mesh(
    axis_dims: Sequence[int] = DEFAULT_AXIS_DIMS,
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
) -> Mesh:
    """Creates a mesh over this process's CPU devices, whatever the default backend.

    >>> create_cpu_mesh((1, -1, 1, 1, 1)).devices.size == len(jax.devices("cpu"))
    True
    """
    return create_mesh(axis_dims, axis_names, devices=jax.devices("cpu"))


@contextlib.contextmanager
def force_cpu() -> Iterator[Any]:
    """Runs the enclosed JAX operations on the first CPU device.

    >>> with force_cpu() as cpu:
    ...     x = jax.numpy.ones(3)
    >>> x.devices() == {cpu}
    True
    """
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        yield cpu


@contextlib.contextmanager
def cpu_context(
    axis_dims: Sequence[int] = DEFAULT_AXIS_DIMS,
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
) -> Iterator[Mesh]:
    """Forces CPU execution and yields a CPU mesh, set as the current mesh (``jax.set_mesh``).

    >>> with cpu_context() as mesh:
    ...     mesh.devices.flat[0].platform
    'cpu'
    """
    with force_cpu():
        mesh = create_cpu_mesh(axis_dims, axis_names)
        with jax.set_mesh(mesh):
            yield mesh
