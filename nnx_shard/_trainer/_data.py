"""Batches for the Trainer: where they come from, what they hold, and where a data iterator stopped."""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from nnx_shard._cluster import DataShard, data_sharding, gather_json, host_local_to_global
from nnx_shard.errors import BatchStructureError, ConfigError, DataPositionWarning

TOKEN_KEYS = ("tokens", "input_ids", "inputs_ids", "token_ids")


class Batches:
    """A ``step -> batch`` callable or an iterable of batches, read one step at a time.

    An iterator with ``get_state()`` / ``set_state(state)`` (grain's
    ``DataLoader`` and ``IterDataset`` iterators have them) is resumable: its
    state goes into every checkpoint and is set on the next iterator before it
    is read, so a resumed run reads the batches an uninterrupted run would.
    On another number of processes only an elastic iterator's position carries
    over (:func:`is_elastic`); any other starts again, with a
    :class:`nnx_shard.DataPositionWarning`. An elastic iterator is moved onto
    ``shard`` (this process's rows of the global batch) at its global position
    when it reads another (:func:`move_to_shard`).
    """

    def __init__(
        self,
        data: Callable[[int], Any] | Iterable[Any],
        saved_states: list[Any] | None = None,
        shard: DataShard | None = None,
    ):
        self.callable = data if callable(data) and not hasattr(data, "__iter__") else None
        self.iterator: Iterator[Any] | None = None if self.callable is not None else iter(data)
        self.elastic = self.callable is None and (is_elastic(data) or is_elastic(self.iterator))
        self.resumed = False
        if saved_states and self.resumable:
            state = state_for_this_process(saved_states, elastic=self.elastic, iterator=self.iterator)
            if state is not None:
                self.iterator.set_state(state)
                self.resumed = True
        if self.elastic and shard is not None:
            move_to_shard(self.iterator, shard)

    @property
    def resumable(self) -> bool:
        it = self.iterator
        return (
            it is not None
            and callable(getattr(it, "get_state", None))
            and callable(getattr(it, "set_state", None))
        )

    def next(self, step: int) -> Any:
        """The batch of ``step``; StopIteration when a finite iterable runs out."""
        if self.callable is not None:
            return self.callable(step)
        return next(self.iterator)

    def state(self) -> Any:
        return self.iterator.get_state() if self.resumable else None


def is_elastic(data: Any) -> bool:
    """Whether an iterable's position is global: one state, the same on every process, that ``set_state``
    maps onto any number of processes (shards) and keeps the global batch.

    grain's ``grain.experimental.ElasticIterator`` (and the iterator it returns) is; any other iterable
    says so with a true ``elastic`` attribute.

    >>> class Steps:
    ...     elastic = True
    >>> is_elastic(Steps()), is_elastic(iter([1, 2]))
    (True, False)
    """
    if getattr(data, "elastic", False) is True:
        return True
    module = type(data).__module__
    return module.startswith("grain.") and module.endswith(".elastic_iterator")


def move_to_shard(iterator: Any, shard: DataShard) -> bool:
    """Moves an elastic iterator onto ``shard`` (its rows of each global batch) at its global position.

    An iterator with ``reshard(shard_index, shard_count)`` is asked to (each ``train()`` call, so make it
    cheap when nothing changes). grain's elastic iterator has no public way in grain 0.2: its shard
    options are replaced and its own state set again, which makes its next batches from the new shard
    at the same global example. Returns False, with a :class:`nnx_shard.DataPositionWarning`, when the
    iterator offers neither: its batches keep the old shard's rows.

    >>> class Rows:
    ...     elastic = True
    ...     def reshard(self, shard_index, shard_count):
    ...         self.shard = (shard_index, shard_count)
    >>> rows = Rows()
    >>> move_to_shard(rows, DataShard(1, 3)), rows.shard
    (True, (1, 3))
    """
    reshard = getattr(iterator, "reshard", None)
    if callable(reshard):
        reshard(shard.index, shard.count)
        return True
    options = getattr(iterator, "_shard_options", None)  # grain's _ElasticMapDatasetIterator
    if (
        options is not None
        and hasattr(options, "shard_index")
        and callable(getattr(iterator, "set_state", None))
    ):
        if (options.shard_index, options.shard_count) != (shard.index, shard.count):
            iterator._shard_options = dataclasses.replace(
                options, shard_index=shard.index, shard_count=shard.count
            )
            iterator.set_state(iterator.get_state())  # drops the iterator made for the old shard
        return True
    warnings.warn(
        f"the {type(iterator).__qualname__} iterator is elastic but cannot be moved onto data shard "
        f"{shard.index} of {shard.count}: it has no reshard(shard_index, shard_count) method, so its batches "
        "keep the rows of the shard it was made for. Give it one, or read with "
        "grain.experimental.ElasticIterator.",
        DataPositionWarning,
        stacklevel=3,
    )
    return False


