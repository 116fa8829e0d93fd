"""What every layer stands on: partition specs, paths, meshes, caches, private JAX, bytes and tables."""

# _versions first: a jax/flax pair that cannot import is named before anything imports flax
from nnx_shard._base import _versions  # noqa: F401
from nnx_shard._base._caches import COMPILE_CLOCK, CompileClock, cached, clear_caches
from nnx_shard._base._format import format_bytes, format_table, parse_bytes
from nnx_shard._base._jax_private import abstract_construction, distributed_client
from nnx_shard._base._mesh import (
    DEFAULT_AXIS_DIMS,
    DEFAULT_AXIS_NAMES,
    calculate_host_mesh_shape,
    check_every_process_in,
    create_mesh,
    describe_mesh,
    mesh_from_string,
    parse_mesh_dims,
    resolve_mesh,
)
from nnx_shard._base._paths import (
    Leaf,
    as_state,
    flatten_leaves,
    flatten_state,
    flatten_with_paths,
    is_graph_object,
    is_variable,
    path_str,
    visible,
)
from nnx_shard._base._processes import gather_json, holding_processes, mesh_processes
from nnx_shard._base._specs import (
    WHOLE,
    Spec,
    SpecEntry,
    bytes_per_device,
    entry_axes,
    entry_size,
    finalize_spec,
    format_spec,
    is_key,
    itemsize,
    normalize_spec,
    shard_shape,
    spec_axes,
    spec_problems,
    trim_spec,
)
from nnx_shard._base._threads import in_threads
from nnx_shard._base._visibility import check_model

__all__ = [
    "COMPILE_CLOCK",
    "DEFAULT_AXIS_DIMS",
    "DEFAULT_AXIS_NAMES",
    "WHOLE",
    "CompileClock",
    "Leaf",
    "Spec",
    "SpecEntry",
    "abstract_construction",
    "as_state",
    "bytes_per_device",
    "cached",
    "calculate_host_mesh_shape",
    "check_every_process_in",
    "check_model",
    "clear_caches",
    "create_mesh",
    "describe_mesh",
    "distributed_client",
    "entry_axes",
    "entry_size",
    "finalize_spec",
    "flatten_leaves",
    "flatten_state",
    "flatten_with_paths",
    "format_bytes",
    "format_spec",
    "format_table",
    "gather_json",
    "holding_processes",
    "in_threads",
    "is_graph_object",
    "is_key",
    "is_variable",
    "itemsize",
    "mesh_from_string",
    "mesh_processes",
    "normalize_spec",
    "parse_bytes",
    "parse_mesh_dims",
    "path_str",
    "resolve_mesh",
    "shard_shape",
    "spec_axes",
    "spec_problems",
    "trim_spec",
    "visible",
]
