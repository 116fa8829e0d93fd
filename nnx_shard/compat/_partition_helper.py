"""MeshPartitionHelper: suggest and apply shardings per array shape from the mesh's axis names."""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class MeshPartitionHelper:
    """Suggests sharding methods per array shape from the mesh's axes, and applies them.

    Methods are tuples of mesh axis names: ``('fsdp', 'sp')`` shards the first
    two dimensions together, ``('tp',)`` one dimension. Axes the mesh lacks
    are never suggested.

    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((1, 4, 1, 2, 1))
    >>> helper = MeshPartitionHelper(mesh)
    >>> helper.analyze_pytree({"w": jax.ShapeDtypeStruct((1024, 4096), "float32")})
    {(1024, 4096): [('fsdp', 'sp'), ('dp',), ('tp',)]}
    >>> helper.create_partition_spec((1024, 4096), [("tp",), ("fsdp",)])
    P('tp', 'fsdp')
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.axis_sizes = dict(mesh.shape)

    def analyze_pytree(self, pytree: Any) -> dict[tuple[int, ...], list[tuple[str, ...]]]:
        """Maps each distinct array shape in the pytree to its suggested methods, preferred first."""
        shapes: dict[tuple[int, ...], list[tuple[str, ...]]] = {}
        for x in jax.tree.leaves(pytree):
            if hasattr(x, "shape"):
                shapes.setdefault(tuple(x.shape), [])
        return {shape: self._suggest_methods(shape) for shape in shapes}

    def _suggest_methods(self, shape: tuple[int, ...]) -> list[tuple[str, ...]]:
        sizes = self.axis_sizes
        methods: list[tuple[str, ...]] = []
        ndim = len(shape)
        fused = (
            ndim > 1
            and "fsdp" in sizes
            and "sp" in sizes
            and shape[0] * shape[1] >= sizes["fsdp"] * sizes["sp"]
        )
        if fused:
            methods.append(("fsdp", "sp"))
        if ndim > 0 and "dp" in sizes:
            methods.append(("dp",))
        if ndim > 1 and "sp" in sizes and not fused:
            methods.append(("sp",))
        if "tp" in sizes:
            methods.append(("tp",))
        if "fsdp" in sizes and not any("fsdp" in m for m in methods):
            methods.append(("fsdp",))
        return methods

    def create_partition_spec(
        self,
        array_shape: tuple[int, ...],
        methods: list[tuple[str, ...]],
        min_shard_size: int = 1024,
    ) -> PartitionSpec:
        """Assigns the methods to dimensions of ``array_shape``, in order.

        A single-axis method takes the first free dimension that divides by its
        axis and is large enough (at least ``min_shard_size`` elements, or
        half a device's share of the array); a two-axis method takes the first
        two dimensions together, or the first alone when it divides by both.
        If nothing qualifies, the size floor drops to ``min_shard_size``.
        """
        if not array_shape:
            return PartitionSpec()
        spec: list[Any] = [None] * len(array_shape)
        devices = self.mesh.devices.size
        floor = max(min_shard_size, math.prod(array_shape) // (devices * 2))
        self._assign(spec, array_shape, methods, floor, strict_pairs=True)
        if all(s is None for s in spec):
            self._assign(spec, array_shape, methods, min_shard_size, strict_pairs=False)
        return PartitionSpec(*spec)

    def _assign(
        self,
        spec: list[Any],
        shape: tuple[int, ...],
        methods: list[tuple[str, ...]],
        floor: int,
        strict_pairs: bool,
    ) -> None:
        sizes = self.axis_sizes
        used: set[str] = {a for s in spec if s for a in ((s,) if isinstance(s, str) else s)}
        for method in methods:
            if any(a not in sizes or a in used for a in method):
                continue
            if len(method) == 1:
                (a,) = method
                for i, d in enumerate(shape):
                    if spec[i] is None and d >= floor and d % sizes[a] == 0:
                        spec[i] = a
                        used.add(a)
                        break
            elif len(method) == 2 and len(shape) >= 2:
                k = sizes[method[0]] * sizes[method[1]]
                pair_ok = shape[0] % sizes[method[0]] == 0 and shape[1] % sizes[method[1]] == 0
                if (
                    spec[0] is None
                    and spec[1] is None
                    and pair_ok
                    and (not strict_pairs or shape[0] * shape[1] >= k)
                ):
                    spec[0], spec[1] = method
                    used.update(method)
                elif spec[0] is None and shape[0] % k == 0:
                    spec[0] = method
                    used.update(method)

    def shard_array(self, array: Any, partition_spec: PartitionSpec) -> jax.Array:
        """``jax.device_put`` of ``array`` with ``NamedSharding(mesh, partition_spec)``."""
        return jax.device_put(array, NamedSharding(self.mesh, partition_spec))

    def auto_shard_pytree(self, pytree: Any, min_shard_size: int = 1024) -> Any:
        """Analyzes the pytree, builds a spec per shape and places every array.

        >>> from nnx_shard import create_mesh
        >>> helper = MeshPartitionHelper(create_mesh((8,), ("fsdp",)))
        >>> out = helper.auto_shard_pytree({"w": jax.numpy.zeros((2048, 16))})
        >>> out["w"].sharding.spec
        P('fsdp', None)
        """
        methods = self.analyze_pytree(pytree)

        def place(x: Any) -> Any:
            if not hasattr(x, "shape"):
                return x
            spec = self.create_partition_spec(tuple(x.shape), methods[tuple(x.shape)], min_shard_size)
            return self.shard_array(x, spec)

        return jax.tree.map(place, pytree)
