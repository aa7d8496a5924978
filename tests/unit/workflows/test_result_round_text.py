"""A result of another round is refused with both rounds as users count them (from 1)."""

from __future__ import annotations

import torch

from engine.model import FLModel, ReservedHeaderKey, ReturnCode, shareable_from_model
from engine.workflows import ModelController


def test_a_result_of_another_round_is_refused_naming_both_rounds_from_1() -> None:
    result = shareable_from_model(FLModel(params={"w": torch.zeros(2)}))
    result.set_return_code(ReturnCode.OK)
    result.set_header(ReservedHeaderKey.CURRENT_ROUND, 0)  # the first round's result

    why = ModelController._result_model(result, "site-1", current_round=2)  # while the third round runs

    assert why == "result of round 1 arrived in round 3"


def test_a_result_of_this_round_is_taken() -> None:
    result = shareable_from_model(FLModel(params={"w": torch.zeros(2)}))
    result.set_return_code(ReturnCode.OK)
    result.set_header(ReservedHeaderKey.CURRENT_ROUND, 2)

    model = ModelController._result_model(result, "site-1", current_round=2)

    assert isinstance(model, FLModel) and model.meta["client_name"] == "site-1"