def state_for_this_process(states: list[Any] | None, *, elastic: bool = False, iterator: Any = None) -> Any:
    """This process's saved data state, None when there is none.

    On the process count it was saved with, each process takes its own. On another, an elastic
    iterator's (global) state is the same for all and is taken from any process that saved one; any
    other iterator's cannot be mapped onto the new processes, which a
    :class:`nnx_shard.DataPositionWarning` says (its position starts again).
    """
    if not states:
        return None
    if len(states) == jax.process_count() and states[jax.process_index()] is not None:
        return decode_state(states[jax.process_index()])
    saved = [s for s in states if s is not None]
    if elastic and saved and all(s == saved[0] for s in saved):
        return decode_state(saved[0])
    what = type(iterator).__qualname__
    if elastic:
        why = f"its processes saved {len({json.dumps(s, sort_keys=True) for s in saved})} different positions"
    else:
        why = "its position is per process (it is not elastic)"
    warnings.warn(
        f"the data position was saved by {len(states)} process{'es' if len(states) != 1 else ''} and this "
        "run "
        f"has {jax.process_count()}: the {what} iterator's cannot be mapped onto them ({why}), so it starts "
        "again from its beginning: examples already seen are read again and others are skipped. To resume "
        "at "
        f"the example where the run stopped, read the data with grain.experimental.ElasticIterator(dataset, "
        f"global_batch_size, grain.sharding.ShardOptions(jax.process_index(), jax.process_count())), an "
        f"iterator with elastic = True, or a step -> batch callable.",
        DataPositionWarning,
        stacklevel=3,
    )
    return None


def encode_state(state: Any) -> Any:
    """A data iterator's state as JSON (bytes as base64)."""
    if isinstance(state, bytes):
        return {"__bytes__": base64.b64encode(state).decode()}
    try:
        json.dumps(state)
    except TypeError:
        raise ConfigError(
            f"the data iterator's get_state() returned {type(state).__name__}, which cannot be saved as "
            f"JSON; return a dict, list, string or bytes."
        ) from None
    return state


def decode_state(state: Any) -> Any:
    if isinstance(state, Mapping) and set(state) == {"__bytes__"}:
        return base64.b64decode(state["__bytes__"])
    return state


def gather_states(state: Any) -> list[Any]:
    """Every process's encoded data state, in process order (a list of one with a single process)."""
    return gather_json(encode_state(state), site="data.states")


def signature(batch: Any) -> tuple[Any, tuple[Any, ...]]:
    """A batch's structure and leaf shapes and dtypes: one compiled step per signature."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, tuple(_leaf_signature(x) for x in leaves)


def signature_rows(batch_signature: Any) -> int:
    """:func:`examples` read off a batch's :func:`signature`: the leading dimension of its first leaf."""
    shapes = batch_signature[1]
    return int(shapes[0][0][0]) if shapes and shapes[0][0] else 0


def _leaf_signature(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    if not isinstance(x, (jax.Array, np.ndarray)):
        x = np.asarray(x)
    return tuple(x.shape), x.dtype


def check_structure(first: Any, batch_signature: Any) -> None:
    """Refuses a batch whose structure (keys, nesting) differs from the first batch's."""
    if first is not None and first[0] != batch_signature[0]:
        raise BatchStructureError(
            f"the batch's structure changed between steps: it was {first[0]}, now {batch_signature[0]}. "
            f"Give every batch the same keys and nesting (shapes may change: the step recompiles)."
        )


def examples(batch: Any) -> int:
    """Rows of a (global) batch: the leading dimension of its first leaf."""
    leaves = jax.tree.leaves(batch)
    shape = np.shape(leaves[0]) if leaves else ()
    return int(shape[0]) if shape else 0


def tokens(batch: Any) -> int | None:
    """Tokens a host-local batch says it holds: ``num_tokens`` (host data), else the size of
    ``tokens``/``input_ids``.

    >>> tokens({"input_ids": np.zeros((4, 128))}), tokens({"num_tokens": np.array([100, 28]), "x": 0})
    (512, 128)
    """
    if not isinstance(batch, Mapping):
        return None
    if "num_tokens" in batch:
        count = batch["num_tokens"]
        return None if isinstance(count, jax.Array) else int(np.sum(count))  # never wait on a device
    for key in TOKEN_KEYS:
        if key in batch:
            return math.prod(np.shape(batch[key]))
    return None


def host_scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """Metrics on the host as floats; replicated arrays are read from this process's own copy."""
    out = {}
    for key, value in values.items():
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            if value.sharding.is_fully_replicated:
                value = value.addressable_shards[0].data
            else:
                from jax.experimental import multihost_utils

                value = multihost_utils.process_allgather(value, tiled=True)
        out[key] = float(np.asarray(value))
    return out


@functools.lru_cache(maxsize=16)
def _batch_sharding(mesh: Mesh) -> NamedSharding:
    return data_sharding(mesh)  # asked on every step, for the few meshes a run has


def global_batch(batch: Any, mesh: Mesh) -> Any:
    """A host-local batch (numpy) as a global batch on ``mesh``'s data axes; global arrays there pass
    through."""
    target = _batch_sharding(mesh)
    leaves = jax.tree.leaves(batch)
    if leaves and all(isinstance(x, jax.Array) and x.sharding == target for x in leaves):
        return batch
    return host_local_to_global(batch, mesh)
