"""Every exception and warning of nnx_shard, in one place: ``except ns.errors.CheckpointError``.

The same classes are importable from ``nnx_shard`` itself. Each derives from
:class:`NnxShardError` (warnings from :class:`NnxShardWarning`) and from the
builtin that fits its kind, so ``except ValueError`` still catches a bad tactic.

>>> import nnx_shard as ns
>>> ns.errors.CheckpointCorruptError is ns.CheckpointCorruptError
True
>>> issubclass(ns.errors.TacticSyntaxError, (ns.errors.NnxShardError, ValueError))
True
"""

from __future__ import annotations

import enum


class NnxShardError(Exception):
    """The root of every error nnx_shard raises."""


class NnxShardWarning(UserWarning):
    """The root of every warning nnx_shard issues."""


class UnusedRuleWarning(NnxShardWarning):
    """A strategy rule that matched no leaf: usually a typo in its regex."""


class CheckpointWarning(NnxShardWarning):
    """A checkpoint not written, or set aside: a skipped save, a step that failed to verify, an abandoned
    branch."""


class DataPositionWarning(NnxShardWarning):
    """A data iterator's saved position could not be used, so it starts again from its beginning.

    Raised when a run resumes on another number of processes with an iterator
    whose position is per process (grain's ``DataLoader``, most hand-written
    iterators): examples already seen are read again and others skipped. Pass
    ``grain.experimental.ElasticIterator`` (its position is global and maps onto
    any process count), an iterator with ``elastic = True`` that does the same,
    or a ``step -> batch`` callable.
    """


# -- bad input (ValueError) ----------------------------------------------------


class ShardingError(NnxShardError, ValueError):
    """Bad input to sharding: strategies, meshes, specs, placements.

    Subclasses ``ValueError`` so that code catching ``ValueError`` (as for
    orbax and flax errors) keeps working.
    """


class MeshError(ShardingError):
    """A mesh description that cannot be built on the available devices."""


class TacticError(ShardingError):
    """Base class of the errors a tactic raises for one leaf.

    ``detail`` holds the message without the rule that applied the tactic;
    :func:`nnx_shard.infer_sharding` prefixes the rule index and text.
    """

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail

    def with_rule(self, index: int, pattern: str, tactic: str) -> TacticError:
        """Returns the same error with the rule that raised it named first."""
        err = type(self)(f"rule {index} ({pattern!r}, {tactic!r}) {self.detail}")
        err.detail = self.detail
        return err


class UnknownTacticError(TacticError):
    """A tactic name that is neither built in nor registered."""


class TacticSyntaxError(TacticError):
    """A tactic string that is not a chain of calls with literal arguments."""


class TacticArgumentError(TacticError):
    """A tactic called with missing, unknown or ill-typed arguments."""


class MeshAxisError(TacticError):
    """A tactic names a mesh axis the mesh does not have, or uses one twice."""


class IndivisibleShardingError(TacticError):
    """A dimension whose size is not divisible by the mesh axes sharding it."""


class ShardingConflictError(TacticError):
    """Two chained tactics that disagree about one leaf."""


class InvalidStrategyError(ShardingError):
    """A strategy that is not an ordered list of (regex, tactic) pairs."""


class InvalidRegexError(InvalidStrategyError):
    """A strategy rule whose regex does not compile."""


class UnmatchedLeavesError(ShardingError):
    """Leaves that no rule of a strict strategy matched."""


class PlacementError(ShardingError):
    """A tree that does not fit its target: structure, shape, dtype or divisibility."""


class LocalSliceError(ShardingError):
    """A host-local slice that does not fit the devices or the global array."""


class ReshardError(ShardingError):
    """A tree that cannot be resharded onto the given target shardings."""


class NoIntermediateShardingError(ShardingError):
    """No intermediate sharding helps for this pair of shardings."""


class NoIntermediateShardingNeededError(NoIntermediateShardingError):
    """Every target shard already lies inside one source shard: copy shards directly."""


class CheckpointError(NnxShardError, ValueError):
    """Base class of checkpoint errors; the live state and the checkpoints are left as they were.

    Not a :class:`ShardingError`: a full disk or a damaged file is not bad sharding input. It stays a
    ``ValueError``, as it was, so code that catches ``ValueError`` keeps catching it.
    """


class NoCheckpointError(CheckpointError):
    """No checkpoint, or not the asked-for step, in the directory."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another structure than the state restored into."""


class CheckpointFormatError(CheckpointError):
    """A directory whose checkpoint is not one nnx_shard can read, or not one that fits the objects restored
    into."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose files cannot be read, or whose content differs from what was saved."""


class CheckpointExistsError(CheckpointError):
    """A run that does not resume, in a workdir that already holds checkpoints of another run."""


class CheckpointSaveError(CheckpointError):
    """A save that could not be written (full disk, unwritable directory); earlier steps are intact."""


class NoLayoutFitsError(ShardingError):
    """No candidate layout fits the memory budget (``ns.suggest``): the smallest bytes reached are named."""


