"""Fuzzing FOBS: the header and datum frames of an object message received from a peer.

`engine.fobs.deserialize` must rebuild an object or raise `SerializationError` (of which
`MalformedMessageError` and `UnknownTypeError` are kinds), nothing else, for any header and
frames: a valid message's bytes broken, its header's fields replaced, its decomposed objects
given payloads of the wrong shape, its datum references pointing anywhere.
"""

from __future__ import annotations

import datetime
from collections import OrderedDict
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from engine.errors import SerializationError
from engine.fobs import default_registry, deserialize, serialize
from engine.fobs.datum import DatumType
from engine.fobs.serializer import FORMAT_VERSION

from .strategies import EDGE_INTS, FUZZ, MSGPACK_VALUES, mutated

_EXT_OBJECT, _EXT_DATUM = 1, 2

SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10)
ARRAYS = st.builds(
    lambda dtype, shape: np.arange(int(np.prod(shape))).astype(dtype).reshape(shape),
    st.sampled_from(["float32", "int64", "uint8", "bool", "complex64"]),
    st.lists(st.integers(0, 3), max_size=3),
)
TENSORS = st.builds(
    lambda dtype, shape: torch.arange(int(np.prod(shape))).reshape(shape).to(dtype),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool]),
    st.lists(st.integers(0, 3), max_size=3),
)
LEAVES = (
    SCALARS
    | st.binary(max_size=20)
    | ARRAYS
    | TENSORS
    | st.datetimes()
    | st.dates()
    | st.timedeltas()
    | st.builds(np.float32, st.floats(width=32))
)
OBJECTS = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=3)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=5), children, max_size=3)
        | st.dictionaries(st.text(max_size=5), children, max_size=3).map(OrderedDict)
    ),
    max_leaves=8,
)
MESSAGES = OBJECTS.map(lambda obj: serialize(obj))
WIRE_NAMES = sorted(
    default_registry().wire_name(default_registry().for_type(t))
    for t in (tuple, set, frozenset, OrderedDict, datetime.datetime, datetime.date, datetime.timedelta)
) + [default_registry().wire_name(default_registry().for_type(t)) for t in (np.ndarray, np.float32, torch.Tensor)]


def header_of(body: Any, dots: list[Any]) -> bytes:
    return msgpack.packb({"fobs": FORMAT_VERSION, "dots": dots, "body": msgpack.packb(body)})


@st.composite
def broken_objects(draw: st.DrawFn) -> Any:
    """A body holding a decomposed object of a registered type with a payload of any shape."""
    name = draw(st.sampled_from(WIRE_NAMES) | st.text(max_size=10) | MSGPACK_VALUES)
    payload = draw(
        MSGPACK_VALUES
        | st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F32", "BF16", "<f4", "|b1", "O", "V8", "<U3"]) | MSGPACK_VALUES,
                "shape": st.lists(EDGE_INTS | st.integers(-3, 3), max_size=4) | MSGPACK_VALUES,
                "data": st.binary(max_size=16) | st.builds(msgpack.ExtType, st.just(_EXT_DATUM), st.just(b"\x00")),
            }
        )
    )
    return msgpack.ExtType(_EXT_OBJECT, msgpack.packb([name, payload]))


@st.composite
def broken_messages(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A message whose header, body or frames were changed after it was serialized."""
    header, frames = draw(MESSAGES)
    frames = [bytes(f) for f in frames]
    top = msgpack.unpackb(header, raw=False)
    change = draw(st.sampled_from(["header bytes", "body bytes", "dots", "frames", "top field", "object", "datum ref"]))
    if change == "header bytes":
        return draw(mutated(st.just(header))), frames
    if change == "body bytes":
        top["body"] = draw(mutated(st.just(top["body"])))
    elif change == "dots":
        top["dots"] = draw(st.lists(st.sampled_from(DatumType) | EDGE_INTS, max_size=3) | MSGPACK_VALUES)
    elif change == "frames":
        frames = draw(st.lists(st.binary(max_size=40), max_size=3) | st.just(frames[:-1]) | st.just([*frames, b"x"]))
    elif change == "top field":
        top[draw(st.sampled_from(["fobs", "dots", "body", "other"]))] = draw(MSGPACK_VALUES)
    elif change == "object":
        return header_of(draw(broken_objects()), [int(DatumType.BYTES)]), [b"\x00" * 8]
    else:
        index = draw(EDGE_INTS | st.integers(-2, 3) | MSGPACK_VALUES)
        body = [msgpack.ExtType(_EXT_DATUM, msgpack.packb(index)), draw(broken_objects())]
        return header_of(body, [int(DatumType.ARRAY_BYTES)]), [b"\x01" * 12]
    return msgpack.packb(top), frames


def deserialize_or_refuse(header: bytes, frames: list[bytes]) -> None:
    try:
        deserialize(header, frames)
    except SerializationError as e:
        assert str(e)


@FUZZ
@given(message=MESSAGES)
def test_valid_messages_round_trip(message: tuple[bytes, list[memoryview]]) -> None:
    header, frames = message

    rebuilt = deserialize(header, frames)

    assert serialize(rebuilt)[0] == header


@FUZZ
@given(message=broken_messages())
@example(message=(header_of(msgpack.ExtType(_EXT_OBJECT, b"\x91" * 3000 + b"\x01"), []), []))
@example(message=(b"\x81\xa4fobs\x01" + b"\xdf\xff\xff\xff\xff", []))  # a map declaring 4 billion entries
def test_broken_messages_rebuild_or_raise_serialization_error(message: tuple[bytes, list[bytes]]) -> None:
    deserialize_or_refuse(*message)


@FUZZ
@given(header=st.binary(max_size=64), frames=st.lists(st.binary(max_size=8), max_size=2))
def test_random_bytes_are_refused(header: bytes, frames: list[bytes]) -> None:
    deserialize_or_refuse(header, frames)


def test_objects_nested_past_the_depth_limit_are_refused() -> None:
    body: Any = 1
    for _ in range(200):
        body = msgpack.ExtType(_EXT_OBJECT, msgpack.packb([WIRE_NAMES[0], [body]]))

    with pytest.raises(SerializationError, match=r"objects nested deeper than 64 levels"):
        deserialize(header_of(body, []), [])
