"""Meshes from sizes or strings, described. ``create_mesh`` is also at the top level.

>>> import nnx_shard as ns
>>> ns.meshes.describe_mesh(ns.meshes.mesh_from_string("fsdp:4,tp:2"))
'fsdp=4, tp=2'
"""

from nnx_shard._base import (
    calculate_host_mesh_shape,
    create_mesh,
    describe_mesh,
    mesh_from_string,
    parse_mesh_dims,
)

__all__ = ["calculate_host_mesh_shape", "create_mesh", "describe_mesh", "mesh_from_string", "parse_mesh_dims"]
