"""Where a restore reads from: every kind of source, and the registry that resolves what a user passes.

Every restore (:func:`nnx_shard.restore_and_reshard`, :meth:`nnx_shard.ShardingHooks.restore_and_reshard`,
:meth:`nnx_shard.Trainer.restore_and_reshard`) takes a source as its first argument and reads it through
one :class:`Source`. :func:`as_source` asks the registered kinds in order (:func:`registered`):

- ``"safetensors"``: a ``.safetensors`` file or a folder of them (:class:`SafetensorsFolder`, into the model);
- ``"nnx_shard checkpoint"``: a :class:`nnx_shard.Checkpointer` or its directory (:class:`CheckpointSource`);
- ``"loaded state"``: a mapping of states a user loaded, on any mesh or the host (:class:`LoadedState`);
- ``"snapshots"``: a job's in-memory snapshots (:class:`Snapshots`, built explicitly);
- ``"plain Orbax checkpoint"``: any other directory (:class:`OrbaxSource`).

A new kind is a class with the :class:`Source` protocol's members, registered with :func:`register_source`.

>>> import nnx_shard as ns
>>> ns.sources.registered()
['safetensors', 'nnx_shard checkpoint', 'loaded state', 'snapshots', 'plain Orbax checkpoint']
>>> type(ns.sources.as_source({"model": {}}, ns.RestoreOptions())).__name__
'LoadedState'
"""

from nnx_shard._checkpoint import (
    CheckpointSource,
    LoadedState,
    OrbaxSource,
    ReadRequest,
    SafetensorsFolder,
    Source,
    as_source,
    register_source,
    registered,
    unregister_source,
)
from nnx_shard._snapshots import Snapshots

__all__ = [
    "CheckpointSource",
    "LoadedState",
    "OrbaxSource",
    "ReadRequest",
    "SafetensorsFolder",
    "Snapshots",
    "Source",
    "as_source",
    "register_source",
    "registered",
    "unregister_source",
]
