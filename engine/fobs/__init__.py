"""FOBS: flengine's object serialization, msgpack plus registered decomposers, never pickle.

The public calls (a default registry holds flengine's own decomposers; pass ``registry=`` to use
another):

- `serialize(obj)` -> ``(header, frames)`` and `deserialize(header, frames)`;
- `register(decomposer)` / `register_enum(EnumClass)` to teach the default registry a type;
- `Decomposer`, `Datum`, `DatumType`, `EncodeContext`, `DecodeContext`, `Registry` to extend it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from enum import Enum
from typing import Any

from engine.fobs import serializer
from engine.fobs.arrays import NumpyArrayDecomposer, NumpyScalarDecomposer, TensorDecomposer
from engine.fobs.builtin import builtin_decomposers
from engine.fobs.context import DecodeContext, EncodeContext
from engine.fobs.datum import Buffer, Datum, DatumType
from engine.fobs.decomposer import Decomposer
from engine.fobs.registry import Registry


def new_registry() -> Registry:
    """Return a new registry holding flengine's built-in decomposers (Python types, numpy, torch)."""
    registry = Registry()
    for decomposer in [*builtin_decomposers(), NumpyArrayDecomposer(), NumpyScalarDecomposer(), TensorDecomposer()]:
        registry.register(decomposer)
    return registry


@functools.cache
def default_registry() -> Registry:
    """Return the process-wide registry (built-ins, plus what layers and applications register)."""
    return new_registry()


def register(decomposer: Decomposer[Any]) -> None:
    """Register ``decomposer`` in the default registry (raises on a duplicate type or name)."""
    default_registry().register(decomposer)


def register_enum(enum_type: type[Enum]) -> None:
    """Register an enum class in the default registry so its members can be sent."""
    default_registry().register_enum(enum_type)


def serialize(
    obj: Any, ctx: EncodeContext | None = None, registry: Registry | None = None
) -> tuple[bytes, list[memoryview]]:
    """Serialize ``obj`` into a header and datum frames; see `engine.fobs.serializer.serialize`."""
    return serializer.serialize(obj, registry or default_registry(), ctx)


def deserialize(
    header: Buffer, frames: Sequence[Any] = (), ctx: DecodeContext | None = None, registry: Registry | None = None
) -> Any:
    """Rebuild an object from a received header and frames; see `engine.fobs.serializer.deserialize`."""
    return serializer.deserialize(header, frames, registry or default_registry(), ctx)


__all__ = [
    "Datum",
    "DatumType",
    "DecodeContext",
    "Decomposer",
    "EncodeContext",
    "Registry",
    "default_registry",
    "new_registry",
    "deserialize",
    "register",
    "register_enum",
    "serialize",
]
