"""Bytes from a peer are untrusted: bad input fails at the boundary with a clear error, imports nothing."""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import pytest
import torch

from engine import fobs
from engine.errors import MalformedMessageError, SerializationError, UnknownTypeError
from engine.fobs import serializer


def message(body: Any, dots: list[int] | None = None) -> bytes:
    return msgpack.packb({"fobs": 1, "dots": dots or [], "body": msgpack.packb(body)})


def obj(name: str, data: Any) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([name, data]))


def datum(index: Any) -> msgpack.ExtType:
    return msgpack.ExtType(2, msgpack.packb(index))


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


class PointDecomposer(fobs.Decomposer[Point]):
    def supported_type(self) -> type[Point]:
        return Point

    def decompose(self, obj: Point, ctx: fobs.EncodeContext) -> Any:
        return obj.x

    def recompose(self, data: Any, ctx: fobs.DecodeContext) -> Point:
        return Point(data)


def test_unregistered_type_on_send_names_it() -> None:
    with pytest.raises(
        UnknownTypeError, match=r"no decomposer is registered for type tests\.unit\.fobs\.test_untrusted\.Point"
    ):
        fobs.serialize({"p": Point(1)})


def test_unregistered_name_on_receive_names_it() -> None:
    sender = fobs.Registry()
    sender.register(PointDecomposer())
    header, frames = fobs.serialize(Point(3), registry=sender)

    with pytest.raises(UnknownTypeError, match=r"unregistered type 'tests\.unit\.fobs\.test_untrusted\.Point'"):
        fobs.deserialize(header, frames, registry=fobs.Registry())


def test_a_wire_name_never_imports_anything() -> None:
    assert "xmlrpc.client" not in sys.modules  # a module nothing here has imported

    with pytest.raises(UnknownTypeError, match=r"'xmlrpc\.client\.ServerProxy'"):
        fobs.deserialize(message(obj("xmlrpc.client.ServerProxy", "http://example.invalid")), [])

    assert "xmlrpc.client" not in sys.modules


def test_registry_refuses_duplicates() -> None:
    registry = fobs.Registry()
    registry.register(PointDecomposer())

    with pytest.raises(ValueError, match=r"a decomposer for Point is already registered"):
        registry.register(PointDecomposer())
    with pytest.raises(TypeError, match=r"expected a Decomposer, got Point"):
        registry.register(Point(1))  # type: ignore[arg-type]


BAD_MESSAGES = [
    pytest.param(b"", [], MalformedMessageError, r"malformed FOBS message", id="empty"),
    pytest.param(b"\xc1garbage", [], MalformedMessageError, r"malformed FOBS message", id="garbage"),
    pytest.param(message({"a": 1})[:-3], [], MalformedMessageError, r"malformed FOBS message", id="truncated"),
    pytest.param(
        msgpack.packb({"fobs": 9, "dots": [], "body": b""}),
        [],
        MalformedMessageError,
        r"not a FOBS message of format 1",
        id="wrong-version",
    ),
    pytest.param(msgpack.packb([1, 2]), [], MalformedMessageError, r"not a FOBS message", id="not-a-map"),
    pytest.param(
        message(1, dots=[0]), [], MalformedMessageError, r"header lists 1 datums but 0 frames arrived", id="frame-count"
    ),
    pytest.param(
        message(datum(3), dots=[0]),
        [b"x"],
        MalformedMessageError,
        r"datum reference 3 is not one of the message's 1 frames",
        id="datum-out-of-range",
    ),
    pytest.param(
        message(datum("0"), dots=[0]), [b"x"], MalformedMessageError, r"datum reference '0'", id="datum-index-type"
    ),
    pytest.param(
        message(msgpack.ExtType(7, b"")),
        [],
        MalformedMessageError,
        r"unknown msgpack extension type 7",
        id="unknown-ext",
    ),
    pytest.param(
        message(msgpack.ExtType(1, msgpack.packb([1, 2, 3]))),
        [],
        MalformedMessageError,
        r"must be \[type name, data\]",
        id="object-shape",
    ),
    pytest.param(
        message({"t": obj("torch.Tensor", {"dtype": "O", "shape": [1], "data": datum(0)})}, dots=[1]),
        [b"12345678"],
        SerializationError,
        r"received a tensor of dtype 'O', which this side cannot hold",
        id="tensor-bad-dtype",
    ),
    pytest.param(
        message(obj("torch.Tensor", {"dtype": "F32", "shape": [4], "data": datum(0)}), dots=[1]),
        [b"12345678"],
        SerializationError,
        r"shape \[4\] needs 16 bytes but 8 arrived",
        id="tensor-shape-lies",
    ),
    pytest.param(
        message(obj("torch.Tensor", {"dtype": "F32", "shape": [-2], "data": datum(0)}), dots=[1]),
        [b"12345678"],
        SerializationError,
        r"invalid shape \[-2\]",
        id="tensor-negative-shape",
    ),
    pytest.param(
        message(obj("numpy.ndarray", {"dtype": "|O", "shape": [1], "data": datum(0)}), dots=[2]),
        [b"12345678"],
        SerializationError,
        r"received an array of dtype '\|O', which this side does not rebuild",
        id="numpy-object-dtype",
    ),
    pytest.param(
        message(obj("builtins.tuple", 5)),
        [],
        SerializationError,
        r"cannot rebuild an object of type 'builtins.tuple': TypeError",
        id="decomposer-data-wrong",
    ),
]


@pytest.mark.parametrize(("header", "frames", "error", "match"), BAD_MESSAGES)
def test_bad_messages_fail_clearly(header: bytes, frames: list[bytes], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fobs.deserialize(header, frames)


def test_deeply_nested_objects_are_refused() -> None:
    body: Any = 1
    for _ in range(serializer.MAX_OBJECT_DEPTH + 1):
        body = obj("builtins.tuple", [body])

    with pytest.raises(MalformedMessageError, match=r"objects nested deeper than 64 levels"):
        fobs.deserialize(message(body), [])


def test_deep_plain_nesting_is_refused_by_msgpack() -> None:
    header = msgpack.packb({"fobs": 1, "dots": [], "body": b"\x91" * 5000 + b"\xc0"})

    with pytest.raises(MalformedMessageError, match=r"malformed FOBS message: StackError"):
        fobs.deserialize(header, [])


def test_oversized_header_is_refused_before_parsing() -> None:
    header, frames = fobs.serialize({"x": "y" * 1000})

    with pytest.raises(MalformedMessageError, match=r"exceeds the limit of 100 bytes"):
        serializer.deserialize(header, frames, fobs.default_registry(), max_header_bytes=100)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        pytest.param({(1, 2): "tuple key"}, r"dict keys must be str or int, got tuple key \(1, 2\)", id="tuple-key"),
        pytest.param(
            torch.ones(2).to_sparse(), r"torch.sparse_coo tensors cannot be sent; call .to_dense\(\) first", id="sparse"
        ),
        pytest.param(
            torch.ones(2, dtype=torch.complex128),
            r"tensors of dtype torch.complex128 cannot be sent \(supported: float64",
            id="unsupported-dtype",
        ),
        pytest.param(2**70, r"cannot serialize: Integer value out of range", id="huge-int"),
    ],
)
def test_what_cannot_be_sent_says_why(value: Any, match: str) -> None:
    with pytest.raises(SerializationError, match=match):
        fobs.serialize(value)
