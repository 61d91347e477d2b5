"""Name → class registries, one per policy family.

Registration happens at import time (decorators on the policy classes); the
registry is never mutated afterwards, so it is configuration, not run state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from fleetserve.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """A family's registry: ``register`` classes by name, ``get`` them back.

    Args:
        family: the family name used in error messages (``dispatch``, ...).
    """

    def __init__(self, family: str) -> None:
        self.family = family
        self._items: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator registering ``cls`` under ``name``."""

        def deco(cls: type[T]) -> type[T]:
            if name in self._items:
                raise ValueError(f"{self.family} policy {name!r} registered twice")
            self._items[name] = cls
            return cls

        return deco

    def get(self, name: str) -> type[T]:
        """The class registered under ``name``; a clear error suggesting close names."""
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(f"{self.family} policy", name, self._items) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)
