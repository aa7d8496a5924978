"""`KrumAggregator`: Krum and multi-Krum (Blanchard et al., 2017), the results closest to the others."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from engine.aggregators.aggregator import (
    DEFAULT_MAX_LOCAL_STEPS,
    check_aggregation_weights,
    check_max_local_steps,
    local_steps,
)
from engine.aggregators.blocks import torch_dtype_of
from engine.aggregators.kept import Aggregate, KeptResult, KeptResultsAggregator
from engine.aggregators.stacked import PER_CLIENT_BLOCK_BYTES, BlockStack, combine_values
from engine.model import FLModel

logger = logging.getLogger(__name__)


def krum_scores(distances: torch.Tensor, num_byzantine: int) -> list[float]:
    """Each result's Krum score: the sum of its ``n - f - 2`` smallest squared distances to the others.

    Args:
        distances: ``(n, n)`` squared distances (the diagonal is ignored); NaN counts as +inf.
        num_byzantine: ``f``, the number of Byzantine results assumed.
    """
    count = distances.shape[0]
    nearest = max(0, count - num_byzantine - 2)
    distances = torch.nan_to_num(distances.to(torch.float64), nan=math.inf)
    scores = []
    for i in range(count):
        others = torch.cat([distances[i, :i], distances[i, i + 1 :]])
        scores.append(float(torch.sort(others).values[:nearest].sum()))
    return scores


def pairwise_sq_distances(results: list[KeptResult], block_bytes: int) -> torch.Tensor:
    """``(n, n)`` squared L2 distances between the results over all their float params (float64).

    Read block by block; each block's sums of squares are taken in float32 (float64 for float64
    params) and added up in float64. A result with a NaN or an infinity is at +inf from all others.
    """
    count = len(results)
    distances = torch.zeros((count, count), dtype=torch.float64)
    for name in results[0].params:
        values = [result.params[name] for result in results]
        if not torch_dtype_of(values[0]).is_floating_point:
            continue
        blocks = BlockStack(values, block_bytes, scratch_rows=1)
        difference = blocks.scratch[0]
        for _, rows in blocks:
            scratch = difference[: rows.shape[1]]
            for i in range(count):
                for j in range(i + 1, count):
                    torch.sub(rows[i], rows[j], out=scratch)
                    distances[i, j] += float(torch.dot(scratch, scratch))
    distances = distances + distances.T
    return torch.where(torch.isfinite(distances), distances, torch.full_like(distances, math.inf))


class KrumAggregator(KeptResultsAggregator):
    """Krum / multi-Krum: the mean of the ``num_selected`` results closest to their neighbours.

    Each result's score is the sum of the squared L2 distances (over all float tensors) to its
    ``n - f - 2`` nearest other results, ``f = num_byzantine``; the ``num_selected`` results with
    the lowest scores (ties by contributor name) are selected and their weighted mean is the
    aggregate (weights as FedAvg's: ``NUM_STEPS_CURRENT_ROUND`` times ``aggregation_weights``,
    bounded by ``max_local_steps``). ``num_selected = 1`` is Krum: the aggregate is the selected
    result itself; more is multi-Krum. Integer tensors get the selected results' mean rounded;
    metrics the selected results' weighted mean. The aggregate's meta lists the ``selected``
    contributors (best first) and every contributor's ``krum_scores``. FULL results give a FULL
    aggregate, DIFF results a DIFF one.

    A round needs ``n >= 2f + 3`` results (and ``n >= f + num_selected``): set the workflow's
    ``min_clients`` to at least that. A round with fewer (sites died, or results were refused)
    assumes as many Byzantine sites as fit, ``(n - 3) // 2``, logs it, and goes on (`assumed`).

    Defends against: up to ``f`` Byzantine sites whose whole update lies far from the honest
    ones (scaled, sign flipped, random or NaN updates); their scores are large, so they are not
    selected. Not against bad updates that stay among the honest ones, and with one result
    selected it throws away the other sites' data (multi-Krum averages more).

    Costs: memory, every result is kept until the round ends: n models in memory, unless the
    workflow's ``download_to_disk`` is on, then n files on disk and one block per client in
    memory (plus the output model). Time: n (n - 1) / 2 distances over the whole model (one pass
    over every result), then a second pass over the selected ones.

    Args:
        num_byzantine: ``f``, the number of Byzantine sites assumed (>= 0).
        num_selected: How many results are averaged (>= 1); 1 is Krum.
        aggregation_weights: Client name -> extra weight factor (default 1.0 for each).
        weigh_by_local_iter: Whether to weight by ``NUM_STEPS_CURRENT_ROUND``.
        max_local_steps: The largest ``NUM_STEPS_CURRENT_ROUND`` a result may claim.
        exclude_vars: Regex of param names left out of the aggregate (and of the distances).
        block_bytes: Bytes of one client's block read at a time.

    Example:
        In ``config_fed_server.conf``, with ``aggregator_id = robust`` and ``min_clients = 7``
        in FedAvg's args::

            { id = robust, path = engine.aggregators.KrumAggregator,
              args { num_byzantine = 2, num_selected = 3 } }
    """

    rule_name = "krum"

    def __init__(
        self,
        num_byzantine: int,
        num_selected: int = 1,
        aggregation_weights: dict[str, float] | None = None,
        weigh_by_local_iter: bool = True,
        max_local_steps: float = DEFAULT_MAX_LOCAL_STEPS,
        exclude_vars: str | None = None,
        block_bytes: int = PER_CLIENT_BLOCK_BYTES,
    ) -> None:
        if not _is_int(num_byzantine) or num_byzantine < 0:
            raise ValueError(f"num_byzantine: expected an integer >= 0, got {num_byzantine!r}")
        if not _is_int(num_selected) or num_selected < 1:
            raise ValueError(f"num_selected: expected an integer >= 1, got {num_selected!r}")
        super().__init__(exclude_vars=exclude_vars, block_bytes=block_bytes)
        self._num_byzantine = num_byzantine
        self._num_selected = num_selected
        self._weights = check_aggregation_weights(aggregation_weights)
        self._weigh_by_local_iter = weigh_by_local_iter
        self._max_local_steps = check_max_local_steps(max_local_steps)

    def needed_results(self) -> int:
        """The fewest results a round needs: ``max(2f + 3, f + num_selected)``."""
        return max(2 * self._num_byzantine + 3, self._num_byzantine + self._num_selected)

    def _weight(self, model: FLModel, contributor: str) -> float:
        weight = self._weights.get(contributor, 1.0)
        if self._weigh_by_local_iter:
            weight *= local_steps(model.meta, contributor, self._max_local_steps)
        return weight

    def assumed(self, count: int) -> tuple[int, int]:
        """``(f, m)`` for a round of ``count`` results: the configured ones, or the most that fit.

        With fewer than `needed_results` (sites died, or their results were refused: a refused
        result is a liar already left out), Krum assumes as many Byzantine sites as the results
        allow, ``f = (count - 3) // 2`` (at least 0), and selects at most ``count - f``, instead of
        failing the round: a liar whose result is refused must not be able to stop the job.
        """
        if count >= self.needed_results():
            return self._num_byzantine, self._num_selected
        byzantine = max(0, min(self._num_byzantine, (count - 3) // 2))
        selected = max(1, min(self._num_selected, count - byzantine))
        logger.warning(
            "krum: %d results, fewer than the %d that num_byzantine = %d and num_selected = %d need; "
            "assuming num_byzantine = %d and selecting %d this round",
            count,
            self.needed_results(),
            self._num_byzantine,
            self._num_selected,
            byzantine,
            selected,
        )
        return byzantine, selected

    def _aggregate(self, results: list[KeptResult]) -> Aggregate:
        byzantine, count = self.assumed(len(results))
        distances = pairwise_sq_distances(results, self._block_bytes)
        scores = krum_scores(distances, byzantine)
        ranking = sorted(range(len(results)), key=lambda i: (scores[i], results[i].contributor))
        selected = [results[i] for i in ranking[:count]]
        total = sum(result.weight for result in selected)
        if total <= 0:
            raise ValueError(f"the selected results' total weight is {total}; no mean exists")
        weights = [result.weight / total for result in selected]

        def weighted_mean(rows: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
            torch.mul(rows[0], weights[0], out=spare)
            for row, weight in zip(rows[1:], weights[1:], strict=True):
                spare.add_(row, alpha=weight)
            return spare

        params = {
            name: combine_values([result.params[name] for result in selected], weighted_mean, self._block_bytes)
            for name in selected[0].params
        }
        logger.info(
            "krum selection: selected=%s scores=%s",
            [result.contributor for result in selected],
            {result.contributor: scores[i] for i, result in enumerate(results)},
        )
        meta: dict[str, Any] = {
            "selected": [result.contributor for result in selected],
            "num_byzantine": byzantine,
            "krum_scores": {result.contributor: scores[i] for i, result in enumerate(results)},
        }
        return Aggregate(params, _weighted_metrics(selected), meta)


def _weighted_metrics(results: list[KeptResult]) -> dict[str, float] | None:
    names = dict.fromkeys(name for result in results for name in result.metrics)
    metrics = {}
    for name in names:
        reporting = [result for result in results if name in result.metrics]
        total = sum(result.weight for result in reporting)
        if total > 0:
            metrics[name] = sum(result.metrics[name] * result.weight for result in reporting) / total
    return metrics or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
