"""The exception classes of nnx_shard: one per kind of failure."""

from __future__ import annotations


class ShardingError(ValueError):
    """Base class of every error nnx_shard raises for bad input.

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


class UnmatchedLeavesError(ShardingError):
    """Leaves that no rule of a strict strategy matched."""
