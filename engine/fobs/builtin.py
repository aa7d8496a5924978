"""Decomposers for Python types msgpack has no form for: tuples, sets, ordered dicts, dates, enums."""

from __future__ import annotations

import datetime
from collections import OrderedDict
from enum import Enum
from typing import Any

from engine.fobs.context import DecodeContext, EncodeContext
from engine.fobs.decomposer import Decomposer


class AsListDecomposer(Decomposer[Any]):
    """A collection msgpack has no form for (tuple, set, frozenset) travels as a list.

    Args:
        collection_type: The type to rebuild from the list; it must accept an iterable.
    """

    def __init__(self, collection_type: type) -> None:
        self._collection_type = collection_type

    def supported_type(self) -> type:
        return self._collection_type

    def decompose(self, obj: Any, ctx: EncodeContext) -> Any:
        return list(obj)

    def recompose(self, data: Any, ctx: DecodeContext) -> Any:
        return self._collection_type(data)


class OrderedDictDecomposer(Decomposer[OrderedDict]):
    """Ordered dicts (as ``state_dict()`` returns) travel as ``[key, value]`` pairs, in order."""

    def supported_type(self) -> type[OrderedDict]:
        return OrderedDict

    def decompose(self, obj: OrderedDict, ctx: EncodeContext) -> Any:
        return [[key, value] for key, value in obj.items()]

    def recompose(self, data: Any, ctx: DecodeContext) -> OrderedDict:
        return OrderedDict((key, value) for key, value in data)


class DatetimeDecomposer(Decomposer[datetime.datetime]):
    """Datetimes travel as ISO 8601 strings (with their time zone, if any)."""

    def supported_type(self) -> type[datetime.datetime]:
        return datetime.datetime

    def decompose(self, obj: datetime.datetime, ctx: EncodeContext) -> Any:
        return obj.isoformat()

    def recompose(self, data: Any, ctx: DecodeContext) -> datetime.datetime:
        return datetime.datetime.fromisoformat(data)


class DateDecomposer(Decomposer[datetime.date]):
    """Dates travel as ISO 8601 strings."""

    def supported_type(self) -> type[datetime.date]:
        return datetime.date

    def decompose(self, obj: datetime.date, ctx: EncodeContext) -> Any:
        return obj.isoformat()

    def recompose(self, data: Any, ctx: DecodeContext) -> datetime.date:
        return datetime.date.fromisoformat(data)


class TimedeltaDecomposer(Decomposer[datetime.timedelta]):
    """Durations travel as ``[days, seconds, microseconds]``, exactly."""

    def supported_type(self) -> type[datetime.timedelta]:
        return datetime.timedelta

    def decompose(self, obj: datetime.timedelta, ctx: EncodeContext) -> Any:
        return [obj.days, obj.seconds, obj.microseconds]

    def recompose(self, data: Any, ctx: DecodeContext) -> datetime.timedelta:
        days, seconds, microseconds = data
        return datetime.timedelta(days=days, seconds=seconds, microseconds=microseconds)


class EnumDecomposer(Decomposer[Enum]):
    """Members of one enum class travel by value; register each enum class explicitly.

    Args:
        enum_type: The enum class; its members' values must themselves be serializable.
    """

    def __init__(self, enum_type: type[Enum]) -> None:
        if not (isinstance(enum_type, type) and issubclass(enum_type, Enum)):
            raise TypeError(f"expected an Enum class, got {enum_type!r}")
        self._enum_type = enum_type

    def supported_type(self) -> type[Enum]:
        return self._enum_type

    def wire_name(self) -> str:
        return f"enum:{super().wire_name()}"

    def decompose(self, obj: Enum, ctx: EncodeContext) -> Any:
        return obj.value

    def recompose(self, data: Any, ctx: DecodeContext) -> Enum:
        return self._enum_type(data)


def builtin_decomposers() -> list[Decomposer[Any]]:
    """Return fresh instances of the decomposers above, for a new registry."""
    return [
        AsListDecomposer(tuple),
        AsListDecomposer(set),
        AsListDecomposer(frozenset),
        OrderedDictDecomposer(),
        DatetimeDecomposer(),
        DateDecomposer(),
        TimedeltaDecomposer(),
    ]
