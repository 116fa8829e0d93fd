"""Meshes from dims, strings and configs; hybrid meshes over described slices."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import nnx_shard as ns
from nnx_shard import MeshError


@pytest.mark.parametrize(
    "dims, names, expected",
    [
        ((1, -1, 1, 1, 1), ("dp", "fsdp", "ep", "tp", "sp"), {"dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}),
        ((2, -1), ("dp", "tp"), {"dp": 2, "tp": 4}),
        ((2, 2, 2), ("a", "b", "c"), {"a": 2, "b": 2, "c": 2}),
        ((-1,), ("fsdp",), {"fsdp": 8}),
    ],
)
def test_create_mesh_fills_minus_one(dims, names, expected):
    mesh = ns.create_mesh(dims, names)
    assert dict(mesh.shape) == expected
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize(
    "dims, names, message",
    [
        ((3, -1), ("dp", "tp"), "not divisible by the product of the fixed sizes (3)"),
        ((-1, -1), ("dp", "tp"), "at most one mesh dimension may be -1"),
        ((2, 2), ("dp", "tp"), "multiply to 4, but there are 8 devices"),
        ((2, 4), ("dp", "dp"), "must be unique; ['dp'] appear twice"),
        ((8,), ("dp", "tp"), "got 1 sizes (8,) for 2 axis names"),
        ((0, -1), ("dp", "tp"), "must be positive or -1"),
        ((8,), ("my axis",), "must be identifiers"),
    ],
)
def test_create_mesh_errors(dims, names, message):
    with pytest.raises(MeshError) as e:
        ns.create_mesh(dims, names)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_devices_subset_and_jax_path():
    devs = jax.devices()[4:]
    mesh = ns.create_mesh((2, 2), ("dp", "tp"), devices=devs)
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devs}
    mesh2 = ns.create_mesh((2, -1), ("dp", "tp"), use_jax=True, axis_types="explicit")
    assert dict(mesh2.shape) == {"dp": 2, "tp": 4}
    assert mesh2.axis_types == (jax.sharding.AxisType.Explicit,) * 2


def test_hybrid_mesh_over_described_slices():
    # Two slices of 4 devices; the dp axis spans the slices (DCN), fsdp stays inside one.
    mesh = ns.create_mesh((2, 4), ("dp", "fsdp"), num_slices=2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    first = {d.id for d in sorted(jax.devices(), key=lambda d: d.id)[:4]}
    assert set(ids[0]) == first  # row 0 is slice 0 entirely
    assert set(ids[1]).isdisjoint(first)
    # Explicit DCN layout along the second axis: each column pair is one slice.
    mesh = ns.create_mesh((2, 4), ("dp", "fsdp"), num_slices=2, dcn_mesh_dims=(1, 2))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert set(ids[:, :2].flat) == first


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_slices": 3}, "cannot be split into 3 equal slices"),
        ({"num_slices": 2, "dcn_mesh_dims": (1, 4)}, "describe 4 slices but the devices span 2"),
        ({"num_slices": 2, "dcn_mesh_dims": (3, 1)}, "must have one entry per axis and divide"),
    ],
)
def test_hybrid_mesh_errors(kwargs, message):
    with pytest.raises(MeshError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ns.create_mesh((2, 4), ("dp", "fsdp"), **kwargs)


@pytest.mark.parametrize(
    "text, names, dims",
    [
        ("dp:2,tp:4", ("dp", "tp"), (2, 4)),
        ("tp:4, dp:2", ("dp", "tp"), (2, 4)),
        ("fsdp:-1", ("dp", "fsdp", "ep", "tp", "sp"), (1, 8, 1, 1, 1)),
        ("2,4", ("data", "model"), (2, 4)),
        ("-1,2", ("data", "model"), (4, 2)),
    ],
)
def test_parse_mesh_from_string(text, names, dims):
    mesh = ns.compat.parse_mesh_from_string(text, names)
    assert tuple(mesh.shape.values()) == dims
    assert tuple(mesh.axis_names) == tuple(names)


@pytest.mark.parametrize(
    "text, message",
    [
        ("dp:2,model:4", "unknown mesh axis 'model'"),
        ("dp:2,dp:4", "mesh axis 'dp' is given twice"),
        ("dp:2,4", "malformed mesh string"),
        ("dp=2", "malformed mesh string"),
        ("", "expected a mesh string"),
        ("2,2,2", "gives 3 sizes for the 2 axes"),
        ("dp:3,tp:3", "multiply to 9"),
    ],
)
def test_parse_mesh_errors(text, message):
    with pytest.raises(MeshError, match=message):
        ns.compat.parse_mesh_from_string(text, ("dp", "tp"))


def test_create_device_mesh_like_seed():
    mesh = ns.compat.create_device_mesh([("data", -1), ("model", 2)])
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    with pytest.raises(MeshError, match="list of \\(axis_name, size\\) pairs"):
        ns.compat.create_device_mesh(["data"])


def test_cpu_helpers():
    mesh = ns.compat.create_cpu_mesh((2, -1), ("dp", "fsdp"))
    assert all(d.platform == "cpu" for d in mesh.devices.flat)
    with ns.compat.cpu_context((2, -1), ("dp", "fsdp")) as m:
        assert jax.sharding.get_abstract_mesh().shape == m.shape
        x = jax.numpy.ones(4)
    assert next(iter(x.devices())).platform == "cpu"


@pytest.mark.parametrize(
    "shape, devices, procs, expected",
    [((2, 4), 4, 2, (1, 4)), ((8,), 2, 4, (2,)), ((2, 2, 2), 2, 4, (1, 1, 2)), ((4, 2), 8, 1, (4, 2))],
)
def test_calculate_host_mesh_shape(shape, devices, procs, expected):
    out = ns.meshes.calculate_host_mesh_shape(shape, total_devices=devices, num_processes=procs)
    assert out == expected
    assert np.prod(out) == devices


def test_calculate_host_mesh_shape_errors():
    with pytest.raises(MeshError, match="holds 8 devices, but 2 processes x 3 devices = 6"):
        ns.meshes.calculate_host_mesh_shape((2, 4), total_devices=3, num_processes=2)
