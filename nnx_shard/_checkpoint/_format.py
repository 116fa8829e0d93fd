"""What a checkpoint holds: its metadata, PRNG keys stored as key data, fingerprints, a structure check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from nnx_shard._base import as_state, describe_mesh, flatten_with_paths, is_key, is_variable
from nnx_shard._checkpoint._fingerprint import fingerprints


def describe_strategy(strategy: Sequence[tuple[str, Any]] | None) -> list[list[str]] | None:
    """A JSON-ready copy of a strategy: ``[[regex, tactic text], ...]``."""
    if strategy is None:
        return None
    return [[str(p), t if isinstance(t, str) else str(t)] for p, t in strategy]


def mesh_metadata(mesh: Mesh | None) -> dict[str, Any]:
    """What a checkpoint records about where it was saved."""
    out: dict[str, Any] = {"devices": jax.device_count(), "processes": jax.process_count()}
    if mesh is not None:
        out["mesh_axis_names"] = list(mesh.axis_names)
        out["mesh_shape"] = [int(s) for s in mesh.devices.shape]
        out["mesh"] = describe_mesh(mesh)
    return out


def abstract_target(state: Any, shardings: Any) -> Any:
    """Abstract arrays carrying the target shardings, for Orbax to restore straight into.

    ``state`` may be live or abstract (``nnx.eval_shape``) Modules, States or
    pytrees; ``shardings`` is :func:`nnx_shard.infer_sharding`'s output for it.
    Nothing is allocated.

    >>> from nnx_shard import create_mesh, infer_sharding
    >>> mesh = create_mesh((8,), ("fsdp",))
    >>> model = nnx.eval_shape(lambda: nnx.Linear(4, 16, rngs=nnx.Rngs(0)))
    >>> strategy = [(".*", "fsdp(axis='fsdp', min_size_to_shard_mb=0)")]
    >>> target = abstract_target(model, infer_sharding(model, strategy, mesh))
    >>> target["kernel"].get_value().sharding.spec
    P(None, 'fsdp')
    """
    states, _ = as_state(state)

    def one(sharding: Any, leaf: Any) -> Any:
        value = leaf.get_value() if is_variable(leaf) else leaf
        if sharding is None or not hasattr(value, "shape"):
            return leaf
        sds = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        return leaf.replace(sds) if is_variable(leaf) else sds

    return jax.tree.map(one, shardings, states, is_leaf=lambda x: x is None)


def leaf_paths(tree: Any) -> dict[str, Any]:
    """``path -> value`` for every leaf, in the layout Orbax saves (a Variable's ``/value`` dropped)."""
    out = {}
    for path, leaf in flatten_with_paths(tree)[0]:
        out[path.removesuffix("/value")] = leaf.get_value() if is_variable(leaf) else leaf
    return out


def _is_key(x: Any) -> bool:
    return is_key(x) and hasattr(x, "dtype")


def map_leaves(fn: Any, tree: Any) -> Any:
    """``fn(path, value)`` on every leaf (a Variable's value), keeping Variables and structure."""
    flat, treedef = flatten_with_paths(tree)
    out = []
    for path, leaf in flat:
        if is_variable(leaf):
            value = leaf.get_value()
            new = fn(path, value)
            out.append(leaf if new is value else leaf.replace(new))
        else:
            out.append(fn(path, leaf))
    return jax.tree_util.tree_unflatten(treedef, out)


def storable(states: Any) -> tuple[Any, dict[str, str]]:
    """States with every typed PRNG key replaced by its key data, and ``{path: key impl}`` to undo it.

    >>> tree, keys = storable({"rng": jax.random.key(0)})
    >>> tree["rng"].dtype, keys
    (dtype('uint32'), {'rng': 'threefry2x32'})
    """
    keys: dict[str, str] = {}

    def one(path: str, value: Any) -> Any:
        if _is_key(value):
            keys[path] = str(jax.random.key_impl(value))
            return jax.random.key_data(value)
        return value

    return map_leaves(one, states), keys


def storage_target(target: Any) -> tuple[Any, set[str]]:
    """A restore target whose typed keys are their key data (as stored), and the paths of those keys."""
    keys: set[str] = set()

    def one(path: str, value: Any) -> Any:
        if _is_key(value) and isinstance(value, jax.ShapeDtypeStruct):
            keys.add(path)
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(value.shape, value.dtype))
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=value.sharding)
        return value

    return map_leaves(one, target), keys


def restore_keys(states: Any, impls: dict[str, str], paths: set[str]) -> Any:
    """Key data back into typed keys at ``paths`` (the impl recorded at save, else JAX's default)."""
    if not paths:
        return states
    default = str(jax.random.key_impl(jax.random.key(0)))

    def one(path: str, value: Any) -> Any:
        if path in paths:
            return jax.random.wrap_key_data(value, impl=impls.get(path, default))
        return value

    return map_leaves(one, states)


def tree_fingerprints(states: Any) -> dict[str, str]:
    """``{path: fingerprint}`` of every array in ``states`` (keys as their data), computed on the devices."""
    arrays = {p: v for p, v in leaf_paths(states).items() if isinstance(v, jax.Array)}
    return dict(zip(arrays, fingerprints(list(arrays.values())), strict=True))


def saved_structure(states: Any) -> dict[str, Any]:
    """What a save records of its states' structure, so that a restore checks it from one small file:
    the top-level items and every leaf's shape, in the layout Orbax saves (its own tree metadata opens
    every array for its shape: 20-50 ms for 70 arrays).

    >>> saved_structure({"model": {"w": np.zeros((2, 3))}, "ema": {}})
    {'items': ['ema', 'model'], 'shapes': {'model/w': [2, 3]}}
    """
    shapes = {p: [int(d) for d in np.shape(v)] for p, v in leaf_paths(states).items()}
    return {"items": sorted(states), "shapes": shapes}


def recorded_structure(meta: Mapping[str, Any]) -> tuple[list[str], dict[str, tuple[int, ...]]] | None:
    """The items and leaf shapes a save recorded (:func:`saved_structure`); None where it recorded none (a
    checkpoint from before they were, or one whose record is not of that form)."""
    record = meta.get("structure")
    if not isinstance(record, Mapping):
        return None
    items, shapes = record.get("items"), record.get("shapes")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        return None
    if not isinstance(shapes, Mapping):
        return None
    out = {}
    for path, shape in shapes.items():
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            return None
        out[str(path)] = tuple(shape)
    return items, out


def structure_problems(
    saved: dict[str, tuple[int, ...]], wanted: dict[str, Any], items: Sequence[str] | None
) -> list[str]:
    """How the saved leaves (``path -> shape``) differ from the wanted ones (within ``items``, when
    restoring only those)."""
    if items is not None:
        saved = {p: v for p, v in saved.items() if p.split("/", 1)[0] in items}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    shapes = [
        f"{p}: saved {saved[p]}, expected {tuple(wanted[p].shape)}"
        for p in sorted(set(saved) & set(wanted))
        if saved[p] != tuple(wanted[p].shape)
    ]
    parts = []
    if missing:
        parts.append(f"not in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra:
        parts.append(f"only in the checkpoint: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    if shapes:
        parts.append(
            f"shapes differ in {len(shapes)} leaves: {shapes[:8]}{' ...' if len(shapes) > 8 else ''}"
        )
    return parts
