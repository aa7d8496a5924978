"""`Registry`: which decomposer serves which type, and which handler claims which datum type."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from engine.errors import UnknownTypeError
from engine.fobs.context import DecodeContext
from engine.fobs.decomposer import Decomposer

DatumHandler = Callable[[DecodeContext, int], None]


class Registry:
    """Decomposers by type and by wire name, plus handlers for datum object types.

    Registration is strict: a second decomposer for the same type or wire name raises, so two
    plugins can never silently disagree about how a type travels.
    """

    def __init__(self) -> None:
        self._by_type: dict[type, Decomposer[Any]] = {}
        self._by_name: dict[str, Decomposer[Any]] = {}
        self._subclass_decomposers: list[Decomposer[Any]] = []
        self._datum_handlers: dict[int, DatumHandler] = {}
        self._names: dict[int, str] = {}  # id(decomposer) -> wire name, computed once

    def copy(self) -> Registry:
        """A new registry with the same decomposers and datum handlers, changed independently."""
        twin = Registry()
        twin._by_type = dict(self._by_type)
        twin._by_name = dict(self._by_name)
        twin._subclass_decomposers = list(self._subclass_decomposers)
        twin._datum_handlers = dict(self._datum_handlers)
        twin._names = dict(self._names)
        return twin

    def register(self, decomposer: Decomposer[Any]) -> None:
        """Add ``decomposer``.

        Raises:
            TypeError: ``decomposer`` is not a `Decomposer`.
            ValueError: Its type or wire name is already registered.
        """
        if not isinstance(decomposer, Decomposer):
            raise TypeError(f"expected a Decomposer, got {type(decomposer).__name__}")
        cls, name = decomposer.supported_type(), decomposer.wire_name()
        if cls in self._by_type:
            raise ValueError(f"a decomposer for {cls.__qualname__} is already registered: {self._by_type[cls]!r}")
        if name in self._by_name:
            raise ValueError(f"wire name {name!r} is already taken by {self._by_name[name]!r}")
        self._add(decomposer, cls, name)

    def replace(self, decomposer: Decomposer[Any]) -> Decomposer[Any]:
        """Put ``decomposer`` in the place of the one registered for its type; return the old one.

        For layers that change how a type travels (the streaming layer swaps the native tensor
        decomposer for one that sends references). The new wire name must be free.

        Raises:
            ValueError: Nothing is registered for the type, or the wire name is taken.
        """
        cls, name = decomposer.supported_type(), decomposer.wire_name()
        old = self._by_type.get(cls)
        if old is None:
            raise ValueError(f"no decomposer for {cls.__qualname__} is registered, so none can be replaced")
        old_name = self._names[id(old)]
        if name in self._by_name and name != old_name:
            raise ValueError(f"wire name {name!r} is already taken by {self._by_name[name]!r}")
        del self._by_name[old_name], self._names[id(old)]
        if old in self._subclass_decomposers:
            self._subclass_decomposers.remove(old)
        self._add(decomposer, cls, name)
        return old

    def _add(self, decomposer: Decomposer[Any], cls: type, name: str) -> None:
        self._by_type[cls] = decomposer
        self._by_name[name] = decomposer
        self._names[id(decomposer)] = name
        if decomposer.covers_subclasses:
            self._subclass_decomposers.append(decomposer)

    def register_enum(self, enum_type: type[Enum]) -> None:
        """Register an enum class so its members travel by value."""
        from engine.fobs.builtin import EnumDecomposer  # builtin decomposers import this module

        self.register(EnumDecomposer(enum_type))

    def register_datum_handler(self, dot: int, handler: DatumHandler) -> None:
        """Let ``handler(ctx, frame_index)`` claim every datum of type ``dot`` before decoding.

        Raises:
            ValueError: ``dot`` already has a handler.
        """
        if dot in self._datum_handlers:
            raise ValueError(f"datum type {dot} already has a handler: {self._datum_handlers[dot]!r}")
        self._datum_handlers[dot] = handler

    def for_type(self, cls: type) -> Decomposer[Any]:
        """Return the decomposer that serves ``cls``.

        Raises:
            UnknownTypeError: Nothing is registered for it.
        """
        decomposer = self._by_type.get(cls)
        if decomposer is not None:
            return decomposer
        for candidate in self._subclass_decomposers:
            if issubclass(cls, candidate.supported_type()):
                return candidate
        raise UnknownTypeError(
            f"no decomposer is registered for type {cls.__module__}.{cls.__qualname__} "
            "(register one with engine.fobs.register(), or send plain dicts and lists)"
        )

    def wire_names(self) -> set[str]:
        """The wire names registered."""
        return set(self._by_name)

    def for_name(self, name: str) -> Decomposer[Any]:
        """Return the decomposer registered under wire name ``name``.

        Raises:
            UnknownTypeError: The name is not registered here; nothing is imported to find it.
        """
        decomposer = self._by_name.get(name) if isinstance(name, str) else None
        if decomposer is None:
            raise UnknownTypeError(
                f"received an object of unregistered type {name!r}; register its decomposer on this side"
            )
        return decomposer

    def wire_name(self, decomposer: Decomposer[Any]) -> str:
        """Return the wire name ``decomposer`` was registered under."""
        return self._names[id(decomposer)]

    def datum_handler(self, dot: int) -> DatumHandler | None:
        """Return the handler of datum type ``dot``, if any."""
        return self._datum_handlers.get(dot)
