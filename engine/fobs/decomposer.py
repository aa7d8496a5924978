"""`Decomposer`: the extension point that teaches FOBS one type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from engine.fobs.context import DecodeContext, EncodeContext

T = TypeVar("T")


class Decomposer(ABC, Generic[T]):
    """Turns objects of one type into msgpack-ready data and back.

    ``decompose`` may return dicts, lists, str, int, float, bool, None, bytes, `Datum` objects
    (large buffers sent as their own frames) and objects of other registered types. On the wire
    the result is tagged with `wire_name`, which is only ever looked up in the receiver's
    registry: nothing on the wire chooses a class to import.

    Example:
        >>> class PointDecomposer(Decomposer[Point]):
        ...     def supported_type(self) -> type[Point]:
        ...         return Point
        ...     def decompose(self, obj, ctx):
        ...         return [obj.x, obj.y]
        ...     def recompose(self, data, ctx):
        ...         return Point(*data)
        >>> fobs.register(PointDecomposer())
    """

    #: When True the decomposer also serves subclasses of its type (it must rebuild the exact
    #: subclass from its data, as the numpy scalar decomposer does from the dtype).
    covers_subclasses: bool = False

    @abstractmethod
    def supported_type(self) -> type[T]:
        """Return the type this decomposer handles."""

    def wire_name(self) -> str:
        """Return the name that tags this type on the wire; unique within a registry."""
        cls = self.supported_type()
        return f"{cls.__module__}.{cls.__qualname__}"

    @abstractmethod
    def decompose(self, obj: T, ctx: EncodeContext) -> Any:
        """Return msgpack-ready data for ``obj``."""

    @abstractmethod
    def recompose(self, data: Any, ctx: DecodeContext) -> T:
        """Rebuild the object from what `decompose` returned (already recomposed itself)."""