class ConflictingArgumentsError(NnxShardError, TypeError):
    """Two ways of saying the same thing given at once (``options=`` and the keywords it holds)."""


class ConfigError(NnxShardError, ValueError):
    """A Trainer or command-line setting that cannot be used."""


class UnknownConfigKeyError(ConfigError):
    """A config key that no Trainer (or subclass) default declares: usually a typo."""


class WeightsMismatchError(NnxShardError, ValueError):
    """Pretrained weights do not fit the model: tensors no rule maps, parameters nothing fills, or shapes."""


class UnsupportedConfigError(WeightsMismatchError):
    """A checkpoint's ``config.json`` field that changes the forward pass and the model class cannot compute.

    Raised before any weight is read; ``field`` and ``value`` name it, the message says what would be needed.
    """

    def __init__(self, message: str, *, field: str = "", value: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class TopologyError(NnxShardError, ValueError):
    """A TPU topology that cannot be described here: libtpu missing, or a topology it does not know."""


class CompileError(NnxShardError, RuntimeError):
    """XLA could not compile a program ahead of time, for a reason other than memory."""


class BatchStructureError(NnxShardError, ValueError):
    """A batch whose structure, shapes or dtypes differ from the ones the step was compiled for."""


class CLIError(ConfigError):
    """Bad command-line input; printed without a traceback."""


# -- the wrong kind of object (TypeError) ------------------------------------------


class EmptyStateKind(enum.Enum):
    """Why a state has nothing to place or train (:attr:`EmptyStateError.kind`)."""

    NO_PARAMETERS = "no parameters"
    WRT_SELECTS_NOTHING = "wrt selects nothing"
    HIDDEN_VARIABLES = "Variables nnx.state does not see"


class EmptyStateError(ShardingError):
    """A model with nothing to place or train, named before anything compiles; ``kind`` says which case.

    >>> e = EmptyStateError(EmptyStateKind.NO_PARAMETERS, "the model holds no nnx.Param")
    >>> e.kind.value, str(e)
    ('no parameters', 'the model holds no nnx.Param')
    """

    def __init__(self, kind: EmptyStateKind, message: str):
        super().__init__(message)
        self.kind = kind


class MissingExtraError(NnxShardError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the extra to install."""


class IncompatibleVersionsError(NnxShardError, ImportError):
    """Installed jax and flax versions that do not import together; the message names both and the fix."""


class StateTypeError(NnxShardError, TypeError):
    """An object where a state was expected, e.g. a factory instead of its abstract state."""


# -- a call at the wrong time (RuntimeError) -----------------------------------------


class LifecycleError(NnxShardError, RuntimeError):
    """A method called before what it needs exists, e.g. a restore before ``on_init``."""


class DistributedNotInitializedError(NnxShardError, RuntimeError):
    """Several processes but no distributed client: ``jax.distributed.initialize`` was not called."""


class WorkdirLockedError(NnxShardError, RuntimeError):
    """A workdir that another live job is writing to; the message names the holder."""


class StorageError(NnxShardError, ValueError):
    """A workdir or checkpoint URI that cannot be used: a scheme nothing installed serves, a bucket that does
    not exist, an operation the store does not offer. Raised before anything is written."""


class CollectiveMismatchError(NnxShardError, RuntimeError):
    """The processes gathered at different collectives (one issued a collective the others did not); the
    message names the site each process was at, and where its flight record was written."""


class StandbyError(NnxShardError, RuntimeError):
    """A process a resize left without devices lost the processes training: their ``train()`` raised, or
    JAX's coordination service stopped answering. The message says which and what they raised."""


# -- waits that ran out (TimeoutError) -------------------------------------------------


class BarrierTimeoutError(NnxShardError, TimeoutError):
    """Not every process reached a barrier in time; the message names who is missing."""


__all__ = [
    "BarrierTimeoutError",
    "BatchStructureError",
    "CLIError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointWarning",
    "CollectiveMismatchError",
    "CompileError",
    "ConfigError",
    "ConflictingArgumentsError",
    "DataPositionWarning",
    "DistributedNotInitializedError",
    "EmptyStateError",
    "EmptyStateKind",
    "IncompatibleVersionsError",
    "IndivisibleShardingError",
    "InvalidRegexError",
    "InvalidStrategyError",
    "LifecycleError",
    "LocalSliceError",
    "MeshAxisError",
    "MeshError",
    "MissingExtraError",
    "NnxShardError",
    "NnxShardWarning",
    "NoCheckpointError",
    "NoIntermediateShardingError",
    "NoIntermediateShardingNeededError",
    "NoLayoutFitsError",
    "PlacementError",
    "ReshardError",
    "ShardingConflictError",
    "ShardingError",
    "StandbyError",
    "StateTypeError",
    "StorageError",
    "TacticArgumentError",
    "TacticError",
    "TacticSyntaxError",
    "TopologyError",
    "UnknownConfigKeyError",
    "UnknownTacticError",
    "UnmatchedLeavesError",
    "UnsupportedConfigError",
    "UnusedRuleWarning",
    "WeightsMismatchError",
    "WorkdirLockedError",
]
