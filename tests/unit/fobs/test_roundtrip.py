"""Every decomposer and dtype survives a round trip bit for bit; big buffers travel as frames."""

from __future__ import annotations

import datetime
import math
import weakref
from collections import OrderedDict
from enum import Enum
from typing import Any

import numpy as np
import pytest
import torch

from engine import fobs
from engine.fobs.builtin import builtin_decomposers
from engine.fobs.datum import DATUM_THRESHOLD_BYTES
from engine.fobs.dtypes import _TORCH_BY_NAME


def roundtrip(obj: Any, registry: fobs.Registry | None = None) -> Any:
    header, frames = fobs.serialize(obj, registry=registry)
    # What arrives is bytes from the network, not the sender's memory.
    return fobs.deserialize(bytes(header), [bytes(f) for f in frames], registry=registry)


class Color(Enum):
    RED = "red"
    BLUE = 2


def registry_with_color() -> fobs.Registry:
    registry = fobs.Registry()
    for decomposer in builtin_decomposers():
        registry.register(decomposer)
    registry.register_enum(Color)
    return registry


PLAIN_VALUES = [
    pytest.param({"a": 1, "b": [1.5, None, True, "x"], 3: b"raw"}, id="plain"),
    pytest.param((1, (2, 3), []), id="tuple"),
    pytest.param({1, 2, 3}, id="set"),
    pytest.param(frozenset({"a"}), id="frozenset"),
    pytest.param(OrderedDict([("z", 1), ("a", 2)]), id="ordered-dict"),
    pytest.param(datetime.datetime(2026, 11, 22, 23, 59, 1, 5, tzinfo=datetime.timezone.utc), id="datetime"),
    pytest.param(datetime.date(2026, 11, 22), id="date"),
    pytest.param(datetime.timedelta(days=2, seconds=3, microseconds=4), id="timedelta"),
    pytest.param(b"x" * DATUM_THRESHOLD_BYTES, id="big-bytes"),
    pytest.param(np.float32(0.25), id="numpy-scalar"),
    pytest.param(np.int64(-7), id="numpy-int"),
]


@pytest.mark.parametrize("value", PLAIN_VALUES)
def test_plain_and_builtin_values(value: Any) -> None:
    back = roundtrip(value)

    assert back == value
    assert type(back) is type(value)


def test_enum_members_travel_by_value() -> None:
    registry = registry_with_color()

    assert roundtrip([Color.RED, Color.BLUE], registry) == [Color.RED, Color.BLUE]


def tensor_of(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    raw = torch.randint(0, 256, (math.prod(shape) * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("name", sorted(_TORCH_BY_NAME))
def test_every_tensor_dtype_is_bitwise_equal(name: str) -> None:
    tensor = tensor_of(_TORCH_BY_NAME[name])

    back = roundtrip({"t": tensor})["t"]

    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(torch.arange(12.0).reshape(3, 4).t(), id="non-contiguous"),
        pytest.param(torch.tensor(3.5), id="zero-dim"),
        pytest.param(torch.empty(0, 4), id="empty"),
        pytest.param(torch.ones(2, requires_grad=True), id="requires-grad"),
        pytest.param(torch.nn.Parameter(torch.ones(2, 2)), id="parameter"),
    ],
)
def test_tensor_shapes_and_kinds(tensor: torch.Tensor) -> None:
    back = roundtrip(tensor)

    assert type(back) is torch.Tensor
    assert torch.equal(back, tensor.detach())
    back.add_(1)  # received tensors are writable


@pytest.mark.parametrize("dtype", ["<f8", "<f4", "<f2", "<i8", "<u2", "|b1", "<c16", "|S3", "<U2"])
def test_every_plain_numpy_dtype_is_bitwise_equal(dtype: str) -> None:
    array = np.frombuffer(np.random.default_rng(0).bytes(np.dtype(dtype).itemsize * 6), dtype=dtype).reshape(2, 3)

    back = roundtrip(array)

    assert back.dtype == array.dtype
    assert back.tobytes() == array.tobytes()
    assert back.flags.writeable


def test_state_dict_keeps_order_and_values() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = model.state_dict()

    back = roundtrip(state)

    assert list(back) == list(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_tensor_memory_is_sent_without_a_copy() -> None:
    tensor = torch.zeros(1024)

    _, frames = fobs.serialize({"t": tensor})
    tensor[0] = 42.0  # the frame is a view of the tensor's own memory

    assert np.frombuffer(frames[0], dtype=np.float32)[0] == 42.0


def test_big_bytes_leave_the_msgpack_body() -> None:
    small, big = b"s" * 100, b"b" * DATUM_THRESHOLD_BYTES

    header, frames = fobs.serialize({"small": small, "big": big})

    assert [f.nbytes for f in frames] == [len(big)]
    assert len(header) < 300


def test_a_decode_context_kept_by_the_caller_does_not_keep_the_received_frames_alive() -> None:
    header, frames = fobs.serialize({"x": np.arange(100_000)})
    received = [np.frombuffer(bytes(frame), dtype=np.uint8) for frame in frames]
    alive = weakref.ref(received[0])
    ctx = fobs.DecodeContext()

    result = fobs.deserialize(header, received, ctx)
    del received

    assert alive() is None
    assert np.array_equal(result["x"], np.arange(100_000))
