"""Aggregators: the checks a result passes (`ResultRules`) and the ways results become one model.

The weighted mean (`WeightedModelAggregator`, `DXOAggregator`) and the robust aggregators that
limit what a lying site can do (`NormClippingAggregator`, `CoordinateMedianAggregator`,
`TrimmedMeanAggregator`, `KrumAggregator`; `ModelAggregatorAsDXO` for ScatterAndGather), and
`DXOAggregatorAsModel`, which lets the workflows' round loop use a DXO `Aggregator`.
"""

from engine.aggregators.aggregator import (
    DEFAULT_MAX_LOCAL_STEPS,
    Aggregator,
    ModelAggregator,
    WeightedModelAggregator,
    check_max_local_steps,
)
from engine.aggregators.check import check_params_match
from engine.aggregators.clipping import NormClippingAggregator
from engine.aggregators.coordinate import CoordinateMedianAggregator, TrimmedMeanAggregator
from engine.aggregators.dxo_adapter import DXOAggregatorAsModel, ModelAggregatorAsDXO
from engine.aggregators.dxo_aggregator import DXOAggregator, InTimeAccumulateWeightedAggregator
from engine.aggregators.kept import KeptResultsAggregator
from engine.aggregators.krum import KrumAggregator
from engine.aggregators.rules import ResultRules, check_metric_ranges, default_metric_range
from engine.aggregators.weighted import WeightedAggregationHelper, release_values, resolve_value

__all__ = [
    "DEFAULT_MAX_LOCAL_STEPS",
    "Aggregator",
    "CoordinateMedianAggregator",
    "DXOAggregator",
    "DXOAggregatorAsModel",
    "InTimeAccumulateWeightedAggregator",
    "KeptResultsAggregator",
    "KrumAggregator",
    "ModelAggregator",
    "ModelAggregatorAsDXO",
    "NormClippingAggregator",
    "TrimmedMeanAggregator",
    "ResultRules",
    "WeightedAggregationHelper",
    "WeightedModelAggregator",
    "check_max_local_steps",
    "check_metric_ranges",
    "check_params_match",
    "default_metric_range",
    "release_values",
    "resolve_value",
]
