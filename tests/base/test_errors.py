"""The error classes: each derives from NnxShardError and the builtin that fits its kind."""

from __future__ import annotations

import nnx_shard as ns


def test_a_checkpoint_error_is_not_a_sharding_error_but_is_still_a_value_error():
    for name in ("CheckpointError", "CheckpointSaveError", "CheckpointCorruptError", "NoCheckpointError"):
        cls = getattr(ns.errors, name)
        assert issubclass(cls, ns.errors.NnxShardError) and issubclass(cls, ValueError), name
        assert not issubclass(cls, ns.errors.ShardingError), name
    assert issubclass(ns.errors.PlacementError, ns.errors.ShardingError)


def test_every_error_and_warning_derives_from_the_roots():
    for name in ns.errors.__all__:
        cls = getattr(ns.errors, name)
        if isinstance(cls, type) and issubclass(cls, Warning):
            assert issubclass(cls, ns.errors.NnxShardWarning), name
        elif isinstance(cls, type) and issubclass(cls, BaseException):
            assert issubclass(cls, ns.errors.NnxShardError), name
