"""The training state as a type: model, optimizer, EMA and what a user adds; the kinds a leaf can have."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import jax
from flax import nnx
from flax.nnx import graph as nnx_graph


class Kind(enum.StrEnum):
    """What a part of the training state is; plans list the kinds in this order.

    >>> Kind.named("opt_state"), Kind.of(nnx.Linear(2, 3, rngs=nnx.Rngs(0))), Kind.EMA.rank
    (<Kind.OPTIMIZER: 'optimizer'>, <Kind.MODEL: 'model'>, 2)
    """

    MODEL = "model"
    OPTIMIZER = "optimizer"
    EMA = "ema"
    STATE = "state"  # anything else: counters, a plain pytree

    @property
    def rank(self) -> int:
        return list(Kind).index(self)

    @classmethod
    def of(cls, obj: Any) -> Kind:
        """What ``obj`` is, from its type: an ``nnx.Optimizer``, an ``nnx.EMA`` (or its state), another graph
        object (a model), or anything else."""
        if isinstance(obj, nnx.Optimizer):
            return cls.OPTIMIZER
        if isinstance(obj, nnx.EMA) or _is_ema_state(obj):
            return cls.EMA
        if not isinstance(obj, nnx.State) and nnx_graph.is_graph_node(obj):
            return cls.MODEL
        return cls.STATE

    @classmethod
    def named(cls, name: Any) -> Kind:
        """The kind a part's name says: a training state's fields, and ``opt_state`` as optax users name
        it."""
        return _NAMES.get(name, cls.STATE)


MODEL, OPTIMIZER, EMA = Kind.MODEL.value, Kind.OPTIMIZER.value, Kind.EMA.value
_NAMES = {MODEL: Kind.MODEL, OPTIMIZER: Kind.OPTIMIZER, "opt_state": Kind.OPTIMIZER, EMA: Kind.EMA}
FIELDS = (MODEL, OPTIMIZER, EMA)


def _is_ema_state(obj: Any) -> bool:
    """``nnx.state(ema)``: a State whose one key is ``params``, every leaf under it an ``nnx.Param``."""
    if not isinstance(obj, nnx.State) or list(obj.keys()) != ["params"]:
        return False
    leaves = jax.tree.leaves(obj, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return bool(leaves) and all(isinstance(v, nnx.Param) for v in leaves)


class TrainingState(MutableMapping[str, Any]):
    """The training state: a model, its optimizer, its EMA, and any other parts a user adds.

    Each part is a graph object (``nnx.Module``, ``nnx.Optimizer``, ``nnx.EMA``), its ``nnx.State``, or a
    pytree. It reads as a mapping of the parts present (``model``, ``optimizer``, ``ema``, then the others in
    the order given), so it goes wherever ``{"model": ..., "optimizer": ..., "ema": ...}`` went; it is a
    pytree of its parts, so a jitted step takes and returns it.

    >>> model = nnx.Linear(2, 4, rngs=nnx.Rngs(0))
    >>> state = TrainingState(model, ema=nnx.EMA(model, decay=0.9), step_count=0)
    >>> list(state), state.optimizer, state["step_count"], state.step_count
    (['model', 'ema', 'step_count'], None, 0, 0)
    >>> state.kind("ema"), state.kind("step_count")
    (<Kind.EMA: 'ema'>, <Kind.STATE: 'state'>)
    >>> TrainingState.of({"model": model, "extra": 1}).extra
    {'extra': 1}
    """

    __slots__ = ("ema", "extra", "model", "optimizer")

    def __init__(self, model: Any = None, optimizer: Any = None, ema: Any = None, **extra: Any):
        self.model, self.optimizer, self.ema, self.extra = model, optimizer, ema, dict(extra)

    @classmethod
    def of(cls, parts: Mapping[str, Any]) -> TrainingState:
        """``parts`` as a training state (a TrainingState is returned as it is)."""
        if isinstance(parts, TrainingState):
            return parts
        if not isinstance(parts, Mapping):
            raise TypeError(
                f"a training state is a TrainingState or a mapping of its parts "
                f"({{'model': ..., 'optimizer': ..., 'ema': ...}}); got {type(parts).__name__}."
            )
        given = dict(parts)
        fields = [given.pop(name, None) for name in FIELDS]
        return cls(*fields, **given)

    def kind(self, name: str) -> Kind:
        """The kind of the part ``name``: from its field, else from what it holds."""
        if name in FIELDS:
            return Kind(name)
        return Kind.of(self.extra[name])

    def replace(self, **parts: Any) -> TrainingState:
        """A copy with ``parts`` replaced (or added)."""
        return TrainingState.of({**self, **parts})

    def __getitem__(self, name: str) -> Any:
        if name in FIELDS and getattr(self, name) is not None:
            return getattr(self, name)
        if name in self.extra:
            return self.extra[name]
        raise KeyError(name)

    def __getattr__(self, name: str) -> Any:
        """A part a user added, as an attribute (``state.step`` for ``TrainingState(model, step=...)``)."""
        try:
            extra = object.__getattribute__(self, "extra")
        except AttributeError:  # not initialised yet (copying)
            raise AttributeError(name) from None
        if name in extra:
            return extra[name]
        raise AttributeError(f"the training state has no part {name!r}; its parts are {list(self)}.")

    def __setitem__(self, name: str, value: Any) -> None:
        if name in FIELDS:
            setattr(self, name, value)
        else:
            self.extra[name] = value

    def __delitem__(self, name: str) -> None:
        if name in FIELDS and getattr(self, name) is not None:
            setattr(self, name, None)
        else:
            del self.extra[name]

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in FIELDS if getattr(self, name) is not None)
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={type(v).__name__}" for k, v in self.items())
        return f"TrainingState({parts})"


def ema_as_model_target(target: dict[str, Any], *, expected: bool = False) -> dict[str, Any]:
    """What a read with ``ema_as_model`` asks of a checkpoint: the model's parameters from the EMA's
    (``ema/params``), its other state (batch statistics, RNG counters) from the model's. With ``expected``,
    the structure the checkpoint must hold for it (the model's own part whole)."""
    out = dict(target)
    params, rest = nnx.split_state(target[MODEL], nnx.Param, ...)
    if not expected:
        if jax.tree.leaves(rest):
            out[MODEL] = rest
        else:  # a model of parameters only: nothing of it is read (an empty item is not a tree Orbax reads)
            del out[MODEL]
    out[EMA] = nnx.State({"params": params})
    return out


def ema_as_model_restored(restored: dict[str, Any]) -> dict[str, Any]:
    """The states read with :func:`ema_as_model_target`, the EMA's parameters moved into the model."""
    out = dict(restored)
    params = out.pop(EMA)["params"]
    out[MODEL] = nnx.merge_state(out[MODEL], params) if MODEL in out else params
    return out


def _flatten(state: TrainingState) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
    names = tuple(state)
    return [(jax.tree_util.DictKey(n), state[n]) for n in names], names


def _unflatten(names: tuple[str, ...], children: Any) -> TrainingState:
    return TrainingState.of(dict(zip(names, children, strict=True)))


jax.tree_util.register_pytree_with_keys(TrainingState, _flatten, _unflatten)
