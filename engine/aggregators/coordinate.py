"""Coordinate-wise robust aggregators: `CoordinateMedianAggregator` and `TrimmedMeanAggregator`.

Both look at each coordinate (each element of each tensor) on its own: the same coordinate of
every result is sorted and the middle value(s) kept. A site that sends absurd values moves a
coordinate's aggregate only as far as the honest values around the middle allow.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

from engine.aggregators.kept import Aggregate, KeptResult, KeptResultsAggregator, combine_metrics
from engine.aggregators.order_statistics import nan_as_largest, order_statistics
from engine.aggregators.stacked import PER_CLIENT_BLOCK_BYTES, combine_values

logger = logging.getLogger(__name__)


def median_rows(rows: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """Each column's median (the mean of the two middle values for an even count), as numpy's."""
    count = rows.shape[0]
    if count == 1:
        return rows[0]
    nan_as_largest(rows)
    middle = order_statistics(rows, (count - 1) // 2, count // 2 + 1, spare)
    if len(middle) == 1:
        return middle[0]
    return middle[0].add_(middle[1]).mul_(0.5)


def trimmed_mean_rows(rows: torch.Tensor, spare: torch.Tensor, trimmed: int) -> torch.Tensor:
    """Each column's mean after dropping its ``trimmed`` largest and ``trimmed`` smallest values."""
    count = rows.shape[0]
    if trimmed == 0:
        return torch.sum(rows, dim=0, out=spare).div_(count)
    nan_as_largest(rows)
    middle = order_statistics(rows, trimmed, count - trimmed, spare)
    total = middle[0]
    for row in middle[1:]:
        total.add_(row)
    return total.div_(len(middle))


class CoordinateMedianAggregator(KeptResultsAggregator):
    """Coordinate-wise median of the round's results (unweighted), and the median of each metric.

    For an even number of results a coordinate's median is the mean of its two middle values
    (as ``numpy.median``); integer tensors (e.g. BatchNorm's ``num_batches_tracked``) get the
    median rounded. A NaN counts as the largest value. FULL results give a FULL aggregate, DIFF
    results a DIFF one.

    Defends against: sites whose values are outliers coordinate by coordinate (scaled, sign
    flipped, huge or NaN updates) as long as fewer than half of the results are bad: each
    coordinate stays within the range of the honest values. It does not defend against many
    sites that all shift the same coordinates a little, and it is noisier than the mean when
    every site is honest (it ignores results' sizes: no weights).

    Costs: memory, every result is kept until the round ends: n models in memory, unless the
    workflow's ``download_to_disk`` is on, then n files on disk and one block per client in
    memory (plus the output model). Time: per coordinate, a sorting network over n values
    (about n log^2 n / 4 comparisons, vectorised over a block), a few times a weighted mean's.

    Args:
        exclude_vars: Regex of param names left out of the aggregate; None keeps all.
        block_bytes: Bytes of one client's block read at a time.

    Example:
        In ``config_fed_server.conf``, with ``aggregator_id = robust`` in FedAvg's args::

            { id = robust, path = engine.aggregators.CoordinateMedianAggregator }
    """

    rule_name = "median"

    def __init__(self, exclude_vars: str | None = None, block_bytes: int = PER_CLIENT_BLOCK_BYTES) -> None:
        super().__init__(exclude_vars=exclude_vars, block_bytes=block_bytes)

    def _aggregate(self, results: list[KeptResult]) -> Aggregate:
        params = {
            name: combine_values([result.params[name] for result in results], median_rows, self._block_bytes)
            for name in results[0].params
        }
        return Aggregate(params, combine_metrics(results, lambda values: float(np.median(values))), {})


class TrimmedMeanAggregator(KeptResultsAggregator):
    """Coordinate-wise trimmed mean: drop the k largest and k smallest values of each coordinate.

    With n results, ``k = floor(trim_fraction * n)``; each coordinate's aggregate is the mean of
    its n - 2k middle values (unweighted). Integer tensors get that mean rounded; a NaN counts
    as the largest value. Each metric is trimmed the same way over the results that report it.
    FULL results give a FULL aggregate, DIFF results a DIFF one. When ``trim_fraction * n < 1``
    nothing is trimmed (a plain mean; logged as a warning): raise ``min_clients`` or the fraction.

    Defends against: up to k sites per coordinate whose values are outliers (scaled, sign
    flipped, huge updates); with ``trim_fraction`` at or above the share of bad sites, the
    aggregate stays within the honest values' range. Closer to the mean than the median when
    all sites are honest. Not against bad sites beyond k, nor small shifts shared by many.

    Costs: memory as `CoordinateMedianAggregator` (every result kept until the round ends: n
    models in memory, or n files on disk and one block per client with ``download_to_disk``).
    Time: per coordinate a sorting network over n values, as the median.

    Args:
        trim_fraction: Share of the results dropped at each end, in [0, 0.5).
        exclude_vars: Regex of param names left out of the aggregate; None keeps all.
        block_bytes: Bytes of one client's block read at a time.

    Example:
        In ``config_fed_server.conf``, with ``aggregator_id = robust`` in FedAvg's args::

            { id = robust, path = engine.aggregators.TrimmedMeanAggregator, args { trim_fraction = 0.2 } }
    """

    rule_name = "trimmed_mean"

    def __init__(
        self, trim_fraction: float, exclude_vars: str | None = None, block_bytes: int = PER_CLIENT_BLOCK_BYTES
    ) -> None:
        if not _is_fraction(trim_fraction):
            raise ValueError(f"trim_fraction: expected a number in [0, 0.5), got {trim_fraction!r}")
        super().__init__(exclude_vars=exclude_vars, block_bytes=block_bytes)
        self._trim_fraction = float(trim_fraction)

    def trimmed_count(self, count: int) -> int:
        """How many values are dropped at each end of ``count`` values: ``floor(trim_fraction * count)``."""
        return math.floor(self._trim_fraction * count)

    def _check_count(self, count: int) -> None:
        # floor(f * n) < n / 2 for f < 0.5, so n >= 2k + 1 always holds; kept as the rule's guard.
        trimmed = self.trimmed_count(count)
        if count < 2 * trimmed + 1:
            raise RuntimeError(
                f"trimmed mean of {count} results drops {trimmed} at each end and keeps none; "
                f"it needs at least {2 * trimmed + 1} results"
            )

    def _aggregate(self, results: list[KeptResult]) -> Aggregate:
        trimmed = self.trimmed_count(len(results))
        if trimmed == 0 and self._trim_fraction > 0:
            logger.warning(
                "trimmed mean trims nothing: nr_aggregated=%d trim_fraction=%g (needs at least %.0f results to "
                "trim one at each end)",
                len(results),
                self._trim_fraction,
                math.ceil(1 / self._trim_fraction) if 1 / self._trim_fraction < 2**53 else math.inf,
            )

        def rule(rows: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
            return trimmed_mean_rows(rows, spare, trimmed)

        params = {
            name: combine_values([result.params[name] for result in results], rule, self._block_bytes)
            for name in results[0].params
        }
        metrics = combine_metrics(results, lambda values: _trimmed_mean(values, self._trim_fraction))
        return Aggregate(params, metrics, {"trimmed": trimmed})


def _trimmed_mean(values: list[float], trim_fraction: float) -> float:
    trimmed = math.floor(trim_fraction * len(values))
    kept = sorted(values)[trimmed : len(values) - trimmed]
    return float(sum(kept) / len(kept))


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value < 0.5
