"""Metrics of a running job on the server: checked, limited per site, written by receivers.

Clients send every number a training script logs (``flare.log(key, value)``) to the server; the
server's `MetricsIntake` checks each (sender, name, value, round), applies each site's limits
and gives it, with the global model's round metrics, to every `MetricsReceiver` of the server
config: `TensorBoardReceiver` (event files, one run per site), `JsonLinesReceiver` (the default,
``<server workspace>/metrics.jsonl``).
"""

from engine.metrics.intake import MetricLimits, MetricsIntake
from engine.metrics.jsonl import JsonLinesReceiver
from engine.metrics.receiver import Metric, MetricsReceiver
from engine.metrics.tensorboard import TensorBoardReceiver

__all__ = [
    "JsonLinesReceiver",
    "Metric",
    "MetricLimits",
    "MetricsIntake",
    "MetricsReceiver",
    "TensorBoardReceiver",
]
