"""Checkpoints written by plain Orbax: found in a directory, matched to the objects restored into, read into
their shardings.

Orbax lays out what its users write in three ways, all read here:

- ``CheckpointManager``: ``<dir>/<step>/<item>/`` (``default`` for one
  ``StandardSave`` or ``PyTreeSave``; the names of a ``Composite``);
- ``ocp.v1.save``: ``<dir>/<item>/`` (its ``state`` item), no steps;
- ``StandardCheckpointer``/``PyTreeCheckpointer``: ``<dir>/`` is the item.

An item is a folder with Orbax's tree metadata (``_METADATA``). nnx_shard's
own checkpoints (``<dir>/<step>/state`` beside ``meta``) are read by
:class:`nnx_shard.Checkpointer`, which also verifies them; a plain Orbax
checkpoint carries no fingerprints, so its content is read as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from nnx_shard._base import path_str
from nnx_shard._checkpoint._directory import read_limit, unreadable
from nnx_shard._checkpoint._faults import storage_faults
from nnx_shard._checkpoint._format import (
    leaf_paths,
    map_leaves,
    restore_keys,
    storage_target,
    structure_problems,
)
from nnx_shard.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointMismatchError,
    NoCheckpointError,
)

METADATA = "_METADATA"


@dataclasses.dataclass(frozen=True)
class Item:
    """One Orbax PyTree item: its name, folder, metadata tree and ``{path: array metadata}``."""

    name: str
    path: epath.Path
    tree: Any
    leaves: dict[str, Any]

    def fits(self, wanted: Mapping[str, Any], prefix: str) -> bool:
        """Whether every wanted leaf is here under ``prefix``, with its shape."""
        return all(
            prefix + p in self.leaves and tuple(self.leaves[prefix + p].shape) == tuple(v.shape)
            for p, v in wanted.items()
        )

    def describe(self) -> str:
        sample = list(self.leaves)[:3]
        return f"{self.name!r} ({len(self.leaves)} arrays: {sample}{' ...' if len(self.leaves) > 3 else ''})"


def _has_shape(x: Any) -> bool:
    return hasattr(x, "shape")


def _steps(directory: epath.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def has_steps(directory: Any) -> bool:
    """True where ``directory`` holds step folders (numbered)."""
    return bool(_steps(epath.Path(directory)))


def is_nnx_shard(directory: Any) -> bool:
    """True for nnx_shard's own layout (steps with ``state`` and ``meta``), or where no checkpoint is."""
    directory = epath.Path(directory)
    if not directory.exists() or not directory.is_dir():
        return True
    steps = [directory / str(s) for s in _steps(directory)]
    if steps:  # ours: a step with its metadata item; or a damaged step of ours, its state item left
        return any((s / "meta").exists() for s in steps) or (
            any((s / "state").exists() for s in steps) and not any(_item_dirs(s) for s in steps)
        )
    return not (directory / METADATA).exists() and not _item_dirs(directory)


def _item_dirs(folder: epath.Path) -> list[epath.Path]:
    return sorted(
        (p for p in folder.iterdir() if p.is_dir() and (p / METADATA).exists()), key=lambda p: p.name
    )


def locate(directory: Any, step: int | None) -> tuple[int | None, list[epath.Path]]:
    """The step read (None for a checkpoint without steps) and its item folders.

    Raises:
      NoCheckpointError: no such step; CheckpointFormatError: nothing Orbax wrote is there.
    """
    directory = epath.Path(directory)
    if not directory.is_dir():
        raise NoCheckpointError(f"no checkpoint in {directory} (not a directory); check the path.")
    steps = _steps(directory)
    if steps:
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise NoCheckpointError(
                f"no checkpoint for step {step} in {directory}; the steps there are {steps}."
            )
        folders = _item_dirs(directory / str(step))
        where = directory / str(step)
    else:
        if step is not None:
            raise NoCheckpointError(
                f"{directory} holds one checkpoint without steps (as ocp.v1.save or a "
                f"StandardCheckpointer writes); restore it with step=None."
            )
        folders = [directory] if (directory / METADATA).exists() else _item_dirs(directory)
        where = directory
    if not folders:
        found = sorted(p.name for p in where.iterdir())[:12]
        raise CheckpointFormatError(
            f"{where} holds no checkpoint nnx_shard can read: found {found}, expected an Orbax PyTree "
            f"item (a folder with {METADATA}) or nnx_shard's own steps. Point to the folder Orbax's "
            f"CheckpointManager, StandardCheckpointer or ocp.v1.save wrote."
        )
    return step, folders


