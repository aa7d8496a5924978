"""Aggregators: fold weighted client results into one model (`WeightedAggregationHelper`, `DXOAggregator`)."""

from engine.aggregators.aggregator import (
    DEFAULT_MAX_LOCAL_STEPS,
    Aggregator,
    ModelAggregator,
    WeightedModelAggregator,
    check_max_local_steps,
)
from engine.aggregators.check import check_params_match
from engine.aggregators.dxo_aggregator import DXOAggregator, InTimeAccumulateWeightedAggregator
from engine.aggregators.weighted import WeightedAggregationHelper, release_values, resolve_value

__all__ = [
    "DEFAULT_MAX_LOCAL_STEPS",
    "Aggregator",
    "DXOAggregator",
    "InTimeAccumulateWeightedAggregator",
    "ModelAggregator",
    "WeightedAggregationHelper",
    "WeightedModelAggregator",
    "check_max_local_steps",
    "check_params_match",
    "release_values",
    "resolve_value",
]
