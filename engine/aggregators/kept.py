"""`KeptResultsAggregator`: keep a round's results, then combine them block by block.

The robust rules (median, trimmed mean, Krum) need every result at once, so they cannot fold
results into a running sum as they arrive. They keep what each result holds (tensors, arrays,
or lazy references to tensors in downloaded files) and, once the round's results are in, go
over the params name by name and block by block (`engine.aggregators.stacked`). Peak memory is
the output model plus about one block per client with lazy references; results that arrived in
memory stay there until the round ends.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.aggregators.aggregator import ModelAggregator, numeric_metrics
from engine.aggregators.check import check_params_match
from engine.aggregators.stacked import (
    PER_CLIENT_BLOCK_BYTES,
    check_block_bytes,
    compile_exclude_vars,
    settled_params,
)
from engine.aggregators.weighted import release_values
from engine.errors import ResultRefused
from engine.model import FLModel, ParamsType

logger = logging.getLogger(__name__)


def combine_metrics(results: Sequence[KeptResult], rule: Callable[[list[float]], float]) -> dict[str, float] | None:
    """Each metric name's values (from the results that report it) combined by ``rule``; None when none."""
    names = dict.fromkeys(name for result in results for name in result.metrics)
    combined = {name: rule([r.metrics[name] for r in results if name in r.metrics]) for name in names}
    return combined or None


@dataclass
class KeptResult:
    """One accepted result, kept until the round is aggregated.

    Attributes:
        contributor: Who sent it.
        params: Name -> tensor, array or lazy reference (excluded names left out).
        weight: Its weight, for the rules that weigh results (1.0 otherwise).
        metrics: Its numeric metrics.
    """

    contributor: str
    params: dict[str, Any]
    weight: float
    metrics: dict[str, Any]


@dataclass
class Aggregate:
    """What a rule makes of a round's results: params, metrics (None when none) and extra meta."""

    params: dict[str, Any]
    metrics: dict[str, Any] | None
    meta: dict[str, Any]


class KeptResultsAggregator(ModelAggregator):
    """A `ModelAggregator` that keeps every accepted result until `aggregate_model`.

    Results must all be FULL or all DIFF (the aggregate is of the same type), hold the same
    param names, shapes and dtypes as the first accepted one, and come from distinct
    contributors; a result that breaks this is refused (`ResultRefused`) and the others are kept.
    Once aggregated, or on `reset_stats`, each kept result's lazy values are released (see
    `release_values`). Safe to call from several threads.

    Subclasses implement `_aggregate` (and `_check_count` when the rule needs a number of
    results) and may weigh results by overriding `_weight`.

    Args:
        exclude_vars: Regex of param names left out of the aggregate; None keeps all.
        block_bytes: Bytes of one client's block (see `PER_CLIENT_BLOCK_BYTES`).
    """

    #: The rule's name in log lines.
    rule_name = "kept"

    def __init__(self, exclude_vars: str | None = None, block_bytes: int = PER_CLIENT_BLOCK_BYTES) -> None:
        self._exclude = compile_exclude_vars(exclude_vars)
        self._block_bytes = check_block_bytes(block_bytes)
        self._lock = threading.Lock()
        self._results: list[KeptResult] = []
        self._params_type: ParamsType | None = None

    def accept_model(self, model: FLModel, contributor: str) -> None:
        """Keep ``model`` for this round's aggregate.

        Raises:
            ResultRefused: The model has no params, a value that cannot be aggregated, another
                params type or other names, shapes or dtypes than the first accepted result,
                an invalid weight, or its contributor was already accepted.
        """
        if model.params is None:
            raise ResultRefused(f"result of {contributor} carries no params; nothing to aggregate")
        params_type = ParamsType(model.params_type)
        weight = self._weight(model, contributor)
        metrics = numeric_metrics(model.metrics, contributor)
        params, excluded = settled_params(model.params, self._exclude, contributor)
        with self._lock:
            if any(result.contributor == contributor for result in self._results):
                raise ResultRefused(f"{contributor} already contributed to this round; a second result is refused")
            if self._params_type is not None and params_type is not self._params_type:
                raise ResultRefused(
                    f"result of {contributor} has {params_type.value} params but the accepted ones are "
                    f"{self._params_type.value}; all results of a round must be of one type"
                )
            if self._results:
                first = self._results[0]
                try:
                    check_params_match(first.params, params, contributor)
                except ResultRefused as e:
                    raise ResultRefused(
                        f"{e} (compared with the first accepted result, of {first.contributor}: every result "
                        f"of a round must hold the same params)"
                    ) from e
            self._results.append(KeptResult(contributor, params, weight, metrics))
            self._params_type = params_type
        release_values(excluded)
        logger.debug("result kept: aggregator=%s contributor=%s weight=%s", self.rule_name, contributor, weight)

    def aggregate_model(self) -> FLModel:
        """Combine the kept results into one `FLModel`, release them and forget them.

        The result's meta holds ``nr_aggregated`` (the number of results) and what the rule
        adds (e.g. Krum's ``selected``).

        Raises:
            RuntimeError: No result, or fewer than the rule needs, was accepted (the results
                are kept).
        """
        with self._lock:
            if not self._results:
                raise RuntimeError("nothing to aggregate: no result was accepted")
            self._check_count(len(self._results))
            results, params_type = self._results, self._params_type
            self._results, self._params_type = [], None
        try:
            aggregate = self._aggregate(results)
        finally:
            for result in results:
                release_values(result.params)
        logger.info(
            "models aggregated: aggregator=%s nr_aggregated=%d params_type=%s",
            self.rule_name,
            len(results),
            params_type.value if params_type is not None else "None",
        )
        meta = {"nr_aggregated": len(results), **aggregate.meta}
        return FLModel(params=aggregate.params, params_type=params_type, metrics=aggregate.metrics, meta=meta)

    def reset_stats(self) -> None:
        """Forget every kept result (their lazy values are released)."""
        with self._lock:
            results, self._results, self._params_type = self._results, [], None
        for result in results:
            release_values(result.params)

    def _weight(self, model: FLModel, contributor: str) -> float:
        """A result's weight; 1.0 for the rules that do not weigh results."""
        return 1.0

    def _check_count(self, count: int) -> None:  # noqa: B027 - any count of at least one will do by default
        """Raise RuntimeError when ``count`` results are too few for the rule."""

    @abstractmethod
    def _aggregate(self, results: list[KeptResult]) -> Aggregate:
        """Combine the round's results (at least one, all of the same layout)."""
