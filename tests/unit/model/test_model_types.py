"""The model layer's types travel through FOBS whole: FLModel, Shareable with headers, DXO."""

from __future__ import annotations

from enum import Enum
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from engine import fobs
from engine.errors import SerializationError
from engine.model import (
    DXO,
    DataKind,
    FLModel,
    MetaKey,
    ParamsType,
    ReservedHeaderKey,
    ReturnCode,
    Shareable,
    make_reply,
)


def roundtrip(obj: Any) -> Any:
    header, frames = fobs.serialize(obj)
    return fobs.deserialize(bytes(header), [bytes(f) for f in frames])


def test_fl_model_round_trips() -> None:
    model = FLModel(
        params={"w": torch.randn(3, 2), "b": torch.zeros(2)},
        params_type=ParamsType.DIFF,
        metrics={"accuracy": np.float32(0.93)},
        meta={MetaKey.NUM_STEPS_CURRENT_ROUND: 100},
        current_round=2,
        total_rounds=5,
    )

    back = roundtrip(model)

    assert back.params_type is ParamsType.DIFF
    assert torch.equal(back.params["w"], model.params["w"])
    assert back.metrics == {"accuracy": np.float32(0.93)}
    assert back.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 100
    assert (back.current_round, back.total_rounds, back.start_round) == (2, 5, 0)


def test_fl_model_meta_travels_before_its_params() -> None:
    header, _ = fobs.serialize(FLModel(params={"w": torch.ones(1)}, meta={"NUM_STEPS_CURRENT_ROUND": 3}))
    body = msgpack.unpackb(msgpack.unpackb(header)["body"])

    fields = list(msgpack.unpackb(body.data)[1])

    assert fields.index("meta") < fields.index("params")


def test_shareable_with_dxo_and_headers_round_trips() -> None:
    shareable = DXO(DataKind.WEIGHTS, {"w": torch.arange(4.0)}, {MetaKey.NUM_STEPS_CURRENT_ROUND: 7}).to_shareable()
    shareable.set_header(ReservedHeaderKey.TASK_NAME, "train")
    shareable.set_header(ReservedHeaderKey.CURRENT_ROUND, 1)

    back = roundtrip(shareable)

    assert type(back) is Shareable
    assert back.get_header(ReservedHeaderKey.TASK_NAME) == "train"
    assert back.get_return_code() is ReturnCode.OK
    dxo = DXO.from_shareable(back)
    assert dxo.data_kind is DataKind.WEIGHTS
    assert torch.equal(dxo.data["w"], torch.arange(4.0))
    assert dxo.meta == {MetaKey.NUM_STEPS_CURRENT_ROUND: 7}


def test_reply_carries_its_return_code() -> None:
    assert roundtrip(make_reply(ReturnCode.EXECUTION_EXCEPTION)).get_return_code() is ReturnCode.EXECUTION_EXCEPTION


def test_dxo_collection_nests() -> None:
    inner = DXO(DataKind.METRICS, {"loss": 0.5})
    outer = DXO(DataKind.COLLECTION, {"val": inner})

    back = roundtrip(outer)

    assert back.data["val"] == inner


def test_dxo_with_a_forged_data_kind_is_refused() -> None:
    header = msgpack.packb(
        {
            "fobs": 1,
            "dots": [],
            "body": msgpack.packb(msgpack.ExtType(1, msgpack.packb(["flengine.DXO", ["WEIGHTS", {}, {}]]))),
        }
    )

    with pytest.raises(SerializationError, match=r"DXO data kind must be a DataKind, got 'WEIGHTS'"):
        fobs.deserialize(header, [])


def test_dxo_from_a_plain_shareable_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match=r"the shareable carries no DXO"):
        DXO.from_shareable(Shareable())


class Level(str, Enum):
    LOW = "low"


def test_str_subclass_keys_travel_as_their_value() -> None:
    back = roundtrip({Level.LOW: 1})

    assert back == {"low": 1}
    assert back[Level.LOW] == 1  # a lookup with the original key still works