def read_items(folders: list[epath.Path], directory: Any, step: int | None) -> list[Item]:
    """The items' metadata trees (storage faults become CheckpointCorruptError)."""
    items = []
    with storage_faults(lambda e, hidden: unreadable(directory, step, e, hidden, [])):
        for folder in folders:
            meta = ocp.PyTreeCheckpointer().metadata(folder)
            tree = getattr(meta, "item_metadata", meta)
            if tree is None:  # Orbax logs the failure and returns nothing
                raise CheckpointCorruptError(
                    f"{folder} could not be read (Orbax found no readable tree metadata: {METADATA}, "
                    f"or the array metadata in its files, is missing or damaged); it is incomplete or "
                    f"corrupted. Nothing live was changed."
                )
            tree = getattr(tree, "tree", tree)
            flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_has_shape)[0]
            leaves = {path_str(p).removesuffix("/value"): v for p, v in flat if _has_shape(v)}
            name = (
                folder.name if folder != epath.Path(directory) or step is not None else "(the folder itself)"
            )
            items.append(Item(name, folder, tree, leaves))
    return items


def choose(
    items: list[Item], wanted: Mapping[str, Mapping[str, Any]], item: str | None, where: str
) -> dict[str, tuple[Item, str]]:
    """For each object: the item that holds it and the prefix of its leaves there.

    An item named like the object that fits it comes first, then an item holding
    all objects under their names (``{"model": ..., "optimizer": ...}``), then any
    item that fits the object by itself.
    """
    pool = [i for i in items if item is None or i.name == item]
    if not pool:
        raise CheckpointFormatError(
            f"no item {item!r} in {where}; it holds {[i.name for i in items]}. Pass one of those as "
            "orbax_item=."
        )
    sources: dict[str, tuple[Item, str]] = {}
    for name, leaves in wanted.items():
        fits = [(i, "") for i in pool if i.fits(leaves, "")]
        nested = [(i, f"{name}/") for i in pool if i.fits(leaves, f"{name}/")]
        best = [c for c in fits if c[0].name == name] or nested or fits
        if len({c[0].name for c in best}) > 1:
            raise CheckpointFormatError(
                f"{name!r}: items {[c[0].name for c in best]} of {where} all fit its structure; name the "
                f"one to restore with orbax_item=."
            )
        if best:
            sources[name] = best[0]
    missing = [n for n in wanted if n not in sources]
    if missing:
        error = _no_fit(missing[0], wanted[missing[0]], pool, wanted, where)
        if sources:
            raise type(error)(
                f"{error} It holds {sorted(sources)}: restore "
                f"{{{', '.join(repr(n) + ': ...' for n in sorted(sources))}}} only."
            )
        raise error
    return sources


def _no_fit(
    name: str,
    leaves: Mapping[str, Any],
    pool: list[Item],
    wanted: Mapping[str, Mapping[str, Any]],
    where: str,
) -> Exception:
    if len(pool) == 1:
        saved, prefix = pool[0].leaves, f"{name}/"
        if any(p.startswith(prefix) for p in saved):  # the item holds the objects under their names
            saved = {p.removeprefix(prefix): v for p, v in saved.items() if p.startswith(prefix)}
        parts = structure_problems({p: tuple(v.shape) for p, v in saved.items()}, dict(leaves), None)
        return CheckpointMismatchError(
            f"item {pool[0].name!r} of {where} holds another structure than {name!r}; "
            + "; ".join(parts)
            + ". Build the objects as they were when saved, or restore only the ones it holds."
        )
    want = {n: f"{len(v)} arrays: {list(v)[:3]}" for n, v in wanted.items()}
    return CheckpointFormatError(
        f"no item of {where} fits {name!r}: found {'; '.join(i.describe() for i in pool)}; the objects "
        f"restored into want {want}. Restore only the objects the checkpoint holds, or name the item with "
        "orbax_item=."
    )


