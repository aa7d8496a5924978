"""Aggregators: fold weighted client results into one model (`WeightedAggregationHelper`, `DXOAggregator`)."""

from engine.aggregators.aggregator import Aggregator, ModelAggregator, WeightedModelAggregator
from engine.aggregators.check import check_params_match
from engine.aggregators.dxo_aggregator import DXOAggregator, InTimeAccumulateWeightedAggregator
from engine.aggregators.weighted import WeightedAggregationHelper, release_values, resolve_value

__all__ = [
    "Aggregator",
    "DXOAggregator",
    "InTimeAccumulateWeightedAggregator",
    "ModelAggregator",
    "WeightedAggregationHelper",
    "WeightedModelAggregator",
    "check_params_match",
    "release_values",
    "resolve_value",
]
