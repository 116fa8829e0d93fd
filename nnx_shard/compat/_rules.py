"""ShardingRule and the automatic rules: auto, shape-based, memory-bounded, composite."""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from nnx_shard._base import Leaf, format_spec, is_variable, itemsize, normalize_spec, resolve_mesh
from nnx_shard._sharding import Tactic, validate_spec
from nnx_shard.errors import ShardingConflictError


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def map_arrays(fn: Any, pytree: Any) -> Any:
    """Maps ``fn`` over the array leaves of a pytree (Variables included); other leaves get P()."""

    def leaf_fn(x: Any) -> Any:
        if is_variable(x):
            x = x.get_value()
        return fn(x) if _is_array(x) else PartitionSpec()

    return jax.tree.map(leaf_fn, pytree, is_leaf=is_variable)


class ShardingRule(abc.ABC):
    """Decides a PartitionSpec for every array of a pytree.

    A rule instance may also stand as the tactic of a strategy entry:
    ``[('.*', AutoShardingRule(mesh))]``.

    >>> class FirstDim(ShardingRule):
    ...     def apply(self, pytree):
    ...         return map_arrays(lambda x: PartitionSpec("fsdp"), pytree)
    >>> FirstDim().apply({"w": jax.ShapeDtypeStruct((8, 2), "float32")})
    {'w': P('fsdp',)}
    """

    @abc.abstractmethod
    def apply(self, pytree: Any) -> Any:
        """Returns a pytree of PartitionSpec with the structure of ``pytree``."""

    def as_tactic(self) -> Tactic:
        """This rule as the tactic of a strategy entry: ``[('.*', AutoShardingRule(mesh))]``."""
        return RuleTactic(self)


