"""Attributes of the Trainer that are views: its live objects by name (``trainer.model``), and renamed methods."""

from __future__ import annotations

import warnings
from typing import Any, Protocol


class Owner(Protocol):
    """What a :class:`LiveObject` reads of the Trainer."""

    def objects(self) -> dict[str, Any]: ...


class LiveObject:
    """``trainer.<name>``: the live object of that name (``model``, ``ema``, ``optimizer``), read-only.

    The same object ``trainer.objects()[name]`` gives, brought up to date with the training state;
    ``None`` for an object the Trainer does not have (``ema`` with ``ema_decay=None``).
    """

    def __init__(self, name: str):
        self.name = name

    def __get__(self, trainer: Owner | None, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return trainer.objects().get(self.name)

    def __set__(self, trainer: Owner, value: Any) -> None:
        raise AttributeError(
            f"Trainer.{self.name} is a read-only view of the live {self.name}; change its values in place "
            f"(nnx.update(trainer.{self.name}, state)), or build another in create_model."
        )


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
