"""`DXOAggregator`: weighted mean of the DXOs clients return (NVIDIA FLARE's InTimeAccumulateWeightedAggregator)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine.aggregators.aggregator import (
    DEFAULT_MAX_LOCAL_STEPS,
    Aggregator,
    check_aggregation_weights,
    check_max_local_steps,
    local_steps,
    numeric_metrics,
)
from engine.aggregators.folding import FoldingModelAggregator
from engine.aggregators.weighted import WeightedAggregationHelper, release_values
from engine.errors import ResultRefused
from engine.model import DXO, DataKind, ReservedHeaderKey, ReturnCode, Shareable, shown_round

logger = logging.getLogger(__name__)

_AGGREGATABLE_KINDS = (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF, DataKind.METRICS)


class DXOAggregator(Aggregator):
    """Fold each accepted DXO into a running weighted sum as it arrives (in-time accumulation).

    A result is refused (``accept`` returns False and logs why) when its return code is not OK,
    it carries no DXO or one of another kind than ``expected_data_kind``, its
    ``current_round`` header names another round, its contributor was already accepted, or its
    data does not fit the sum. A result's weight is its DXO's ``NUM_STEPS_CURRENT_ROUND`` meta
    (1.0 with a warning when absent; 1.0 always when ``weigh_by_local_iter`` is False) times
    ``aggregation_weights.get(contributor, 1.0)``. The numeric entries of a DXO's ``metrics``
    meta (where the Client API puts the training script's metrics) are averaged with the same
    weights into the aggregate's ``metrics`` meta.

    Once a result has been added, ``release()`` is called on each of its data values that has one
    (lazy references to tensors on disk implement it to drop their temp file; plain tensors have
    none): the aggregator is the last user of an accepted result's data. Refused results are left
    to the caller.

    Args:
        exclude_vars: Regex of data names left out of the aggregate; None keeps all.
        aggregation_weights: Client name -> extra weight factor (default 1.0 for each).
        expected_data_kind: ``"WEIGHTS"``, ``"WEIGHT_DIFF"`` or ``"METRICS"``.
        weigh_by_local_iter: Whether to weight by ``NUM_STEPS_CURRENT_ROUND``.
        max_local_steps: The largest ``NUM_STEPS_CURRENT_ROUND`` a result may claim; a result
            above it (or at most 0) is refused.

    Example:
        In ``config_fed_server.conf``::

            { id = aggregator, path = engine.aggregators.DXOAggregator,
              args { expected_data_kind = WEIGHT_DIFF, aggregation_weights { site-1 = 2.0 } } }
    """

    def __init__(
        self,
        exclude_vars: str | None = None,
        aggregation_weights: dict[str, float] | None = None,
        expected_data_kind: str = "WEIGHT_DIFF",
        weigh_by_local_iter: bool = True,
        max_local_steps: float = DEFAULT_MAX_LOCAL_STEPS,
    ) -> None:
        kinds = ", ".join(kind.value for kind in _AGGREGATABLE_KINDS)
        try:
            self._kind = DataKind(expected_data_kind)
        except ValueError as e:
            raise ValueError(f"expected_data_kind: expected one of {kinds}, got {expected_data_kind!r}") from e
        if self._kind not in _AGGREGATABLE_KINDS:
            raise ValueError(f"expected_data_kind: expected one of {kinds}, got {expected_data_kind!r}")
        self._weights = check_aggregation_weights(aggregation_weights)
        self._weigh_by_local_iter = weigh_by_local_iter
        self._max_local_steps = check_max_local_steps(max_local_steps)
        self._helper = WeightedAggregationHelper(exclude_vars=exclude_vars)
        self._excludes = bool(exclude_vars)
        self._metrics = WeightedAggregationHelper()
        self._contributors: set[str] = set()
        self._lock = threading.Lock()

    @property
    def expected_data_kind(self) -> DataKind:
        """The kind of DXO this aggregator accepts and returns."""
        return self._kind

    def folding_twin(self) -> FoldingModelAggregator | None:
        """A `FoldingModelAggregator` that makes this aggregator's mean, for results folded chunk by chunk.

        The same weights (``aggregation_weights`` x ``NUM_STEPS_CURRENT_ROUND``, bounded by
        ``max_local_steps``) and sums; None when no twin makes the same aggregate: a subclass
        (it may aggregate otherwise), ``exclude_vars`` set, or METRICS expected.
        """
        if type(self) is not DXOAggregator or self._excludes or self._kind is DataKind.METRICS:
            return None
        return FoldingModelAggregator(
            aggregation_weights=self._weights,
            weigh_by_local_iter=self._weigh_by_local_iter,
            max_local_steps=self._max_local_steps,
        )

    def accept(self, shareable: Shareable, contributor: str, current_round: int) -> bool:
        """Add ``contributor``'s result for ``current_round`` to the sum; False (logged) if refused."""
        dxo = self._acceptable_dxo(shareable, contributor, current_round)
        if dxo is None:
            return False
        try:
            weight = self._weights.get(contributor, 1.0)
            if self._weigh_by_local_iter:
                weight *= local_steps(dxo.meta, contributor, self._max_local_steps)
            metrics = numeric_metrics(dxo.meta.get("metrics"), contributor)
            with self._lock:
                if contributor in self._contributors:
                    _refuse(contributor, current_round, "a result of this contributor was already accepted")
                    return False
                self._helper.add(dxo.data, weight, contributor, current_round)
                if metrics:
                    self._metrics.add(metrics, weight, contributor, current_round)
                self._contributors.add(contributor)
        except ResultRefused as e:
            _refuse(contributor, current_round, str(e))
            return False
        release_values(dxo.data)
        shown = shown_round(current_round)
        logger.info("result accepted: contributor=%s round=%d weight=%s", contributor, shown, weight)
        return True

    def _acceptable_dxo(self, shareable: Shareable, contributor: str, current_round: int) -> DXO | None:
        """The result's DXO if its headers and kind allow aggregating it; None (logged) otherwise."""
        try:
            return acceptable_dxo(shareable, current_round, self._kind)
        except ResultRefused as e:
            _refuse(contributor, current_round, str(e))
            return None

    def aggregate(self, current_round: int) -> Shareable:
        """Return the weighted mean as a DXO of ``expected_data_kind`` in a Shareable, then reset.

        The DXO's meta is ``{"nr_aggregated": n, "current_round": current_round}``, plus
        ``metrics`` (their weighted mean) when accepted results reported numeric metrics.

        Raises:
            RuntimeError: No result was accepted.
        """
        with self._lock:
            count = self._helper.get_len()
            data = self._helper.get_result()
            metrics = self._metrics.get_result() if self._metrics.get_len() else None
            self._metrics.reset_stats()
            self._contributors.clear()
        logger.info(
            "results aggregated: round=%d nr_aggregated=%d kind=%s", shown_round(current_round), count, self._kind.value
        )
        meta: dict[str, Any] = {"nr_aggregated": count, "current_round": current_round}
        if metrics:
            meta["metrics"] = metrics
        return DXO(self._kind, data, meta).to_shareable()

    def reset(self) -> None:
        """Forget every accepted result."""
        with self._lock:
            self._helper.reset_stats()
            self._metrics.reset_stats()
            self._contributors.clear()


def acceptable_dxo(shareable: Shareable, current_round: int, kind: DataKind) -> DXO:
    """The DXO of a result that may be aggregated in ``current_round`` as ``kind``.

    Raises:
        ResultRefused: The return code is not OK (or names no known value), the
            ``current_round`` header names another round, the result carries no DXO, or its DXO
            is of another kind.
    """
    try:
        code = shareable.get_return_code()
    except ValueError as e:  # a return code that names no known value
        raise ResultRefused(str(e)) from e
    if code is not ReturnCode.OK:
        raise ResultRefused(f"return code is {code.value}")
    result_round = shareable.get_header(ReservedHeaderKey.CURRENT_ROUND)
    if result_round is not None and result_round != current_round:
        raise ResultRefused(f"it is a result of round {shown_round(result_round)}")
    try:
        dxo = DXO.from_shareable(shareable)
        if dxo.data_kind != kind:
            raise ResultRefused(f"data kind is {DataKind(dxo.data_kind).value}, expected {kind.value}")
    except ResultRefused:
        raise
    except (TypeError, ValueError) as e:  # no DXO, or a data kind that names no known value
        raise ResultRefused(str(e)) from e
    return dxo


def _refuse(contributor: str, current_round: int, why: str) -> None:
    logger.warning("result refused: contributor=%s round=%d reason=%s", contributor, shown_round(current_round), why)


#: NVIDIA FLARE's name for the same aggregator, so configs ported from FLARE read naturally.
InTimeAccumulateWeightedAggregator = DXOAggregator
