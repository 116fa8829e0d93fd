"""Validating partition specs against shapes, exact per-device memory, and monitored functions."""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._base import (
    entry_axes,
    flatten_with_paths,
    format_spec,
    is_variable,
    itemsize,
    normalize_spec,
    resolve_mesh,
    shard_shape,
    spec_problems,
)


def _pairs(pytree: Any, partition_specs: Any) -> list[tuple[str, Any, PartitionSpec]]:
    is_leaf = lambda x: isinstance(x, PartitionSpec) or is_variable(x)
    specs = flatten_with_paths(partition_specs, is_leaf=is_leaf)[0]
    arrays = jax.tree_util.tree_flatten(pytree, is_leaf=is_leaf)[0]
    unwrap = lambda v: v.get_value() if is_variable(v) else v
    return [(path, unwrap(x), unwrap(spec)) for (path, spec), x in zip(specs, arrays, strict=True)]


class ShardingAnalyzer:
    """Checks partition specs against array shapes and computes exact per-device bytes.

    Args:
      mesh: the mesh; default the one in context.

    >>> from nnx_shard import create_mesh
    >>> analyzer = ShardingAnalyzer(create_mesh((2, 4), ("dp", "tp")))
    >>> x = {"w": jax.ShapeDtypeStruct((6, 8), "float32")}
    >>> analyzer.validate_partition_specs(x, {"w": PartitionSpec("tp", None)})
    ["w: dim 0 of size 6 is not divisible by 'tp' (4) in P('tp', None)"]
    >>> analyzer.estimate_memory_usage(x, {"w": PartitionSpec(None, "tp")})
    {'total_size': 192, 'size_per_device': 48}
    """

    def __init__(self, mesh: Mesh | None = None):
        self.mesh = resolve_mesh(mesh)

    def validate_partition_specs(self, pytree: Any, partition_specs: Any) -> list[str]:
        """Lists every problem: unknown axes, an axis used twice, ranks, indivisible dims.

        Returns:
          One message per problem; empty when the specs fit.
        """
        issues = []
        for path, x, spec in _pairs(pytree, partition_specs):
            if not hasattr(x, "shape") or spec is None:
                continue
            spec = tuple(spec)
            for p in spec_problems(spec, x.shape, self.mesh.shape):
                if p.kind == "rank":
                    issues.append(f"{path}: {format_spec(spec)} has more entries than dims {x.shape}")
                elif p.kind == "axis":
                    issues.append(f"{path}: axis {p.axis!r} is not in the mesh {tuple(self.mesh.axis_names)}")
                elif p.kind == "twice":
                    issues.append(f"{path}: axis {p.axis!r} is used twice in {format_spec(spec)}")
                else:
                    issues.append(
                        f"{path}: dim {p.dim} of size {p.size} is not divisible by {p.axis!r} "
                        f"({p.shards}) in {format_spec(spec)}"
                    )
        return issues

    def estimate_memory_usage(self, pytree: Any, partition_specs: Any) -> dict[str, int]:
        """Total bytes, and the exact bytes on the fullest device (replication counted).

        Returns:
          ``{"total_size": ..., "size_per_device": ...}``.
        """
        total = per_device = 0
        for _, x, spec in _pairs(pytree, partition_specs):
            if not hasattr(x, "shape"):
                continue
            total += math.prod(x.shape) * itemsize(x.dtype)
            known = [
                e if all(a in self.mesh.shape for a in entry_axes(e)) else None for e in tuple(spec or ())
            ]
            sharding = NamedSharding(self.mesh, PartitionSpec(*normalize_spec(known, len(x.shape))))
            per_device += math.prod(shard_shape(sharding, x.shape)) * itemsize(x.dtype)
        return {"total_size": total, "size_per_device": per_device}


def create_monitored_function(
    fn: Callable[..., Any], partition_specs: Any, analyzer: ShardingAnalyzer
) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """Wraps ``fn`` to validate its first argument's specs and time each call.

    The wrapped function returns ``(result, metrics)`` with ``execution_time``
    (seconds, after the result is ready), ``memory_usage`` and
    ``validation_issues``. Issues raise a warning, not an error.

    >>> from nnx_shard import create_mesh
    >>> analyzer = ShardingAnalyzer(create_mesh((8,), ("fsdp",)))
    >>> step = create_monitored_function(lambda p: p["w"] * 2, {"w": PartitionSpec("fsdp")}, analyzer)
    >>> out, metrics = step({"w": jax.numpy.ones(8)})
    >>> metrics["memory_usage"]
    {'total_size': 32, 'size_per_device': 4}
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        target = args[0] if args else None
        issues = analyzer.validate_partition_specs(target, partition_specs) if target is not None else []
        if issues:
            warnings.warn(f"sharding issues in {getattr(fn, '__name__', fn)}: {issues}", stacklevel=2)
        usage = analyzer.estimate_memory_usage(target, partition_specs) if target is not None else {}
        start = time.perf_counter()
        result = jax.block_until_ready(fn(*args, **kwargs))
        return result, {
            "execution_time": time.perf_counter() - start,
            "memory_usage": usage,
            "validation_issues": issues,
        }

    return wrapped
