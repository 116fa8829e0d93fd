"""Attributes of the Trainer that are views: its live objects by name (``trainer.model``), and renamed
methods."""

from __future__ import annotations

import warnings
from typing import Any, Protocol


class Owner(Protocol):
    """What a :class:`LiveObject` reads of the Trainer."""

    @property
    def training_state(self) -> Any: ...


class LiveObject:
    """``trainer.<name>``: the live object of that name (``model``, ``ema``, ``optimizer``), read-only.

    The same object ``trainer.training_state.<name>`` gives, brought up to date with the training state;
    ``None`` for an object the Trainer does not have (``ema`` with ``ema_decay=None``).
    """

    def __init__(self, name: str):
        self.name = name

    def __get__(self, trainer: Owner | None, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return trainer.training_state.get(self.name)

    def __set__(self, trainer: Owner, value: Any) -> None:
        raise AttributeError(
            f"Trainer.{self.name} is a read-only view of the live {self.name}; change its values in place "
            f"(nnx.update(trainer.{self.name}, state)), or build another in create_model."
        )


class ProgressField:
    """``trainer.step`` / ``trainer.last_eval``: a field of the Trainer's :class:`Progress`, read and written
    there."""

    def __init__(self) -> None:
        self.name = ""  # the attribute's name, when the class is made

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(trainer.progress, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.progress, self.name, value)


class ObjectsView:
    """``trainer.objects()``, deprecated: a dict of :attr:`Trainer.training_state`'s parts, with a warning."""

    def __get__(self, trainer: Owner | None, owner: type | None = None) -> Any:
        if trainer is None:
            return self

        def objects() -> dict[str, Any]:
            warnings.warn(
                "Trainer.objects() is now Trainer.training_state (a TrainingState: .model, .optimizer, .ema; "
                "it reads as the same mapping).",
                DeprecationWarning,
                stacklevel=2,
            )
            return dict(trainer.training_state)

        return objects


class RenamedMethod:
    """A method's old name: calls the new one, with a DeprecationWarning naming it."""

    def __init__(self, new: str):
        self.new = new
        self.old = ""  # "Class.name", when the class is made

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = f"{owner.__name__}.{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warnings.warn(
            f"{self.old} is now {self.old.rsplit('.', 1)[0]}.{self.new}", DeprecationWarning, stacklevel=2
        )
        return getattr(obj, self.new)
