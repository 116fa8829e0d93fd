"""Validating partition specs against shapes, exact per-device memory, and monitored functions."""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from nnx_shard.paths import path_to_str
from nnx_shard.rules import resolve_mesh
from nnx_shard.tactics import format_spec, spec_axes


def _pairs(pytree: Any, partition_specs: Any) -> list[tuple[str, Any, PartitionSpec]]:
    from flax import nnx

    is_leaf = lambda x: isinstance(x, (PartitionSpec, nnx.Variable))
    specs = jax.tree_util.tree_flatten_with_path(partition_specs, is_leaf=is_leaf)[0]
    arrays = jax.tree_util.tree_flatten(pytree, is_leaf=is_leaf)[0]
    out = []
    for (path, spec), x in zip(specs, arrays, strict=True):
        if isinstance(x, nnx.Variable):
            x = x.get_value()
        if isinstance(spec, nnx.Variable):
            spec = spec.get_value()
        out.append((path_to_str(path), x, spec))
    return out


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
            if len(spec) > len(x.shape):
                issues.append(f"{path}: {format_spec(spec)} has more entries than dims {x.shape}")
                continue
            axes = spec_axes(spec)
            for a in axes:
                if a not in self.mesh.shape:
                    issues.append(f"{path}: axis {a!r} is not in the mesh {tuple(self.mesh.axis_names)}")
            for a in sorted({a for a in axes if axes.count(a) > 1}):
                issues.append(f"{path}: axis {a!r} is used twice in {format_spec(spec)}")
            for i, entry in enumerate(spec):
                if entry is None:
                    continue
                names = (entry,) if isinstance(entry, str) else entry
                if any(n not in self.mesh.shape for n in names):
                    continue
                k = math.prod(self.mesh.shape[n] for n in names)
                if x.shape[i] % k:
                    shown = repr(entry) if isinstance(entry, str) else repr(tuple(entry))
                    issues.append(
                        f"{path}: dim {i} of size {x.shape[i]} is not divisible by {shown} ({k}) "
                        f"in {format_spec(spec)}"
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
            itemsize = np.dtype(x.dtype).itemsize if hasattr(x.dtype, "kind") else x.dtype.itemsize
            n = math.prod(x.shape) * itemsize
            total += n
            shard = itemsize
            spec = tuple(spec or ()) + (None,) * (len(x.shape) - len(tuple(spec or ())))
            for d, entry in zip(x.shape, spec, strict=True):
                names = () if entry is None else (entry,) if isinstance(entry, str) else entry
                k = math.prod(self.mesh.shape.get(a, 1) for a in names)
                shard *= -(-d // k)
            per_device += shard
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