def read(
    sources: Mapping[str, tuple[Item, str]],
    targets: Mapping[str, Any],
    directory: Any,
    step: int | None,
    max_host_bytes: int | None = None,
) -> dict[str, Any]:
    """Reads each object from its item straight into its target's shardings (other leaves are not read)."""
    stored = {n: storage_target(t) for n, t in targets.items()}
    groups: dict[str, list[str]] = {}
    for name, (item, _) in sources.items():
        groups.setdefault(item.name, []).append(name)
    out = {}
    for names in groups.values():
        item = sources[names[0]][0]
        wanted = {
            sources[n][1] + p: v for n in names for p, v in leaf_paths(stored[n][0]).items() if _has_shape(v)
        }
        values = _read_item(item, wanted, directory, step, max_host_bytes)
        for n in names:
            prefix = sources[n][1]
            tree = map_leaves(
                lambda p, v, prefix=prefix, got=values: got[prefix + p] if _has_shape(v) else v, stored[n][0]
            )
            out[n] = restore_keys(tree, {}, stored[n][1])
    return out


def _read_item(
    item: Item, wanted: Mapping[str, Any], directory: Any, step: int | None, max_host_bytes: int | None
) -> dict[str, jax.Array]:
    """``{path: array}`` of the ``wanted`` leaves of ``item``, each in its target's sharding."""

    def one(keypath: Any, _: Any) -> Any:
        return wanted.get(path_str(keypath).removesuffix("/value"), ocp.PLACEHOLDER)

    target = jax.tree_util.tree_map_with_path(one, item.tree, is_leaf=_has_shape)
    impl = None
    if max_host_bytes is not None:  # Orbax's byte limiter, as for nnx_shard's own checkpoints
        impl = ocp.BasePyTreeCheckpointHandler(
            restore_concurrent_bytes=int(read_limit(max_host_bytes, target))
        )
    reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(handler_impl=impl))
    with storage_faults(lambda e, hidden: unreadable(directory, step, e, hidden, [])):
        restored = reader.restore(
            item.path,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
            ),
        )
    flat = jax.tree_util.tree_flatten_with_path(restored)[0]
    return {path_str(p).removesuffix("/value"): v for p, v in flat if isinstance(v, jax.Array)}


class PlainCheckpoint:
    """A checkpoint written by plain Orbax, restored in two stages: :meth:`prepare` (checks), then
    :meth:`read`.

    >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
    >>> folder = tempfile.mkdtemp() + "/ckpt"
    >>> with ocp.StandardCheckpointer() as checkpointer:
    ...     checkpointer.save(folder, {"w": jnp.ones((8, 4))})
    >>> plain = PlainCheckpoint(folder)
    >>> plain.prepare(None, {"model": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}}, None)
    >>> plain.describe()
    "item '(the folder itself)'"
    """

    def __init__(self, directory: Any):
        self.directory = epath.Path(directory)
        self.step: int | None = None
        self.sources: dict[str, tuple[Item, str]] = {}

    def prepare(self, step: int | None, targets: Mapping[str, Any], item: str | None) -> None:
        """Finds the step and the item of each target; raises before anything is read or freed."""
        self.step, folders = locate(self.directory, step)
        items = read_items(folders, self.directory, self.step)
        wanted = {
            n: {p: v for p, v in leaf_paths(storage_target(t)[0]).items() if _has_shape(v)}
            for n, t in targets.items()
        }
        where = str(self.directory) + ("" if self.step is None else f" step {self.step}")
        self.sources = choose(items, wanted, item, where)

    def read(self, targets: Mapping[str, Any], max_host_bytes: int | None = None) -> dict[str, Any]:
        return read(self.sources, targets, self.directory, self.step, max_host_bytes)

    def describe(self) -> str:
        names = sorted({i.name for i, _ in self.sources.values()})
        return f"item{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names)}"