class AutoShardingRule(ShardingRule):
    """Gives each dimension, largest first, the first free mesh axis that divides it.

    Arrays of fewer than ``min_shard_size`` elements stay replicated; axes of
    size 1 are not used (they would shard nothing).

    Args:
      mesh: the mesh; default the one in context.
      axis_names: the axes to use, in order of preference; default all.
      min_shard_size: arrays with fewer elements are not sharded.
      reverse: visit the smallest dimensions first.

    >>> from nnx_shard import create_mesh
    >>> rule = AutoShardingRule(create_mesh((2, 4), ("dp", "tp")))
    >>> rule.apply(jax.ShapeDtypeStruct((4, 8), "float32"))
    P('tp', 'dp')
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        axis_names: Sequence[str] | None = None,
        min_shard_size: int | None = None,
        reverse: bool = False,
    ):
        self.mesh = mesh
        self.axis_names = list(axis_names) if axis_names is not None else None
        self.min_shard_size = min_shard_size
        self.reverse = reverse

    def spec_for(self, shape: Sequence[int]) -> PartitionSpec:
        mesh = resolve_mesh(self.mesh)
        if self.min_shard_size is not None and math.prod(shape) < self.min_shard_size:
            return PartitionSpec()
        names = self.axis_names if self.axis_names is not None else list(mesh.axis_names)
        available = [a for a in names if mesh.shape[a] > 1]
        spec: list[Any] = [None] * len(shape)
        order = sorted(range(len(shape)), key=lambda i: shape[i], reverse=not self.reverse)
        for i in order:
            for a in available:
                if shape[i] % mesh.shape[a] == 0:
                    spec[i] = a
                    available.remove(a)
                    break
        return PartitionSpec(*spec)

    def apply(self, pytree: Any) -> Any:
        return map_arrays(lambda x: self.spec_for(x.shape), pytree)


class ShapeBasedShardingRule(ShardingRule):
    """Gives arrays whose shape matches a pattern (None matches any size) that pattern's spec.

    >>> rule = ShapeBasedShardingRule({(None, 1024): PartitionSpec("tp", None)})
    >>> rule.apply({"a": jax.ShapeDtypeStruct((50, 1024), "float32"),
    ...             "b": jax.ShapeDtypeStruct((50, 512), "float32")})
    {'a': P('tp', None), 'b': P()}
    """

    def __init__(self, shape_patterns: Mapping[tuple[int | None, ...], PartitionSpec]):
        self.shape_patterns = dict(shape_patterns)

    def spec_for(self, shape: Sequence[int]) -> PartitionSpec:
        for pattern, spec in self.shape_patterns.items():
            if len(pattern) == len(shape) and all(
                p is None or p == s for p, s in zip(pattern, shape, strict=True)
            ):
                return spec
        return PartitionSpec()

    def apply(self, pytree: Any) -> Any:
        return map_arrays(lambda x: self.spec_for(x.shape), pytree)


class MemoryConstrainedShardingRule(ShardingRule):
    """Shards an array over the largest mesh axes until one shard fits ``max_memory_per_device``.

    Arrays that already fit stay replicated. Each axis goes to the dimension
    whose current shard is largest and divisible by it; an array that cannot
    be brought under the limit gets as much sharding as divides.

    >>> from nnx_shard import create_mesh
    >>> mesh = create_mesh((2, 4), ("dp", "tp"))
    >>> rule = MemoryConstrainedShardingRule(max_memory_per_device=2**20, mesh=mesh)  # 4 MiB array
    >>> rule.apply(jax.ShapeDtypeStruct((1024, 1024), "float32"))
    P('tp', None)
    """

    def __init__(
        self,
        max_memory_per_device: int,
        mesh: Mesh | None = None,
        axis_names: Sequence[str] | None = None,
    ):
        self.max_memory_per_device = max_memory_per_device
        self.mesh = mesh
        self.axis_names = list(axis_names) if axis_names is not None else None

    def spec_for(self, shape: Sequence[int], itemsize: int) -> PartitionSpec:
        mesh = resolve_mesh(self.mesh)
        shard = list(shape)
        if math.prod(shard) * itemsize <= self.max_memory_per_device:
            return PartitionSpec()
        names = self.axis_names if self.axis_names is not None else list(mesh.axis_names)
        axes = sorted((a for a in names if mesh.shape[a] > 1), key=lambda a: -mesh.shape[a])
        spec: list[list[str]] = [[] for _ in shape]
        for a in axes:
            k = mesh.shape[a]
            dims = sorted((i for i in range(len(shape)) if shard[i] % k == 0), key=lambda i: -shard[i])
            if not dims:
                continue
            spec[dims[0]].append(a)
            shard[dims[0]] //= k
            if math.prod(shard) * itemsize <= self.max_memory_per_device:
                break
        return PartitionSpec(*[None if not s else s[0] if len(s) == 1 else tuple(s) for s in spec])

    def apply(self, pytree: Any) -> Any:
        return map_arrays(lambda x: self.spec_for(x.shape, itemsize(x.dtype)), pytree)


class CompositeShardingRule(ShardingRule):
    """Tries rules in order and keeps, per array, the first spec that shards something.

    >>> shape_rule = ShapeBasedShardingRule({(None, 1024): PartitionSpec("tp")})
    >>> from nnx_shard import create_mesh
    >>> auto = AutoShardingRule(create_mesh((8,), ("fsdp",)))
    >>> CompositeShardingRule(shape_rule, auto).apply(jax.ShapeDtypeStruct((16, 8), "float32"))
    P('fsdp', None)
    """

    def __init__(self, *rules: ShardingRule):
        self.rules = rules

    def apply(self, pytree: Any) -> Any:
        results = [rule.apply(pytree) for rule in self.rules]
        is_spec = lambda x: isinstance(x, PartitionSpec)

        def first(*specs: PartitionSpec) -> PartitionSpec:
            for s in specs:
                if any(e is not None for e in s):
                    return s
            return PartitionSpec()

        return jax.tree.map(first, *results, is_leaf=is_spec)


class RuleTactic(Tactic):
    """A :class:`ShardingRule` standing as the tactic of a strategy entry."""

    def __init__(self, rule: ShardingRule):
        self.rule = rule

    def __call__(self, cur_spec: Any, mesh: Mesh, name: str, leaf: Leaf) -> Any:
        out = normalize_spec(self.rule.apply(leaf.value), leaf.ndim, leaf.describe())
        if any(e is not None for e in out) and any(e is not None for e in cur_spec):
            raise ShardingConflictError(
                f"cannot apply {self} to {leaf.describe()}: it is already "
                f"{format_spec(cur_spec)}. Put the rule first in the chain."
            )
        if all(e is None for e in out):
            return cur_spec
        return validate_spec(out, mesh, leaf, str(self))

    def __str__(self) -> str:
        return type(self.rule).__name__
