"""`DXOAggregatorAsModel`: a DXO aggregator used through the FLModel interface gives the same
weighted mean, metrics and refusals as when it is given the DXOs themselves."""

from __future__ import annotations

import pytest
import torch

from engine.aggregators import DXOAggregator, DXOAggregatorAsModel
from engine.model import FLModel, MetaKey, ParamsType


def _result(value: float, steps: int, params_type: ParamsType = ParamsType.FULL, accuracy: float = 0.5) -> FLModel:
    return FLModel(
        params={"w": torch.full((2, 2), value)},
        params_type=params_type,
        meta={MetaKey.NUM_STEPS_CURRENT_ROUND: steps, "metrics": {"accuracy": accuracy}},
    )


def test_the_weighted_mean_and_its_metrics_come_back_as_an_flmodel() -> None:
    adapter = DXOAggregatorAsModel(DXOAggregator(expected_data_kind="WEIGHTS"))
    adapter.start_round(3, dict)

    adapter.accept_model(_result(1.0, 1, accuracy=0.2), "site-1")
    adapter.accept_model(_result(5.0, 3, accuracy=0.6), "site-2")
    aggregate = adapter.aggregate_model()

    assert aggregate.params_type is ParamsType.FULL
    assert torch.allclose(aggregate.params["w"], torch.full((2, 2), 4.0))  # (1 x 1 + 5 x 3) / 4
    assert aggregate.meta["nr_aggregated"] == 2 and aggregate.meta["current_round"] == 3
    assert aggregate.meta["metrics"] == pytest.approx({"accuracy": 0.5})  # (0.2 + 1.8) / 4


def test_a_result_the_aggregator_refuses_raises_and_adds_nothing() -> None:
    adapter = DXOAggregatorAsModel(DXOAggregator(expected_data_kind="WEIGHTS"))
    adapter.start_round(0, dict)

    with pytest.raises(ValueError, match="refused by the aggregator"):
        adapter.accept_model(_result(9.0, 1, ParamsType.DIFF), "site-1")  # a WEIGHT_DIFF among WEIGHTS
    adapter.accept_model(_result(2.0, 1), "site-2")

    assert torch.equal(adapter.aggregate_model().params["w"], torch.full((2, 2), 2.0))


def test_only_an_aggregator_can_be_wrapped() -> None:
    with pytest.raises(TypeError, match="aggregator: expected an Aggregator, got dict"):
        DXOAggregatorAsModel({})  # type: ignore[arg-type]
