"""Meshes from dims and strings, hybrid ICI/DCN over slices, with their axis types said explicitly."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from nnx_shard._base._processes import mesh_processes
from nnx_shard.errors import MeshError

DEFAULT_AXIS_NAMES: tuple[str, ...] = ("dp", "fsdp", "ep", "tp", "sp")
DEFAULT_AXIS_DIMS: tuple[int, ...] = (1, -1, 1, 1, 1)

_AXIS_TYPES = {
    "auto": jax.sharding.AxisType.Auto,
    "explicit": jax.sharding.AxisType.Explicit,
    "manual": jax.sharding.AxisType.Manual,
}


def _check_names(axis_names: Sequence[str]) -> tuple[str, ...]:
    names = tuple(axis_names)
    bad = [n for n in names if not isinstance(n, str) or not n.isidentifier()]
    if bad:
        raise MeshError(f"mesh axis names must be identifiers like 'fsdp'; got {bad!r} in {names!r}.")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise MeshError(f"mesh axis names must be unique; {dupes!r} appear twice in {names!r}.")
    return names


def resolve_axis_dims(axis_dims: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Fills the one ``-1`` in ``axis_dims`` so that their product is ``num_devices``.

    Args:
      axis_dims: positive sizes, at most one of them ``-1``.
      num_devices: the number of devices the mesh must cover.

    Returns:
      The sizes with ``-1`` replaced.

    Raises:
      MeshError: two ``-1``s, a size below 1, or sizes whose product is not
        ``num_devices``.

    >>> resolve_axis_dims((2, -1), 8)
    (2, 4)
    """
    dims = tuple(int(d) for d in axis_dims)
    free = [i for i, d in enumerate(dims) if d == -1]
    if len(free) > 1:
        raise MeshError(f"at most one mesh dimension may be -1; got {dims}. Give every size but one.")
    if any(d < 1 and d != -1 for d in dims):
        raise MeshError(f"mesh sizes must be positive or -1; got {dims}.")
    known = math.prod(d for d in dims if d != -1)
    if free:
        if num_devices % known:
            raise MeshError(
                f"mesh sizes {dims} cannot cover {num_devices} devices: {num_devices} is "
                f"not divisible by the product of the fixed sizes ({known})."
            )
        dims = tuple(num_devices // known if d == -1 else d for d in dims)
    if math.prod(dims) != num_devices:
        raise MeshError(
            f"mesh sizes {dims} multiply to {math.prod(dims)}, but there are {num_devices} "
            f"devices. Make the product {num_devices}, or put -1 on one axis."
        )
    return dims


class _SliceView:
    """A device seen as belonging to a given slice (for describing slices on CPU)."""

    def __init__(self, device: Any, slice_index: int):
        self.device = device
        self.slice_index = slice_index

    def __getattr__(self, name: str) -> Any:
        return getattr(self.device, name)


def _granules(devices: Sequence[Any], num_slices: int | None) -> list[Any]:
    """Returns devices that carry a ``slice_index``, described if needed."""
    if num_slices is None:
        return list(devices)
    if len(devices) % num_slices:
        raise MeshError(f"{len(devices)} devices cannot be split into {num_slices} equal slices.")
    per = len(devices) // num_slices
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return [_SliceView(d, i // per) for i, d in enumerate(ordered)]


def _slice_count(devices: Sequence[Any]) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def _default_dcn_dims(dims: Sequence[int], num_slices: int) -> tuple[int, ...]:
    for i, d in enumerate(dims):
        if d % num_slices == 0:
            return tuple(num_slices if j == i else 1 for j in range(len(dims)))
    raise MeshError(
        f"no mesh axis of {tuple(dims)} is divisible by the {num_slices} slices; "
        f"pass dcn_mesh_dims to say how the slices are laid out."
    )


def create_mesh(
    axis_dims: Sequence[int] = DEFAULT_AXIS_DIMS,
    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
    *,
    dcn_mesh_dims: Sequence[int] | None = None,
    devices: Sequence[Any] | None = None,
    num_slices: int | None = None,
    should_sort_granules_by_key: bool = True,
    allow_split_physical_axes: bool = True,
    backend: str | None = None,
    use_jax: bool = False,
    axis_types: Any = None,
) -> Mesh:
    """Creates a device mesh, hybrid ICI/DCN when devices span several slices.

    Args:
      axis_dims: the global size of each axis; one may be ``-1`` (the rest of
        the devices).
      axis_names: one name per axis.
      dcn_mesh_dims: how slices are laid out over the axes (``axis_dims`` is
        then the global shape: each axis is ``ici * dcn``). Defaults to the
        slices on the first axis whose size they divide.
      devices: the devices to use; default ``jax.devices(backend)``.
      num_slices: describe the devices as this many equal slices (by process
        then id), for platforms whose devices carry no ``slice_index`` such as
        CPU or multi-process GPU.
      should_sort_granules_by_key: sort slices by index (as mesh_utils does).
      allow_split_physical_axes: let mesh_utils split physical TPU axes.
      backend: the platform whose devices to use when ``devices`` is None.
      use_jax: build single-slice meshes with ``jax.make_mesh`` (the axis
        types are still the ones ``axis_types`` names, not make_mesh's default).
      axis_types: ``"auto"`` (the default), ``"explicit"``, ``"manual"``, an
        ``AxisType``, or one per axis.

    Returns:
      A ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto`` unless
      ``axis_types`` says otherwise. nnx_shard works on meshes of any axis
      types and under ``jax.set_mesh``.

    Raises:
      MeshError: bad names, sizes that do not cover the devices, or slices
        that do not fit the dims.

    >>> mesh = create_mesh((2, -1), ("dp", "fsdp"))
    >>> dict(mesh.shape), mesh.axis_types
    ({'dp': 2, 'fsdp': 4}, (Auto, Auto))
    >>> create_mesh((8,), ("fsdp",), use_jax=True, axis_types="explicit").axis_types
    (Explicit,)
    """
    names = _check_names(axis_names)
    if len(tuple(axis_dims)) != len(names):
        raise MeshError(
            f"got {len(tuple(axis_dims))} sizes {tuple(axis_dims)} for {len(names)} axis "
            f"names {names}; give one size per name."
        )
    devs = list(devices) if devices is not None else jax.devices(backend)
    dims = resolve_axis_dims(axis_dims, len(devs))
    types = _axis_types(axis_types, len(names))
    devs = _granules(devs, num_slices)
    slices = _slice_count(devs)
    if slices > 1 or dcn_mesh_dims is not None:
        dcn = tuple(dcn_mesh_dims) if dcn_mesh_dims is not None else _default_dcn_dims(dims, slices)
        if len(dcn) != len(dims) or any(d % c for d, c in zip(dims, dcn, strict=True)):
            raise MeshError(f"dcn_mesh_dims {dcn} must have one entry per axis and divide axis_dims {dims}.")
        if math.prod(dcn) != slices:
            raise MeshError(
                f"dcn_mesh_dims {dcn} describe {math.prod(dcn)} slices but the devices span "
                f"{slices}; make their product {slices}."
            )
        ici = tuple(d // c for d, c in zip(dims, dcn, strict=True))
        array = mesh_utils.create_hybrid_device_mesh(
            ici,
            dcn,
            devs,
            should_sort_granules_by_key=should_sort_granules_by_key,
            allow_split_physical_axes=allow_split_physical_axes,
        )
        array = np.vectorize(lambda d: getattr(d, "device", d), otypes=[object])(array)
    elif use_jax:
        return jax.make_mesh(dims, names, devices=devs, axis_types=types)
    else:
        array = mesh_utils.create_device_mesh(dims, devs, allow_split_physical_axes=allow_split_physical_axes)
    return Mesh(array, names, axis_types=types)


def _axis_types(axis_types: Any, n: int) -> tuple[Any, ...]:
    if axis_types is None:
        axis_types = "auto"
    if isinstance(axis_types, (str, jax.sharding.AxisType)):
        axis_types = (axis_types,) * n
    out = []
    for t in axis_types:
        if isinstance(t, str):
            if t.lower() not in _AXIS_TYPES:
                raise MeshError(f"unknown axis type {t!r}; use one of {sorted(_AXIS_TYPES)}.")
            t = _AXIS_TYPES[t.lower()]
        out.append(t)
    if len(out) != n:
        raise MeshError(f"got {len(out)} axis types for {n} axes.")
    return tuple(out)


_NAMED = re.compile(r"^\s*([A-Za-z_]\w*)\s*:\s*(-?\d+)\s*$")
_POSITIONAL = re.compile(r"^\s*(-?\d+)\s*$")


def parse_mesh_dims(
    axis_dims: str, names: Sequence[str] = DEFAULT_AXIS_NAMES
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Parses ``"dp:2,tp:4"`` or ``"2,4"`` into sizes and names, without building a mesh.

    Named entries may cover a subset of ``names`` in any order (the others get
    size 1); positional entries must give one size per name.

    >>> parse_mesh_dims("tp:4,dp:2", ("dp", "fsdp", "tp"))
    ((2, 1, 4), ('dp', 'fsdp', 'tp'))
    >>> parse_mesh_dims("2,-1", ("dp", "fsdp"))
    ((2, -1), ('dp', 'fsdp'))
    """
    names = _check_names(names)
    if not isinstance(axis_dims, str) or not axis_dims.strip():
        raise MeshError(f"expected a mesh string like 'dp:2,tp:4' or '2,4'; got {axis_dims!r}.")
    parts = axis_dims.split(",")
    named = [_NAMED.match(p) for p in parts]
    positional = [_POSITIONAL.match(p) for p in parts]
    if all(named):
        given: dict[str, int] = {}
        for m in named:
            name, size = m.group(1), int(m.group(2))
            if name not in names:
                raise MeshError(f"unknown mesh axis {name!r} in {axis_dims!r}; the axes are {names}.")
            if name in given:
                raise MeshError(f"mesh axis {name!r} is given twice in {axis_dims!r}.")
            given[name] = size
        return tuple(given.get(n, 1) for n in names), names
    if all(positional):
        dims = tuple(int(m.group(1)) for m in positional)
        if len(dims) != len(names):
            raise MeshError(
                f"{axis_dims!r} gives {len(dims)} sizes for the {len(names)} axes {names}; "
                f"give one per axis or use the named form 'name:size,...'."
            )
        return dims, names
    raise MeshError(
        f"malformed mesh string {axis_dims!r}: use 'name:size' pairs ('dp:2,tp:4') or "
        f"sizes alone ('2,4'), not a mix."
    )


def mesh_from_string(text: str, *, devices: Sequence[Any] | None = None, axis_types: Any = None) -> Mesh:
    """``"fsdp:-1"`` or ``"dp:2,tp:4"``: named axes in the order given; ``"2,4"``: dp, fsdp, ...

    Args:
      text: the mesh, as named sizes or positional sizes.
      devices: the devices to use (default all); e.g. ``jax.devices()[4:]``.
      axis_types: as for :func:`create_mesh` (default: all ``Auto``).

    Raises:
      MeshError: a malformed string, or sizes that do not cover the devices.

    >>> dict(mesh_from_string("dp:2,fsdp:-1").shape)
    {'dp': 2, 'fsdp': 4}
    >>> [d.id for d in mesh_from_string("fsdp:-1", devices=jax.devices()[4:]).devices.flat]
    [4, 5, 6, 7]
    """
    if not isinstance(text, str) or not text.strip():
        raise MeshError(f"expected a mesh string like 'fsdp:-1' or 'dp:2,tp:4'; got {text!r}.")
    parts = [p for p in text.split(",") if p.strip()]
    names = (
        [p.split(":")[0].strip() for p in parts] if ":" in text else list(DEFAULT_AXIS_NAMES[: len(parts)])
    )
    dims, names = parse_mesh_dims(text, names)
    return create_mesh(dims, names, devices=devices, axis_types=axis_types)


def resolve_mesh(mesh: Mesh | None) -> Any:
    """The given mesh, else the mesh set with ``jax.set_mesh``.

    Raises:
      MeshError: no mesh given and none in context.

    >>> with jax.set_mesh(create_mesh((8,), ("fsdp",))):
    ...     dict(resolve_mesh(None).shape)
    {'fsdp': 8}
    """
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and not abstract.empty:
        return abstract
    raise MeshError("no mesh given and none in context; pass mesh=... or use `with jax.set_mesh(mesh):`.")


def calculate_host_mesh_shape(
    global_mesh_shape: Sequence[int],
    total_devices: int | None = None,
    num_processes: int | None = None,
) -> tuple[int, ...]:
    """Splits a global mesh shape into the part one host's devices cover.

    Processes are spread over the leading axes first (the slower network
    goes outermost), so each host keeps whole inner axes where it can.

    Args:
      global_mesh_shape: the mesh shape over all processes.
      total_devices: devices on this host; default ``jax.local_device_count()``.
      num_processes: default ``jax.process_count()``.

    Returns:
      The host-local mesh shape; its product is ``total_devices``.

    Raises:
      MeshError: the global shape does not hold ``total_devices *
        num_processes`` devices.

    >>> calculate_host_mesh_shape((2, 4), total_devices=4, num_processes=2)
    (1, 4)
    >>> calculate_host_mesh_shape((2, 4), total_devices=2, num_processes=4)
    (1, 2)
    """
    total_devices = jax.local_device_count() if total_devices is None else total_devices
    num_processes = jax.process_count() if num_processes is None else num_processes
    shape = [int(d) for d in global_mesh_shape]
    if math.prod(shape) != total_devices * num_processes:
        raise MeshError(
            f"global mesh {tuple(shape)} holds {math.prod(shape)} devices, but "
            f"{num_processes} processes x {total_devices} devices = "
            f"{total_devices * num_processes}."
        )
    # Since num_processes divides the product, taking gcds axis by axis always
    # consumes every prime factor of num_processes.
    remaining = num_processes
    for i, d in enumerate(shape):
        g = math.gcd(d, remaining)
        shape[i] = d // g
        remaining //= g
    return tuple(shape)


def describe_mesh(mesh: Mesh) -> str:
    """Returns ``"fsdp=8"`` or ``"dp=2, tp=4"``: the axes larger than one.

    >>> describe_mesh(create_mesh((2, 4, 1), ("dp", "fsdp", "tp")))
    'dp=2, fsdp=4'
    """
    parts = [f"{n}={s}" for n, s in mesh.shape.items() if s > 1]
    return ", ".join(parts) if parts else "1 device"


def check_every_process_in(mesh: Mesh, what: str, how: str) -> None:
    """MeshError when ``mesh`` leaves a process of this job without a device: ``what`` (a restore) needs a
    device on every process; ``how`` says what to do instead.

    >>> check_every_process_in(create_mesh((8,), ("fsdp",)), "a restore", "")  # one process: always in
    """
    left_out = sorted(set(range(jax.process_count())) - set(mesh_processes(mesh)))
    if left_out:
        names = ", ".join(map(str, left_out))
        raise MeshError(
            f"the mesh ({describe_mesh(mesh)}) leaves process{'es' if len(left_out) > 1 else ''} {names} of "
            f"{jax.process_count()} without a device, and {what} needs a device on every process; give each "
            "at "
            f"least one device. {how} Nothing was moved."
        )
